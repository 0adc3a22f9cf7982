"""The decoupled system as separate processes (`echorl run`: a broker, 2 samplers, a trainer).

Both protocols hold end to end, both learn, and async with max_staleness = 0 is sync.
"""

import os
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from tests.integration.conftest import SAMPLED, echorl_run, pass1, query, read_jsonl

pytestmark = pytest.mark.integration

STEPS, B = 40, 16
MARGIN = 0.05  # held-out sampled pass@1 in 40 steps; measured sync +0.11, async +0.10


def run_on(out, model, *overrides):
    """`echorl run` with 2 samplers on a warmed-up model (without probation, as every
    `echorl_run`: these runs pin what each lease holds, `sampler.jobs_per_lease` = B, a
    version's jobs in one lease seeded from their ids)."""
    return echorl_run(out, f"model.path={model}", "launch.samplers=2", *overrides)


# long (~50 s each): CI's second stage, beside the default suite's 15 minutes.
@pytest.mark.long
@pytest.mark.parametrize("mode,bound", [("sync", 0), ("async", 1)])
def test_both_protocols_hold_and_learn_end_to_end(tmp_path, warm_add, mode, bound):
    out = tmp_path / mode
    shown = run_on(
        out,
        warm_add,
        f"broker.mode={mode}",
        f"broker.max_staleness={bound}",
        f"train.steps={STEPS}",
        f"train.batch_prompts={B}",
        "sampler.jobs_per_lease=4",  # both samplers get work every version
        # async: flat and stale groups (which need a pass of their own) are audited by half
        f"quarantine.audit_fraction={0.5 if mode == 'async' else 1.0}",
        SAMPLED,
        # sync: the samplers pass each version on (the broker serves one of them directly)
        *(["sampler.serve_peers=true", "broker.peer_fanout=1"] if mode == "sync" else []),
    )
    assert "run summary" in shown
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert r["rollout/staleness_max"] <= bound
        assert sum(r["rollout/staleness_hist"]) == B
        if mode == "sync":
            assert r["rollout/versions"] == [r["step"] - 1]
    if mode == "async":  # the bound is used, not just respected
        assert any(r["rollout/staleness_max"] > 0 for r in train)
        audited = sum(r["audit/groups"] for r in train)  # the current version's, and a draw
        assert 0.3 * STEPS * B < audited < 0.97 * STEPS * B, audited
    else:
        assert all(r["audit/groups"] == B for r in train)
    assert not any(r["audit/quarantined"] for r in train)  # an honest swarm
    consumed = query(
        out / "broker", "SELECT job_id, version, consumed_step FROM rollouts WHERE state='consumed'"
    )
    assert len(consumed) == STEPS * B
    assert Counter(step for _, _, step in consumed) == {s: B for s in range(STEPS)}
    assert all(0 <= step - version <= bound for _, version, step in consumed)
    # Both samplers did real work, and reported it.
    pushed = query(out / "broker", "SELECT COUNT(DISTINCT sampler_id) FROM rollouts")[0][0]
    assert pushed == 2
    assert len(read_jsonl(out / "samplers" / "sampler-0.jsonl")) > 0
    if mode == "sync":  # every version after v0 reached one sampler through the other
        last = [read_jsonl(out / "samplers" / f"sampler-{k}.jsonl")[-1] for k in (0, 1)]
        fetched = [(r["sampler/peer_bytes"], r["sampler/download_bytes"]) for r in last]
        peers, total = map(sum, zip(*fetched))
        assert peers >= 0.3 * total, fetched  # half of all bytes, ideally
        assert all(r["sampler/peer_failures"] == 0 for r in last), last
    # Learning: held-out sampled pass@1 rises by at least MARGIN over 40 steps.
    evals = pass1(records)
    assert evals[-1] - evals[0] >= MARGIN, evals
    first = sum(r["reward/mean"] for r in train[:10]) / 10
    last = sum(r["reward/mean"] for r in train[-10:]) / 10
    assert last > first, (first, last)
    for png in ("reward_curve.png", "reward_vs_time.png", "staleness.png"):
        assert (out / png).stat().st_size > 10_000
    # On two or more cores the trainer computes on its own (launch.pin_cores).
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        assert f"trainer on cores {cores[0]}\n" in (out / "logs" / "trainer.log").read_text()
        assert f"cores: trainer {cores[0]}; broker, samplers, uploads" in shown


