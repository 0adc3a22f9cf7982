"""`echorl launch ray` on a local Ray: broker, trainer and two samplers as actors; one
sampler actor killed (Ray restarts it), one sampler added with `echorl launch scale`; the
run completes with every step trained on B groups and none twice.

    .venv/bin/pip install ray && .venv/bin/python -m pytest -m ray tests/integration/test_ray.py
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import query, read_jsonl, wait_until
from tests.integration.test_faults import assert_each_step_consumed_once, steps_done

pytest.importorskip("ray")
pytestmark = [pytest.mark.integration, pytest.mark.ray]

STEPS = 400  # long enough for a sampler to be added and a killed one to come back


def command_pid(name: str) -> int | None:
    """The pid of `echorl sampler --name NAME` (the command a sampler actor runs)."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sampler" in cmd and name.encode() in cmd and b"echorl.cli" in cmd:
            return int(proc.name)
    return None


def registered(out: Path) -> list[str]:
    """The names samplers registered with at the run's broker, once per registration."""
    return [r[0] for r in query(out / "broker", "SELECT name FROM samplers")]


def parent(pid: int) -> int:
    return int((Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1]).split()[1])


def test_ray_launcher_survives_a_dead_sampler_actor_and_scales(tmp_path, warm_add):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "echorl.cli", "launch", "ray", "--out", str(out)]
    for o in (
        f"model.path={warm_add}",
        "broker.mode=async",
        "launch.samplers=2",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "train.eval_prompts=50",
        "sampling.max_new_tokens=24",
    ):
        args += ["-o", o]
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: steps_done(out) >= 3, timeout=240, what="step 3")
        scaled = subprocess.run(
            [sys.executable, "-m", "echorl.cli", "launch", "scale", "--samplers", "3"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "now keeps 3 samplers" in scaled.stdout, scaled.stdout + scaled.stderr
        wait_until(lambda: "sampler-2" in registered(out), what="sampler-2 to register")
        victim = wait_until(lambda: command_pid("sampler-0"), what="sampler-0's command")
        os.kill(parent(victim), signal.SIGKILL)  # its actor's worker process: an actor death
        wait_until(lambda: registered(out).count("sampler-0") == 2, what="sampler-0 back")
        # A sampler's command dying under a live actor: the actor tells the broker at once,
        # not a lease_silence_s (6 s) or sampler_timeout (60 s) later: the broker says who told
        # it. (Timed at 4 s, this failed in CI twice with the actor's word in the broker's log:
        # the 2 cores were busy with sampler-0 restarting, torch and all.)
        first = "SELECT state FROM samplers WHERE name = 'sampler-1' ORDER BY registered_at LIMIT 1"
        os.kill(
            wait_until(lambda: command_pid("sampler-1"), what="sampler-1's command"), signal.SIGKILL
        )
        wait_until(
            lambda: query(out / "broker", first) == [("lost",)], timeout=60, what="sampler-1 lost"
        )
        told = "sampler sampler-1 died (its supervisor says)"
        assert told in (out / "logs" / "broker.log").read_text()
        wait_until(lambda: registered(out).count("sampler-1") == 2, what="sampler-1 back")
        assert steps_done(out) < STEPS, "the run ended before the swarm changed: lengthen it"
        shown = launcher.communicate(timeout=600)[0]
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.communicate(timeout=120)
    assert launcher.returncode == 0, shown
    names = registered(out)
    assert names.count("sampler-0") == 2 and names.count("sampler-1") == 2, names  # restarted
    assert "sampler-2" in names, names  # the one `scale` added
    assert "restarted by Ray" in (out / "logs" / "sampler-0.log").read_text()
    assert not Path(f"/proc/{victim}").exists(), "the dead actor's command outlived it"
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert_each_step_consumed_once(out / "broker", STEPS, bound=1, b=16)
