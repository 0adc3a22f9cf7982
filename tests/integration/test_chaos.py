"""Chaos, as `bench/chaos.py` runs it: `echorl run` while the broker, the trainer and each
sampler are killed with SIGKILL and restarted by the launcher, some kills inside a role's
start-up. The books must balance: every step trained exactly B groups, none twice, none
lost, the run finished, and no process of it is left."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import read_jsonl, wait_until

pytestmark = pytest.mark.integration

CHAOS = Path(__file__).parents[2] / "bench" / "chaos.py"
_spec = importlib.util.spec_from_file_location("chaos", CHAOS)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def chaos(tmp_path, steps, kills, seeds="0"):
    """bench/chaos.py's runs, one per seed; each seed's books (asserted balanced)."""
    out, result = tmp_path / "runs", tmp_path / "chaos.json"
    cmd = [sys.executable, str(CHAOS), "--steps", str(steps), "--kills", str(kills)]
    cmd += ["--seeds", seeds, "--out", str(out), "--json", str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3000)
    logs = "".join(p.read_text()[-2000:] for p in sorted(out.glob("*/logs/*.log")))
    assert proc.returncode == 0, proc.stdout + logs
    return json.loads(result.read_text())["seeds"], out / f"seed{seeds.split(',')[0]}"


@pytest.mark.slow  # ~1 min: keeps the default suite within its 15 minutes on 2 cores
def test_every_role_killed_once_the_books_balance(tmp_path):
    (books,), out = chaos(tmp_path, steps=80, kills=1)
    assert books["kills"] == {"broker": 1, "trainer": 1, "sampler-0": 1, "sampler-1": 1}
    assert books["steps_done"] == books["steps_with_B_groups"] == 80
    assert books["groups_trained"] == 80 * books["B"]
    assert books["trained_twice"] == 0 and books["lost"] == 0
    # each role's log was appended to across its restart, not overwritten
    for role in ("broker", "trainer", "sampler-0", "sampler-1"):
        log = (out / "logs" / f"{role}.log").read_text()
        assert "echorl run: restart 1" in log, role


@pytest.mark.long  # ~5 min: three seeds of 120 steps, each role killed 4 times
def test_three_seeds_every_role_killed_four_times_some_while_starting(tmp_path):
    runs, _ = chaos(tmp_path, steps=120, kills=4, seeds="1,2,3")
    for books in runs:
        assert sum(books["kills"].values()) == 16, books
        assert books["steps_done"] == books["steps_with_B_groups"] == 120, books
        assert books["trained_twice"] == books["lost"] == books["left_over"] == 0, books


@pytest.mark.long  # ~40 s
def test_a_broker_killed_twice_while_it_restarts_the_run_goes_on(tmp_path, warm_add):
    """The broker is killed, and each of its next two starts is killed before it answers
    /healthz: each death is a death (backoff, restart, counted), not the end of the run."""
    out, steps = tmp_path / "run", 30
    cmd = [sys.executable, "-m", "echorl.cli", "run", "--out", str(out)]
    for o in (
        "broker.port=0",
        f"model.path={warm_add}",
        f"train.steps={steps}",
        "train.eval_prompts=8",
    ):
        cmd += ["-o", o]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        done = lambda: max((r["step"] for r in read_jsonl(out / "metrics.jsonl")), default=0)  # noqa: E731
        wait_until(lambda: done() >= 3, what="step 3")
        killed = [bench.children(run.pid)["broker"]]
        os.kill(killed[-1], signal.SIGKILL)
        for _ in range(2):

            def restarted():
                assert run.poll() is None, run.communicate()[0]  # the launcher gave up
                pid = bench.children(run.pid).get("broker")
                return pid if pid not in (None, *killed) else None

            killed.append(wait_until(restarted, what="the broker's restart", poll=0.01))
            os.kill(killed[-1], signal.SIGKILL)  # ~10 ms after its start: long before /healthz
        printed = run.communicate(timeout=600)[0]
    finally:
        if run.poll() is None:
            run.kill()
    logs = (out / "logs" / "broker.log").read_text()
    assert run.returncode == 0, printed + logs[-3000:]
    assert "restart 3 of broker" in logs and "restart 4" not in logs
    assert printed.count("the restarted broker did not come up") == 2, printed
    assert done() == steps


def test_a_sampler_told_to_stop_while_the_broker_is_gone_exits(tmp_path):
    import time

    from echorl.models import save_tiny_model
    from tests.integration.conftest import (
        free_port,
        query,
        start_broker,
        start_sampler,
        wait_until,
    )

    model = save_tiny_model(tmp_path / "m", "1m", seed=0)
    broker, url = start_broker(tmp_path / "b", free_port())
    sampler = start_sampler(url, model, "s")
    try:
        alive = "SELECT state FROM samplers"
        wait_until(lambda: query(tmp_path / "b", alive) == [("alive",)], what="registered")
    finally:
        broker.kill()
        broker.wait()
    time.sleep(3)  # the sampler is retrying with backoff now
    sampler.terminate()
    out = sampler.communicate(timeout=15)[0]  # seconds, not a minute of retries
    assert sampler.returncode == 0, out
    assert "stopped after" in out


def test_a_sampler_started_before_its_broker_waits_for_it_and_registers(tmp_path):
    """The launcher restarts roles in any order (a sampler may start while the broker is
    down): the sampler waits for it, then registers, instead of exiting."""
    from echorl.models import save_tiny_model
    from tests.integration.conftest import free_port, query, start_broker, start_sampler

    model = save_tiny_model(tmp_path / "m", "1m", seed=0)
    port, printed = free_port(), tmp_path / "sampler.log"
    with printed.open("w") as log:
        sampler = start_sampler(f"http://127.0.0.1:{port}", model, "early", log=log)
    broker = None
    try:  # its client's own retries spent (~6 s, at most 12.6), it says so and waits on
        wait_until(lambda: "broker unavailable" in printed.read_text(), 120, "the first failure")
        time.sleep(2.0)
        assert sampler.poll() is None, printed.read_text()
        broker, _ = start_broker(tmp_path / "b", port)
        registered = "SELECT state FROM samplers WHERE name = 'early'"
        wait_until(lambda: query(tmp_path / "b", registered) == [("alive",)], what="registered")
    finally:
        sampler.terminate()
        sampler.wait(30)
        if broker is not None:
            broker.kill()
            broker.wait()
    assert sampler.returncode == 0 and "stopped after" in printed.read_text()
