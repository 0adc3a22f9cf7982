"""Chaos, as `bench/chaos.py` runs it: `echorl run` while the broker, the trainer and each
sampler are killed with SIGKILL and restarted by the launcher. The books must balance:
every step trained exactly B groups, none twice, none lost, the run finished."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CHAOS = Path(__file__).parents[2] / "bench" / "chaos.py"


def chaos(tmp_path, steps, kills):
    out, result = tmp_path / "run", tmp_path / "chaos.json"
    cmd = [sys.executable, str(CHAOS), "--steps", str(steps), "--kills", str(kills)]
    cmd += ["--out", str(out), "--json", str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    books = json.loads(result.read_text())
    logs = "".join(p.read_text()[-2000:] for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout + logs
    return books, out


@pytest.mark.slow  # ~1 min: keeps the default suite within its 15 minutes on 2 cores
def test_every_role_killed_once_the_books_balance(tmp_path):
    books, out = chaos(tmp_path, steps=80, kills=1)
    assert books["kills"] == {"broker": 1, "trainer": 1, "sampler-0": 1, "sampler-1": 1}
    assert books["steps_done"] == books["steps_with_B_groups"] == 80
    assert books["groups_trained"] == 80 * books["B"]
    assert books["trained_twice"] == 0 and books["lost"] == 0
    # each role's log was appended to across its restart, not overwritten
    for role in ("broker", "trainer", "sampler-0", "sampler-1"):
        log = (out / "logs" / f"{role}.log").read_text()
        assert "echorl run: restart 1" in log, role


@pytest.mark.slow
def test_200_steps_every_role_killed_three_times(tmp_path):
    books, _ = chaos(tmp_path, steps=200, kills=3)
    assert sum(books["kills"].values()) == 12
    assert books["steps_done"] == books["steps_with_B_groups"] == 200
    assert books["trained_twice"] == 0 and books["lost"] == 0


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
