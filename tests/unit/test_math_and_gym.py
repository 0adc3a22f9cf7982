"""Math (math-verify scoring, JSONL files, word problems) and the reasoning-gym adapter."""

import json
from pathlib import Path

import pytest

from echorl.config import ConfigError, load_config
from echorl.tasks import get_task
from echorl.tasks.math import MathJSONL, equivalent, extract_answer


@pytest.mark.parametrize(
    "completion,reference,right",
    [
        ("The answer is \\boxed{1/2}.", "0.5", True),
        ("\\boxed{0.5}", "1/2", True),
        ("so x = \\frac{1}{2}", "1/2", True),
        ("first \\boxed{3}, no wait: \\boxed{4}", "4", True),  # the last box counts
        ("work\nwork\n42", "42", True),  # no box: the last line
        ("\\boxed{\\frac{1}{8}}", "\\frac{1}{8}", True),
        ("\\boxed{1/3}", "0.5", False),
        ("43", "42", False),
        ("", "42", False),
        ("\\boxed{", "42", False),
        ("\\boxed{\\frac{1}{0}}", "1", False),
        ("\x00\xff{}}}", "1", False),
        ("9" * 5000, "1", False),  # capped before sympy sees it
    ],
)
def test_math_verify_scoring(completion, reference, right):
    assert equivalent(completion, reference) is right


def test_answer_extraction():
    assert extract_answer("a \\boxed{x^{2}} b") == "x^{2}"
    assert extract_answer("\n\n  7  \n\n") == "7"
    assert extract_answer("") == ""


def test_jsonl_tasks_from_a_users_file(tmp_path):
    sample = Path(__file__).parents[2] / "examples" / "math_sample.jsonl"
    task = get_task(f"jsonl:{sample}")
    assert len(task.rows) == 10 and task.problem(10).prompt == task.problem(0).prompt
    p = task.problem(0)
    assert task.score(p, task.demonstration(p)) == 1.0 and task.score(p, "\\boxed{0.5}") == 1.0
    assert task.score(p, "\\boxed{2}") == 0.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: each line needs 'prompt' and 'answer'"):
        MathJSONL(str(bad)).rows  # noqa: B018
    with pytest.raises(ConfigError, match="task.name: .*no such file"):
        load_config(None, [f"task.name=jsonl:{tmp_path}/missing.jsonl"])


def test_word_problems_have_exact_answers():
    task = get_task("math_word")
    for seed in range(200):
        p = task.problem(seed)
        assert int(p.answer) >= 0 and p.prompt.endswith("now? =")
        assert task.score(p, p.answer) == 1.0
        assert task.score(p, str(int(p.answer) + 1)) == 0.0
    assert task.problem(3) == task.problem(3)


@pytest.mark.parametrize("dataset", ["knights_knaves", "countdown", "sokoban"])
def test_reasoning_gym_datasets_by_name(dataset):
    task = get_task(f"rg:{dataset}")
    a, b = task.problem(5), task.problem(5)
    assert a == b and a.prompt  # deterministic for a seed
    assert task.problem(6).prompt != a.prompt
    assert task.score(a, task.demonstration(a)) == 1.0  # its own scoring, on its own answer
    assert task.score(a, "<answer>certainly not this</answer>") < 1.0
    assert task.score(a, "") < 1.0


def test_unknown_reasoning_gym_dataset_is_a_config_error():
    with pytest.raises(ConfigError, match="task.name: .*no dataset 'no_such_thing'"):
        load_config(None, ["task.name=rg:no_such_thing"])


def test_plain_numbers_are_compared_exactly_without_math_verify_and_parses_are_cached():
    from echorl.tasks.math import _parse, equivalent

    _parse.cache_clear()
    cases = [("14", "14", True), ("13", "14", False), ("0.5", "1/2", True), ("-3", "-3.0", True)]
    cases += [("1,000", "1000", True), ("$5$", "5", True), ("7.", "7", True)]
    for answer, reference, expected in cases:
        assert equivalent(answer, reference) is expected, (answer, reference)
    assert _parse.cache_info().currsize == 0  # no full parse for plain numbers
    assert equivalent("\\frac{1}{2}", "1/2") and equivalent("x+1", "1+x")
    assert not equivalent("abc", "14") and not equivalent("1/0", "5")
    assert not equivalent("12,34", "1234")  # not a plain number: math-verify decides
    before = _parse.cache_info().hits
    assert equivalent("\\frac{1}{2}", "1/2")  # the same answer again: both parses cached
    assert _parse.cache_info().hits == before + 2