# slow (~50 s, two runs): the default suite's 15 minutes.
@pytest.mark.slow
def test_async_with_staleness_zero_reproduces_sync(tmp_path, warm_add):
    """Same seed, same consumed versions, same jobs per step, same losses."""
    runs = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        run_on(
            out,
            warm_add,
            f"broker.mode={mode}",
            "broker.max_staleness=0",
            "train.steps=5",
            "train.batch_prompts=4",
            "train.group_size=4",
            "train.drop_flat_groups=false",
            "train.eval_prompts=20",
            "sampler.jobs_per_lease=4",
        )
        runs[mode] = (
            [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r],
            query(
                out / "broker",
                "SELECT job_id, version, consumed_step FROM rollouts WHERE state='consumed' "
                "ORDER BY job_id",
            ),
        )
    (sync, sync_db), (asyn, async_db) = runs["sync"], runs["async"]
    assert sync_db == async_db and len(sync_db) == 20
    assert [r["rollout/versions"] for r in sync] == [[s] for s in range(5)]
    assert [r["rollout/versions"] for r in asyn] == [[s] for s in range(5)]
    for a, b in zip(sync, asyn):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-6)
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-5)


# slow (~65 s): the default suite's 15 minutes; test_faults resumes a killed trainer fast.
@pytest.mark.slow
def test_ctrl_c_stops_every_child_and_the_run_resumes(tmp_path, warm_add):
    """SIGINT to `echorl run`: the trainer checkpoints, every child exits, nothing is left
    listening; `echorl run --resume` then finishes with each step trained on B groups once."""
    import os
    import signal
    import socket

    from tests.integration.conftest import wait_until

    out, steps = tmp_path / "run", 200  # long enough to be cut: 4x8 steps take ~0.07 s each
    args = [sys.executable, "-m", "echorl.cli", "run", "--out", str(out)]
    for o in (
        f"model.path={warm_add}",
        "broker.port=0",
        "broker.mode=async",
        f"train.steps={steps}",
        "train.batch_prompts=4",
        "train.checkpoint_every=0",  # only the one SIGTERM writes
        "train.eval_prompts=20",
    ):
        args += ["-o", o]
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: len(read_jsonl(out / "metrics.jsonl")) >= 6, what="step 5")
    run.send_signal(signal.SIGINT)
    shown = run.communicate(timeout=120)[0]
    assert run.returncode == 130, shown
    assert "interrupted" in shown
    logs = {p.stem: p.read_text() for p in (out / "logs").glob("*.log")}
    assert "stopped after" in logs["sampler-0"]  # it handed back its leases and exited
    done = max(r["step"] for r in read_jsonl(out / "metrics.jsonl"))
    assert 5 <= done < steps
    assert (out / "checkpoints" / "LATEST").read_text() == f"step_{done:07d}"
    port = int((out / "config.yaml").read_text().split("port: ")[1].split()[0])
    with socket.socket() as s:  # the broker is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert [line for line in ps.splitlines() if "echorl.cli" in line and str(out) in line] == []
    resumed = subprocess.run(
        [*args, "--resume"], capture_output=True, text=True, timeout=600, env=os.environ
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    consumed = query(out / "broker", "SELECT consumed_step FROM rollouts WHERE state = 'consumed'")
    assert Counter(s for (s,) in consumed) == {s: 4 for s in range(steps)}


@pytest.mark.long  # two short runs and a refusal (~60 s)
def test_a_run_resumed_without_its_flags_is_the_same_run(tmp_path, warm_add):
    """`echorl run --out DIR --resume` without the first run's `-o` flags warmed up a fresh
    model on `add`, overwrote DIR/config.yaml with the defaults and was then refused by its
    own broker. Now the run's config.yaml is its config: the run continues as it was (here
    async, 4 prompts a step) to the longer `train.steps` asked; a flag that would make it
    another run is refused, naming it, before anything is written or started."""
    out = tmp_path / "run"
    first = ["broker.mode=async", "train.batch_prompts=4", "train.steps=4"]
    first += [f"model.path={warm_add}", "train.eval_prompts=8", "train.eval_every=0"]
    echorl_run(out, *first)
    config = yaml.safe_load((out / "config.yaml").read_text())
    shown = echorl_run(out, "train.steps=8", resume=True)
    assert f"resuming from {out / 'checkpoints' / 'step_0000004'} (step 4 of 8)" in shown
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert not (out / "sft").exists()  # no warm-up: the run's model
    config["train"]["steps"] = 8  # what the resume asked; the rest as it was
    assert yaml.safe_load((out / "config.yaml").read_text()) == config
    consumed = query(out / "broker", "SELECT consumed_step FROM rollouts WHERE state = 'consumed'")
    assert Counter(s for (s,) in consumed) == {s: 4 for s in range(8)}  # none twice
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    refused = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "run", "--out", str(out), "--resume"]
        + ["-o", "broker.mode=sync", "-o", "train.steps=12"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "broker.mode: 'async'" in refused.stdout and "another --out" in refused.stdout
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing written


def test_a_trainer_by_hand_resumes_from_its_own_config(tmp_path):
    """`echorl trainer` started by hand writes OUT/config.yaml; `--resume` with no -c takes
    it (flags given apply over it) and refuses, before anything is written, a flag that
    would make it another run."""
    from echorl.models.tiny import save_tiny_model
    from tests.integration.conftest import (
        TRAINER,
        free_port,
        start_broker,
        start_sampler,
        start_trainer,
        stop_broker,
    )

    model = save_tiny_model(tmp_path / "v0", "1m", seed=0)
    run = [
        "-o",
        "train.batch_prompts=4",
        "-o",
        "train.group_size=2",
        "-o",
        "sampling.max_new_tokens=4",
    ]
    run += ["-o", "train.eval_prompts=4", "-o", "broker.mode=async"]
    proc, url = start_broker(tmp_path / "b", free_port(), *run)
    sampler = start_sampler(url, model, "s0", *run)
    out = tmp_path / "out"
    try:
        first = start_trainer(url, model, out, *run, "-o", "train.steps=3")
        assert first.wait(300) == 0, first.stdout.read()
        saved = yaml.safe_load((out / "config.yaml").read_text())
        assert saved["train"]["batch_prompts"] == 4 and saved["broker"]["trainer_token"] is None
        env = os.environ | {"ECHORL_TRAINER_TOKEN": TRAINER}
        trainer = [
            sys.executable,
            "-m",
            "echorl.cli",
            "trainer",
            "--broker",
            url,
            "--out",
            str(out),
        ]
        refused = subprocess.run(
            [*trainer, "--resume", "-o", "train.batch_prompts=8"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 2, refused.stdout + refused.stderr
        said = " ".join(refused.stdout.split())  # as wrapped for the terminal
        assert "train.batch_prompts: 4 in" in said and ", 8 asked" in said, said
        resumed = subprocess.run(
            [*trainer, "--resume", "-o", "train.steps=5"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
        assert steps == [1, 2, 3, 4, 5]
        consumed = query(
            tmp_path / "b", "SELECT consumed_step FROM rollouts WHERE state = 'consumed'"
        )
        assert Counter(s for (s,) in consumed) == {s: 4 for s in range(5)}  # none twice
    finally:
        sampler.terminate()
        sampler.communicate(timeout=60)
        stop_broker(proc)
