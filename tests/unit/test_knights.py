"""Knights and knaves: unique solutions, the exact verifier on right, wrong and malformed."""

import pytest

from echorl.tasks.knights import KnightsKnaves, consistent, parse_answer, solutions


def test_every_puzzle_has_exactly_one_consistent_assignment():
    task = KnightsKnaves()
    prompts = set()
    for seed in range(300):
        p = task.problem(seed)
        said = task.statements(seed)
        assert solutions(said) == [tuple(p.data["kinds"])]
        assert len(p.answer) == 3 and set(p.answer) <= {"K", "N"}
        prompts.add(p.prompt)
    assert len(prompts) > 250
    assert task.problem(5) == task.problem(5)


def test_the_rules_by_hand():
    # A: "B is a knave". B: "A and I are the same kind". Only A knight, B knave fits:
    said = [("is", 1, False), ("same", 0, 1)]
    assert consistent(said, (True, False))
    assert not consistent(said, (True, True))  # B would be a knight saying something false
    assert solutions(said) == [(True, False)]


@pytest.mark.parametrize(
    "answer,score",
    [
        ("KNK", 1.0),
        ("knk", 1.0),
        ("K N K", 1.0),
        ("A=K B=N C=K", 1.0),
        ("A: knight, B: knave, C: knight", 1.0),
        ("KNK\nsomething else", 1.0),
        ("NKN", 0.0),  # wrong
        ("KN", 0.0),  # too short
        ("KNKK", 0.0),  # too long
        ("A=K B=N", 0.0),  # C missing
        ("", 0.0),
        ("\x00\xff", 0.0),
        ("\nKNK", 0.0),  # the answer is the first line
    ],
)
def test_verifier_on_right_wrong_and_malformed(answer, score):
    task = KnightsKnaves()  # the fixtures are written for a puzzle whose answer is KNK
    p = next(task.problem(s) for s in range(1000) if task.problem(s).answer == "KNK")
    assert task.score(p, answer) == score


def test_text_style_for_real_checkpoints():
    task = KnightsKnaves(name="knights_text", style="text", people=3)
    p = task.problem(1)
    assert "knights always tell the truth" in p.prompt and p.prompt.endswith("Answer:")
    assert task.score(p, " " + p.answer) == 1.0
    assert parse_answer("A is a knight", 3) is None
