import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echorl.tasks import TASKS, get_task, is_heldout, take
from echorl.tasks.countdown import InvalidExpression, evaluate


@pytest.mark.parametrize("name", sorted(TASKS))
def test_demonstrations_score_one_and_streams_are_reproducible(name):
    task = get_task(name)
    problems = take(task, 50, seed=7)
    assert problems == take(task, 50, seed=7)
    assert problems != take(task, 50, seed=8)
    for p in problems:
        assert task.score(p, task.demonstration(p)) == 1.0
        assert task.score(p, task.demonstration(p) + "\ntrailing text") == 1.0
        assert len(task.demonstration(p)) + 1 <= task.max_new_tokens


@pytest.mark.parametrize("name", sorted(TASKS))
def test_heldout_problems_never_appear_in_training(name):
    task = get_task(name)
    train = {p.prompt for p in take(task, 2000, seed=0)}
    heldout = take(task, 200, seed=0, split="eval")
    assert all(is_heldout(p) for p in heldout)
    assert not train & {p.prompt for p in heldout}


@pytest.mark.parametrize("name", sorted(TASKS))
@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=80))
def test_verifiers_never_raise_on_arbitrary_text(name, text):
    task = get_task(name)
    p = take(task, 1, seed=1)[0]
    assert task.score(p, text) in (0.0, 1.0)


def test_arithmetic_right_wrong_malformed():
    task = get_task("add")
    p = task.problem(0)
    a, b = p.prompt[:-1].split("+")
    assert p.answer == str(int(a) + int(b))
    assert task.score(p, p.answer) == 1.0
    assert task.score(p, f"  {p.answer} ") == 1.0
    assert task.score(p, str(int(p.answer) + 1)) == 0.0
    assert task.score(p, p.answer + "0") == 0.0
    assert task.score(p, "") == 0.0
    assert task.score(p, "\n" + p.answer) == 0.0  # the answer is the first line


def test_reverse_right_wrong_malformed():
    task = get_task("reverse")
    p = task.problem(3)
    word = p.prompt[len("rev:") : -1]
    assert task.score(p, word[::-1]) == 1.0
    assert task.score(p, word) == (1.0 if word == word[::-1] else 0.0)
    assert task.score(p, word[::-1][:-1]) == 0.0
    assert task.score(p, "\x00\xff") == 0.0


def test_countdown_accepts_any_right_expression():
    task = get_task("countdown")
    p = task.problem(11)
    p = type(p)(p.task, p.seed, "1 2 3>7:", "1+2*3", {"numbers": [1, 2, 3], "target": 7})
    assert task.score(p, "1+2*3") == 1.0
    assert task.score(p, "3*2+1") == 1.0
    assert task.score(p, "(3*2)+1") == 1.0
    assert task.score(p, "1+2+3") == 0.0  # 6, wrong value
    assert task.score(p, "2*3+1+1") == 0.0  # number used twice
    assert task.score(p, "7") == 0.0  # numbers not used
    assert task.score(p, "1+2*3)") == 0.0  # malformed


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('true')",
        "2**100",
        "1 if 1 else 2",
        "a+1",
        "[1]",
        "1/0",
        "1.5+2",
        "-1+3",
        "(1" * 40 + ")" * 40,
    ],
)
def test_countdown_evaluator_rejects_everything_but_arithmetic(expr):
    with pytest.raises(InvalidExpression):
        evaluate(expr)


def test_countdown_evaluator_is_exact():
    value, used = evaluate("(7+1)/3*3")
    assert value == 8 and used == [7, 1, 3, 3]


def test_unknown_task_names_the_choices():
    with pytest.raises(KeyError, match="built-in tasks are"):
        get_task("chess")


def test_user_tasks_that_fail_to_import_or_score_are_named_not_raised(tmp_path, monkeypatch):
    import math

    from echorl.tasks import get_task
    from echorl.tasks.base import Problem, safe_score

    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_mod.py").write_text("undefined_name\n")
    with pytest.raises(ValueError, match="importing broken_mod raised NameError"):
        get_task("broken_mod:T")

    class NaN:
        name = "nan"

        def score(self, problem, completion):
            return math.nan

    assert safe_score(NaN(), Problem("nan", 0, "p", "a"), "x") == 0.0
