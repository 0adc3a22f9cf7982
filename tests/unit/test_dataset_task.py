"""Your own data and rewards (TRL's reward functions): every file kind reads the same rows,
each function gets the columns it names, the weighted sum is the reward and each reward's
mean reaches the trainer; chat messages go through the template; the held-out split."""

import json
from pathlib import Path

import pytest

from echorl.config import ConfigError, load_config
from echorl.models.tokenizer import RunTokenizer, build_byte_tokenizer
from echorl.protocol import Completion
from echorl.rollout.verify import VerifierPool, VerifierSpec
from echorl.tasks import get_task, take
from echorl.tasks.base import is_heldout
from echorl.tasks.dataset import read_rows
from echorl.trainer.colocated import reward_metrics

CODEC = RunTokenizer.builtin()
REWARDS = """
def correct(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]

def short(prompts, completions, **kwargs):
    return [-len(c) / 10 for c in completions]

def only_hard(prompts, completions, level, **kwargs):
    return [1.0 if lv == "hard" else None for lv in level]

def seen(prompts, completions, **kwargs):  # what a conversational dataset passes
    return [float(isinstance(p, list) and c[0]["role"] == "assistant") for p, c in zip(prompts, completions)]

def broken(prompts, completions, **kwargs):
    return [1.0, 2.0]
"""
ROWS = [
    {"prompt": f"{a}+{b}=", "answer": a + b, "level": "hard" if a > 6 else "easy"}
    for a in range(10)
    for b in range(10)
]


@pytest.fixture
def data(tmp_path) -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return tmp_path


def task_of(data: Path, *overrides: str, dataset: str = "train.jsonl"):
    cfg = load_config(None, [f"task.dataset={data / dataset}", *overrides])
    return cfg, get_task(cfg.task.spec)


def rewards(data: Path, *names: str) -> str:
    return "task.rewards=[" + ", ".join(f"{data / 'rewards.py'}:{n}" for n in names) + "]"


def test_every_file_kind_reads_the_same_rows(data):
    import datasets
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet

    table = pa.Table.from_pylist(ROWS)
    pyarrow.parquet.write_table(table, data / "train.parquet")
    pyarrow.csv.write_csv(table, data / "train.csv")
    (data / "train.json").write_text(json.dumps(ROWS))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(data / "hf")
    for kind in ("train.jsonl", "train.json", "train.csv", "train.parquet", "hf"):
        assert read_rows(str(data / kind)) == ROWS, kind
    # One task whichever file holds the rows: the name is their content's, not the path's.
    names = {
        task_of(data, rewards(data, "correct"), dataset=k)[1].name
        for k in ("train.jsonl", "train.parquet")
    }
    assert len(names) == 1
    with pytest.raises(ValueError, match="is a .jsonl, .json, .csv, .parquet file"):
        read_rows(str(data / "rewards.py"))


def test_the_reward_is_the_weighted_sum_and_each_reward_is_tallied(data):
    _, task = task_of(
        data, rewards(data, "correct", "short", "only_hard"), "task.reward_weights=[1, 0.5, 2]"
    )
    p = take(task, 1, 0)[0]
    assert p.data["columns"] == {"answer": int(p.answer), "level": p.data["columns"]["level"]}
    hard = p.data["columns"]["level"] == "hard"
    right = task.score(p, p.answer)
    assert right == pytest.approx(1.0 - 0.5 * len(p.answer) / 10 + (2.0 if hard else 0.0))
    assert task.score(p, "wrong!") == pytest.approx(-0.5 * 0.6 + (2.0 if hard else 0.0))
    tally = task.drain_tally()
    assert tally["correct"] == (1.0, 2) and tally["short"][1] == 2
    assert tally.get("only_hard", (0, 0))[1] == (2 if hard else 0)  # None: not counted
    assert task.drain_tally() == {}


def test_the_verifier_pool_scores_them_and_the_trainer_logs_each_mean(data):
    cfg, task = task_of(data, rewards(data, "correct", "short"), "task.reward_weights=[1, 0.1]")
    seeds = [p.seed for p in take(task, 6, 0)]

    def completion(text: str) -> Completion:
        ids = CODEC.encode(text)
        return Completion(token_ids=ids, logprobs=[-0.1] * len(ids), finished=True)

    items = [(s, [completion(task.problem(s).answer), completion("nope")]) for s in seeds]
    with VerifierPool(VerifierSpec.for_run(cfg, CODEC), workers=1) as pool:
        verdicts = pool.score(items)
    for (s, _), v in zip(items, verdicts):
        answer = task.problem(s).answer
        assert v.rewards == pytest.approx([1 - 0.01 * len(answer), -0.04])
        assert v.parts["correct"] == (1.0, 2)
    from echorl.rollout.generate import _group

    groups = [_group(s, 0, [1], c, v.rewards, v.parts) for (s, c), v in zip(items, verdicts)]
    record = reward_metrics(groups)
    assert record["rewards/correct"] == 0.5
    short = sum(v.parts["short"][0] for v in verdicts) / 12
    assert record["rewards/short"] == pytest.approx(short)
    assert record["reward/mean"] == pytest.approx(0.5 + 0.1 * short)


