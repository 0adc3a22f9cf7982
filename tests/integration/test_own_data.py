"""Your own data and rewards through the swarm: `echorl run` on a JSONL or a Parquet file
with two weighted TRL-style reward functions; the broker scores them, each reward's mean
reaches the trainer's metrics, and evaluation runs on the dataset's held-out rows."""

import json
import random
import subprocess
import sys

import pytest

from tests.integration.conftest import echorl_run, query, read_jsonl

REWARDS = """
def correct(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]

def short(prompts, completions, **kwargs):
    return [-min(len(c), 10) / 10 for c in completions]
"""


def write_data(folder, kind: str):
    """Two-digit sums as the `add` task writes them (the warmed model knows the format)."""
    rng = random.Random(0)
    rows = []
    for _ in range(300):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"prompt": f"{a}+{b}=", "answer": a + b, "source": "mine"})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rewards.py").write_text(REWARDS)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet

        pyarrow.parquet.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    else:
        (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        f"task.dataset={folder / f'train.{kind}'}",
        f"task.rewards=[{folder}/rewards.py:correct, {folder}/rewards.py:short]",
        "task.reward_weights=[1.0, 0.1]",
        "task.max_new_tokens=8",
    ]


@pytest.mark.parametrize("kind,mode", [("jsonl", "sync"), ("parquet", "async")])
def test_two_weighted_rewards_over_my_file_reach_the_trainer(tmp_path, warm_add, kind, mode):
    task = write_data(tmp_path / "data", kind)
    out = tmp_path / "run"
    echorl_run(
        out,
        *task,
        f"model.path={warm_add}",
        f"broker.mode={mode}",
        "train.steps=4",
        "train.batch_prompts=4",
        "train.group_size=4",
        "train.eval_prompts=16",
        "train.eval_every=0",
    )
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:  # the broker's reward is the weighted sum of the two, to the last bit
        assert r["reward/mean"] == pytest.approx(r["rewards/correct"] + 0.1 * r["rewards/short"])
        assert -1.0 <= r["rewards/short"] < 0.0 and 0.0 <= r["rewards/correct"] <= 1.0
    assert max(r["rewards/correct"] for r in train) > 0  # the warmed model adds right
    # Scored where trust lives: every consumed group's parts are the broker's, 4 + 4 values.
    parts = query(out / "broker", "SELECT parts FROM rollouts WHERE state = 'consumed'")
    assert len(parts) == 16
    for (p,) in parts:
        assert {k: v[1] for k, v in json.loads(p).items()} == {"correct": 4, "short": 4}
    final = read_jsonl(out / "metrics.jsonl")[-1]
    assert "eval/accuracy" in final  # the dataset's own held-out rows
    # And `echorl eval` on the same data, the run's model.
    shown = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "eval", "--model", str(out), "--n", "16"]
        + [x for o in task for x in ("-o", o)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "held-out greedy accuracy" in shown.stdout and "data:train@" in shown.stdout
