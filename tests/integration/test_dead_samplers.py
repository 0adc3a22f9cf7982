"""Dead samplers are released at once: a sampler killed with SIGKILL while it holds jobs
costs a sync run seconds, not the 60 s of `sampler_timeout` (by hand: its silence, over
`broker.lease_silence_s`; under `echorl run`: its supervisor tells the broker). A sampler the
broker forgot (restarted on a fresh data dir) registers again, or says the run changed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from echorl.models import save_tiny_model
from tests.integration.conftest import (
    SAMPLER,
    free_port,
    query,
    read_jsonl,
    start_broker,
    start_sampler,
    start_trainer,
    stop_broker,
    wait_until,
)

RUN = ["-o", "train.batch_prompts=8", "-o", "train.group_size=4", "-o", "broker.mode=sync"]
RUN += ["-o", "sampling.max_new_tokens=24", "-o", "train.drop_flat_groups=false"]
RUN += ["-o", "train.eval_prompts=4", "-o", "sampler.jobs_per_lease=4"]
BOUND_S = 10.0  # the longest gap between steps with a sampler killed (before: 60 s and more)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("dead") / "v0", "1m", seed=0)


def longest_gap(out) -> float:
    times = [r["time"] for r in read_jsonl(out / "metrics.jsonl") if "time" in r]
    return max(b - a for a, b in zip(times, times[1:]))


def holds(data, name) -> bool:
    return bool(
        query(
            data,
            "SELECT 1 FROM jobs j JOIN samplers s ON s.id = j.lease_owner "
            "WHERE j.state = 'leased' AND s.name = ?",
            name,
        )
    )


@pytest.mark.long  # ~25 s each: CI's second stage, beside the default suite's 15 minutes
def test_a_sampler_killed_by_hand_costs_a_sync_run_seconds(tmp_path, model):
    broker, url = start_broker(tmp_path / "b", free_port(), *RUN)
    samplers = [start_sampler(url, model, name, *RUN) for name in ("victim", "survivor")]
    out = tmp_path / "t"
    trainer = start_trainer(url, model, out, *RUN, "-o", "train.steps=12")
    try:
        wait_until(lambda: len(read_jsonl(out / "metrics.jsonl")) >= 3, what="3 records")
        wait_until(lambda: holds(tmp_path / "b", "victim"), poll=0.005, what="victim's lease")
        os.kill(samplers[0].pid, signal.SIGKILL)
        assert trainer.wait(300) == 0, trainer.stdout.read()
        lapsed = query(tmp_path / "b", "SELECT lapsed, state FROM samplers WHERE name = 'victim'")
    finally:
        for s in samplers:
            if s.poll() is None:
                s.kill()
            s.communicate(timeout=60)
        stop_broker(broker)
    assert longest_gap(out) < BOUND_S, longest_gap(out)
    assert lapsed[0][0] >= 1  # its jobs came back as a lapse, long before it was lost


@pytest.mark.long
def test_a_sampler_killed_under_echorl_run_costs_seconds(tmp_path, model):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "echorl.cli", "run", "--out", str(out), "-o", "broker.port=0"]
    args += [*RUN, "-o", f"model.path={model}", "-o", "launch.samplers=2"]
    args += ["-o", "train.steps=12", "-o", "broker.first_lease=1000000"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: len(read_jsonl(out / "metrics.jsonl")) >= 3, what="3 records")
        wait_until(lambda: holds(out / "broker", "sampler-1"), poll=0.005, what="a lease")
        found = subprocess.run(
            ["pgrep", "-f", "--", "--name sampler-1"], capture_output=True, text=True
        )
        (pid,) = map(int, found.stdout.split())
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not holds(out / "broker", "sampler-1"), timeout=5, what="released")
        released = time.monotonic() - t_kill
        shown = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, shown
    assert released < 3.0  # the supervisor told the broker; silence would take 6 s and more
    assert longest_gap(out) < BOUND_S, longest_gap(out)


def test_a_sampler_facing_a_fresh_broker_registers_again_or_says_the_run_changed(tmp_path, model):
    port = free_port()
    broker, url = start_broker(tmp_path / "b1", port, *RUN)
    sampler = start_sampler(url, model, "s", *RUN)
    wait_until(lambda: query(tmp_path / "b1", "SELECT 1 FROM samplers WHERE name = 's'"), what="s")
    stop_broker(broker)
    broker, url = start_broker(tmp_path / "b2", port, *RUN)  # fresh data dir, same tokens
    try:
        wait_until(
            lambda: query(tmp_path / "b2", "SELECT 1 FROM samplers WHERE name = 's'"),
            timeout=60,
            what="s registered again",
        )
    finally:
        stop_broker(broker)
    other = [*RUN, "-o", "broker.sampler_token=" + "f" * 32]  # another run's enrolment token
    broker, url = start_broker(tmp_path / "b3", port, *other)
    try:
        shown = sampler.communicate(timeout=60)[0]
    finally:
        if sampler.poll() is None:
            sampler.kill()
            sampler.communicate()
        stop_broker(broker)
    assert sampler.returncode == 2, shown
    said = " ".join(shown.split())
    assert "registered again as" in said and "no longer knows this sampler" in said, said
    assert "serves another run now" in said, said
    assert SAMPLER not in said  # tokens are never printed
