"""Faults in a running swarm: a sampler, the trainer and the broker killed with real signals.

Each run must finish with every step trained on exactly B groups, no group consumed twice,
and nothing acknowledged lost. The model is the random tiny one with long completions
(48 tokens), so a sampler spends most of its time mid-generation. Last, a swarm that cannot
learn (the random model scores 0 on every completion) must say so and stop.
"""

import os
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest
import torch

from echorl.models import save_tiny_model
from tests.integration.conftest import (
    free_port,
    query,
    read_jsonl,
    start_broker,
    start_sampler,
    start_trainer,
    stop_broker,
    wait_until,
)

pytestmark = pytest.mark.integration

B, G = 4, 4
RUN = [
    "-o",
    "task.name=add",
    "-o",
    f"train.batch_prompts={B}",
    "-o",
    f"train.group_size={G}",
    "-o",
    "sampling.max_new_tokens=48",
    "-o",
    "train.drop_flat_groups=false",
    "-o",
    "train.eval_prompts=8",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("faults") / "v0", "1m", seed=0)


def steps_done(out):
    return max((r["step"] for r in read_jsonl(out / "metrics.jsonl")), default=0)


def finish(proc, timeout=300):
    out = proc.communicate(timeout=timeout)[0]
    assert proc.returncode == 0, out
    return out


def stop_all(samplers):
    for s in samplers:
        if s.poll() is None:
            s.terminate()
    return [s.communicate(timeout=60)[0] for s in samplers]


def assert_each_step_consumed_once(data, steps, bound=0, b=B):
    rows = query(data, "SELECT job_id, version, consumed_step FROM rollouts WHERE state='consumed'")
    assert len(rows) == steps * b and len({j for j, _, _ in rows}) == steps * b
    assert Counter(step for _, _, step in rows) == {s: b for s in range(steps)}
    assert all(0 <= step - version <= bound for _, version, step in rows)


def test_kill_9_a_sampler_mid_generation(tmp_path, model):
    timeouts = ("-o", "broker.lease_seconds=3", "-o", "broker.sampler_timeout=3")
    broker, url = start_broker(tmp_path / "b", free_port(), *RUN, *timeouts)
    args = ("--jobs-per-lease", "1", *RUN)
    samplers = [start_sampler(url, model, name, *args) for name in ("victim", "survivor")]
    trainer = start_trainer(url, model, tmp_path / "t", "-o", "train.steps=6", *RUN)
    try:
        wait_until(lambda: steps_done(tmp_path / "t") >= 1, what="the first step")

        def victim_is_generating():
            return query(
                tmp_path / "b",
                "SELECT job_id FROM jobs JOIN samplers ON lease_owner = id "
                "WHERE jobs.state = 'leased' AND name = 'victim'",
            )

        held = wait_until(victim_is_generating, poll=0.005, what="the victim to hold a job")
        os.kill(samplers[0].pid, signal.SIGKILL)
        finish(trainer)
        victim = "SELECT state FROM samplers WHERE name = 'victim'"
        wait_until(lambda: query(tmp_path / "b", victim) == [("lost",)], what="victim lost")
    finally:
        outs = stop_all(samplers)
        stop_broker(broker)
    assert samplers[0].returncode == -signal.SIGKILL and samplers[1].returncode == 0, outs
    assert_each_step_consumed_once(tmp_path / "b", 6)
    (job_id,) = held[0]
    attempts, state = query(
        tmp_path / "b", "SELECT attempts, state FROM jobs WHERE job_id = ?", job_id
    )[0]
    assert attempts >= 1 and state == "done"  # leased again after the deadline, then finished
    assert query(tmp_path / "b", "SELECT sampler_id FROM rollouts WHERE job_id = ?", job_id)


