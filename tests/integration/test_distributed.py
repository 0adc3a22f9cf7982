"""The trainer as a torchrun world on CPU (gloo): DDP and FSDP2 make the single-process
trainer's steps, a 2-rank trainer learns in a swarm, and a killed rank stops the world, which
`--resume` continues with nothing trained twice."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.integration.conftest import (
    SAMPLED,
    TRAINER,
    echorl_run,
    free_port,
    pass1,
    read_jsonl,
    start_broker,
    start_sampler,
    stop_broker,
    wait_until,
)
from tests.integration.test_faults import (
    assert_each_step_consumed_once,
    assert_resumed_exactly,
    steps_done,
    stop_all,
)

pytestmark = pytest.mark.integration

STEPS = Path(__file__).with_name("dist_steps.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
# Two minibatches of two PPO epochs: every rank's share changes each pass, and the
# optimiser steps four times per trainer step.
SPLIT = ["-o", "train.minibatches=2", "-o", "train.ppo_epochs=2"]


def dist_steps(out: Path, procs: int, *overrides: str) -> tuple[dict, dict]:
    """dist_steps.py's final weights and metrics, as one process or a 2-rank torchrun world."""
    out.mkdir()
    launcher = TORCHRUN if procs > 1 else [sys.executable]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*launcher, str(STEPS), str(out), *SPLIT, *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return load_file(out / "model.safetensors"), json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    return dist_steps(tmp_path_factory.mktemp("solo") / "out", 1)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_make_the_single_process_steps(tmp_path, solo, strategy):
    weights, metrics = dist_steps(tmp_path / "out", 2, "-o", f"train.parallel={strategy}")
    one_weights, one_metrics = solo
    assert metrics["world"] == 2 and one_metrics["world"] == 1
    assert weights.keys() == one_weights.keys()
    worst = max((weights[k] - one_weights[k]).abs().max().item() for k in weights)
    assert worst < 1e-5, f"largest parameter difference {worst:.2e}"
    for two, one in zip(metrics["steps"], one_metrics["steps"], strict=True):
        assert two.keys() == one.keys()
        for key in one:  # losses, KL, entropy, clip fractions, gradient norm: the same
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


# slow (~40 s): the default suite's 15 minutes; the 2-rank steps above are the fast check.
@pytest.mark.slow
def test_a_two_rank_ddp_trainer_learns_in_a_swarm(tmp_path, warm_add):
    out = tmp_path / "run"
    shown = echorl_run(
        out,
        f"model.path={warm_add}",
        "launch.trainer_procs=2",
        "launch.samplers=2",
        "broker.mode=async",
        "train.steps=40",
        "train.eval_every=0",
        "train.eval_prompts=100",
        SAMPLED,
    )
    assert "2 ranks, ddp" in (out / "logs" / "trainer.log").read_text(), shown
    records = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    assert {r["trainer/ranks"] for r in steps} == {2}
    evals = pass1(records)
    assert evals[-1] - evals[0] >= 0.05, evals  # held-out sampled pass@1; measured 0.48 -> 0.57
    assert_each_step_consumed_once(out / "broker", 40, bound=1, b=16)  # the default batch


def worker_pids(torchrun_pid: int) -> list[int]:
    """The rank processes torchrun started (its children)."""
    path = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def start_world(url, model, out, *args):
    """`echorl trainer` as a 2-rank DDP world under torchrun; returns the torchrun process."""
    env = os.environ | {"ECHORL_TRAINER_TOKEN": TRAINER, "OMP_NUM_THREADS": "1"}
    cmd = [*TORCHRUN, "-m", "echorl.cli", "trainer", "--broker", url, "--model", str(model)]
    cmd += ["--out", str(out), "-o", "model.threads=1", *args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


# slow (~50 s each): the default suite stays under 15 minutes on 2 cores.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_killed_rank_stops_the_world_and_resume_continues(tmp_path, strategy):
    from echorl.models import save_tiny_model

    model = save_tiny_model(tmp_path / "v0", "1m", seed=0)
    B, steps, out = 4, 8, tmp_path / "t"
    run = ["-o", "task.name=add", "-o", f"train.batch_prompts={B}", "-o", "train.group_size=4"]
    run += ["-o", "sampling.max_new_tokens=24", "-o", "train.drop_flat_groups=false"]
    run += ["-o", "train.eval_prompts=8", "-o", "broker.mode=async", "-o", "broker.max_staleness=1"]
    common = ("-o", f"train.steps={steps}", "-o", "train.checkpoint_every=2", *run)
    common += ("-o", f"train.parallel={strategy}")
    broker, url = start_broker(tmp_path / "b", free_port(), *run)
    samplers = [start_sampler(url, model, "s0", *run)]
    try:
        world = start_world(url, model, out, *common)
        wait_until(lambda: steps_done(out) >= 5, what="step 5")
        ranks = worker_pids(world.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)  # a rank that is not rank 0 (the broker's peer)
        first = world.communicate(timeout=120)[0]
        assert world.returncode != 0, first
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks), "a rank outlived it"
        resumed = start_world(url, model, out, *common, "--resume")
        shown = resumed.communicate(timeout=300)[0]
        assert resumed.returncode == 0, shown
    finally:
        stop_all(samplers)
        stop_broker(broker)
    assert "resumed at step" in shown, shown
    assert_resumed_exactly(out, tmp_path / "b", steps)
