"""DAPO's dynamic sampling through the swarm: the broker sets flat groups aside and refills
their place with fresh prompts, so every step trains on B informative groups, in both
protocols; the refill rate is logged."""

import json

import pytest

from tests.integration.conftest import echorl_run, query, read_jsonl


@pytest.mark.long  # ~25 s each: CI's second stage, beside the default suite's 15 minutes
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_step_has_b_informative_groups(tmp_path, warm_add, mode):
    out = tmp_path / mode
    echorl_run(
        out,
        f"model.path={warm_add}",
        f"broker.mode={mode}",
        "train.dynamic_sampling=true",
        "train.dynamic_sampling_max=50",  # never reached here: every step refilled in full
        "train.steps=5",
        "train.batch_prompts=4",
        "train.group_size=4",
        "train.eval_prompts=8",
        "train.eval_every=0",
        "sampling.temperature=0.7",  # the warmed model is often all right: flat groups
    )
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert all(r["rollout/groups_flat_frac"] == 0.0 for r in train)  # B informative, each step
    flat = query(out / "broker", "SELECT COUNT(*) FROM rollouts WHERE flat = 1")[0][0]
    assert flat > 0, "no flat group was drawn: the test shows nothing"
    assert train[-1]["broker/flat_refilled"] <= flat  # logged as the trainer last pulled
    assert 0 < train[-1]["rollout/refill_rate"] < 1
    consumed = query(
        out / "broker", "SELECT consumed_step, rewards FROM rollouts WHERE state = 'consumed'"
    )
    assert len(consumed) == 5 * 4
    assert all(len(set(json.loads(r))) > 1 for _, r in consumed)