def test_kill_9_the_trainer_then_resume(tmp_path, model):
    steps, out = 8, tmp_path / "t"
    run = [*RUN, "-o", "broker.mode=async", "-o", "broker.max_staleness=1"]
    broker, url = start_broker(tmp_path / "b", free_port(), *run)
    samplers = [start_sampler(url, model, "s0", *run)]
    common = ("-o", f"train.steps={steps}", "-o", "train.checkpoint_every=2", *run)
    try:
        first = start_trainer(url, model, out, *common)
        wait_until(lambda: steps_done(out) >= 5, what="step 5")
        os.kill(first.pid, signal.SIGKILL)  # after checkpoint 4, mid-way through later steps
        first.wait()
        resumed = start_trainer(url, model, out, *common, "--resume")
        shown = finish(resumed)
    finally:
        stop_all(samplers)
        stop_broker(broker)
    assert "resumed at step 4" in shown or "resumed at step 6" in shown, shown
    assert_resumed_exactly(out, tmp_path / "b", steps)


def test_samplers_holding_versions_the_resumed_trainer_forgot_drop_them(tmp_path, model):
    """Sync, so the resumed trainer needs new groups: the trainer is killed after publishing
    versions its last checkpoint does not hold, and the samplers hold one of them. Resumed,
    the broker's latest goes back; the samplers drop what they hold, fetch the broker's
    version and the run finishes. (Here the tiny model retrains bit for bit, so the new v5 is
    the old; a number re-published with other weights is told by its sha256:
    test_hostile's heartbeat claims, and the weights each batch was generated with.)"""
    steps, out, data = 10, tmp_path / "t", tmp_path / "b"
    broker, url = start_broker(data, free_port(), *RUN)
    metrics = {name: tmp_path / f"{name}.jsonl" for name in ("s0", "s1")}
    samplers = [start_sampler(url, model, n, "--metrics", str(m), *RUN) for n, m in metrics.items()]
    common = ("-o", f"train.steps={steps}", "-o", "train.checkpoint_every=4", *RUN)
    held = "SELECT MIN(version_held) FROM samplers WHERE state = 'alive'"
    trainers = [start_trainer(url, model, out, *common)]
    try:
        wait_until(lambda: (query(data, held)[0][0] or 0) >= 6, what="samplers holding v6")
        os.kill(trainers[0].pid, signal.SIGKILL)  # checkpoint 4 holds neither v5 nor v6
        trainers[0].wait()
        ahead = query(data, held)[0][0]
        trainers.append(start_trainer(url, model, out, *common, "--resume"))
        shown = finish(trainers[1], timeout=240)  # before the fix: the samplers looped on 409
    finally:
        stop_all(trainers)
        outs = stop_all(samplers)
        stop_broker(broker)
    assert "resumed at step 4" in shown, shown
    assert ahead >= 6 and all(s.returncode == 0 for s in samplers), outs
    assert not any("newer than the latest" in said for said in outs), outs
    batches = [r for m in metrics.values() for r in read_jsonl(m)]
    assert {r["version"] for r in batches} >= set(range(steps))
    went_back = []  # a sampler's own versions only go back when the trainer's did
    for m in metrics.values():
        seq = [r["version"] for r in read_jsonl(m)]
        went_back += [b for a, b in zip(seq, seq[1:]) if b < a]
    assert went_back and min(went_back) >= 5  # back to versions the resumed trainer published
    for r in batches:  # one version, one set of weights
        assert {x["weights"] for x in batches if x["version"] == r["version"]} == {r["weights"]}
    assert_resumed_exactly(out, data, steps, bound=0)


def assert_resumed_exactly(out, data, steps, bound=1):
    """A resumed trainer logged every step once, trained each on B groups, and its last
    checkpoint's consumed set is exactly what the broker holds as consumed."""
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if "reward/mean" in r] == list(range(1, steps + 1))
    assert_each_step_consumed_once(data, steps, bound=bound)
    state = torch.load(out / "checkpoints" / f"step_{steps:07d}" / "trainer_state.pt")
    consumed = state["extra"]["consumed"]
    assert len(consumed) == len(set(consumed)) == steps * B
    rows = query(data, "SELECT job_id FROM rollouts WHERE state = 'consumed'")
    assert set(consumed) == {r[0] for r in rows}