def test_a_broken_reward_is_the_verifiers_error_not_a_crash(data):
    cfg, task = task_of(data, rewards(data, "broken"))
    ids = CODEC.encode("3")
    c = Completion(token_ids=ids, logprobs=[-0.1], finished=True)
    with VerifierPool(VerifierSpec.for_run(cfg, CODEC), workers=1) as pool:
        (v,) = pool.score([(take(task, 1, 0)[0].seed, [c, c])])
    assert v.rewards == [0.0, 0.0] and v.failed == {"error": 2}
    assert "not a list of one float" in v.error


def test_chat_messages_go_through_the_template_and_reach_rewards_as_messages(data):
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"{k}?"},
            ]
        }
        for k in range(40)
    ]
    (data / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, task = task_of(data, rewards(data, "seen"), dataset="chat.jsonl")
    p = take(task, 1, 0)[0]
    assert p.query == p.data["messages"] and p.prompt.startswith("system: Be brief.\nuser: ")
    assert task.score(p, "ok") == 1.0
    tok = build_byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    codec = RunTokenizer.from_hf(tok)
    from echorl.config import SamplingConfig

    # The messages' own system turn wins over sampling.system_prompt; plain format or not.
    ids = codec.encode_prompt(p.query, SamplingConfig(system_prompt="ignored"))
    assert (
        codec.decode(ids)
        == f"<system>Be brief.\n<user>{p.data['messages'][1]['content']}\n<assistant>"
    )
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        CODEC.encode_prompt(p.query, SamplingConfig())


def test_the_held_out_rows_are_the_eval_files_or_a_fraction(data):
    (data / "test.jsonl").write_text(json.dumps({"prompt": "99+1=", "answer": 100}) + "\n")
    _, task = task_of(data, rewards(data, "correct"), f"task.eval_dataset={data / 'test.jsonl'}")
    assert {p.prompt for p in take(task, 5, 0, "eval")} == {"99+1="}
    assert "99+1=" not in {p.prompt for p in take(task, 300, 0)}
    _, task = task_of(data, rewards(data, "correct"), "task.eval_fraction=0.5")
    held = {r["prompt"] for r in task.splits[1]}
    assert 30 <= len(held) <= 70  # about half of 100, by each prompt's hash
    assert not held & {p.prompt for p in take(task, 200, 0)}
    assert held >= {p.prompt for p in take(task, 200, 0, "eval")}


def test_a_small_training_file_beside_a_large_eval_file_is_drawn_as_often(data):
    """10 training rows beside 10,000 held-out ones: each split has half the seed space (one
    list of both made a training draw 1 in 1,000, and the broker gave up on a job after
    1,000 draws)."""
    (data / "few.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:10]))
    many = [{"prompt": f"{a}*{b}=", "answer": a * b} for a in range(100) for b in range(100)]
    (data / "many.jsonl").write_text("".join(json.dumps(r) + "\n" for r in many))
    _, task = task_of(
        data,
        rewards(data, "correct"),
        f"task.eval_dataset={data / 'many.jsonl'}",
        dataset="few.jsonl",
    )
    drawn = [task.problem(seed) for seed in range(1000)]
    train = [p for p in drawn if not is_heldout(p)]
    assert 450 <= len(train) <= 550 and {p.prompt for p in train} == {
        r["prompt"] for r in ROWS[:10]
    }
    assert all("*" in p.prompt for p in drawn if is_heldout(p))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task.rewards=[x.py:f]"], "task.rewards is for your own data: set task.dataset too"),
        (["task.dataset={d}/train.jsonl"], "needs at least one reward function"),
        (
            [
                "task.dataset={d}/train.jsonl",
                "task.name=countdown",
                "task.rewards=[{d}/rewards.py:correct]",
            ],
            "are two tasks",
        ),
        (["task.dataset={d}/nope.jsonl", "task.rewards=[{d}/rewards.py:correct]"], "no such file"),
        (
            ["task.dataset={d}/train.jsonl", "task.rewards=[{d}/rewards.py:nope]"],
            "has no function 'nope'",
        ),
        (
            [
                "task.dataset={d}/train.jsonl",
                "task.rewards=[{d}/rewards.py:correct]",
                "task.reward_weights=[1, 2]",
            ],
            "2 weights for 1 rewards",
        ),
        (
            [
                "task.dataset={d}/train.jsonl",
                "task.rewards=[{d}/rewards.py:correct]",
                "task.prompt_column=question",
            ],
            "has no 'question' column",
        ),
    ],
)
def test_bad_dataset_settings_are_named(data, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [o.format(d=data) for o in overrides])