def test_restart_the_broker_mid_run(tmp_path, model):
    data, port = tmp_path / "b", free_port()
    broker, url = start_broker(data, port, *RUN)
    samplers = [start_sampler(url, model, "s0", *RUN)]
    trainer = start_trainer(url, model, tmp_path / "t", "-o", "train.steps=6", *RUN)
    try:
        wait_until(lambda: steps_done(tmp_path / "t") >= 2, what="step 2")
        os.kill(broker.pid, signal.SIGKILL)
        broker.wait()
        broker, url = start_broker(data, port, *RUN)  # same data dir, same address
        finish(trainer)
    finally:
        outs = stop_all(samplers)
        stop_broker(broker)
    assert samplers[0].returncode == 0, outs  # it waited for the broker and carried on
    assert_each_step_consumed_once(data, 6)


def test_a_trainer_left_with_no_sampler_says_why_and_stops(tmp_path, model):
    """Its only sampler leaves after 2 steps: the trainer reports the swarm as it waits, and
    once no sampler has been alive for launch.stall_timeout_s it exits 1 with the reason."""
    timeouts = ("-o", "broker.sampler_timeout=3", "-o", "launch.stall_timeout_s=6")
    broker, url = start_broker(tmp_path / "b", free_port(), *RUN, *timeouts)
    sampler = start_sampler(url, model, "only", *RUN)
    trainer = start_trainer(url, model, tmp_path / "t", "-o", "train.steps=50", *RUN, *timeouts)
    try:
        wait_until(lambda: steps_done(tmp_path / "t") >= 2, what="2 steps")
        stop_all([sampler])  # SIGTERM: it says goodbye, its state is "left"
        out = trainer.communicate(timeout=120)[0]
    finally:
        if trainer.poll() is None:
            trainer.kill()
        stop_broker(broker)
    said = " ".join(out.split())  # as printed, whatever the console's width
    assert trainer.returncode == 1, out
    assert "no groups for" in said and "0 samplers alive (1 left)" in said, out[-2000:]
    assert "the swarm is empty: no sampler alive for" in said, out[-2000:]
    assert steps_done(tmp_path / "t") < 50


@pytest.mark.long  # ~40 s: it waits out a stall timeout
def test_a_run_where_every_group_is_flat_warns_then_stops_naming_echorl_sft(tmp_path, model):
    """The untrained model gets reward 0 on every completion: no group has an advantage, so
    nothing is learned. `echorl run` warns after 3 such steps, and once they have gone on
    for launch.stall_timeout_s the trainer stops (not restarted) and the run exits 1 naming
    `echorl sft`; the summary counts the flat steps. Its output is a pipe: plain lines."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "echorl.cli", "run", "--out", str(out)]
    for o in (
        "broker.port=0",
        f"model.path={model}",
        "task.name=add",
        "train.steps=1000",
        "launch.samplers=1",
        "launch.pin_cores=false",  # both cores for every start-up: the first step comes sooner
        "launch.stall_timeout_s=25",  # also the launcher's: the first step must come by then
        "train.batch_prompts=4",
        "train.group_size=4",
        "sampling.max_new_tokens=8",
        "train.eval_prompts=4",
    ):
        args += ["-o", o]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    said = " ".join(proc.stdout.split())  # as printed, whatever the console's width
    assert proc.returncode == 1, said + proc.stderr
    warned = said.find("step 3: every group of the last 3 steps was flat (all rewards 0.0): ")
    stopped = said.find("the trainer stops: every group of the last ")
    assert 0 <= warned < stopped, said
    assert (
        "(all rewards 0.0): nothing is learned; the model never scores on add: warm it up on "
        "it first (echorl sft --task add --model" in said[stopped:]
    ), said
    records = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in records if "reward/mean" in r]
    assert 3 <= len(steps) < 1000 and all(r["rollout/groups_flat_frac"] == 1.0 for r in steps)
    assert "trainer/gave_up" in records[-1]  # why, for whoever reads the metrics
    assert f"{len(steps)} of {len(steps)} steps had every group flat" in said, said
    assert "echorl run: restart" not in (out / "logs" / "trainer.log").read_text()
    assert re.search(r"echorl run: step \d+/1000 reward 0\.000 .* eta ", said), said
