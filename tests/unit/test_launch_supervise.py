"""`echorl run`'s supervisor: a trainer that finishes between the two looks of one round is
a finished trainer, never a dead one to restart (the race printed `trainer exited (0);
restarting it in 1 s` about once in six runs); a trainer that dies is restarted."""

import io
import subprocess
import sys

from rich.console import Console

from echorl.config import load_config
from echorl.launch import local
from echorl.launch.local import Role, Swarm, watch


def swarm_with_trainer(tmp_path, code: int) -> Swarm:
    (tmp_path / "logs").mkdir()
    swarm = Swarm(out=tmp_path, url="http://127.0.0.1:9", env={})
    trainer = Role("trainer", ("trainer",))
    # A real process that is alive at the round's first look and exits with `code` soon after.
    trainer.proc = subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep(0.3); exit({code})"]
    )
    swarm.roles["trainer"] = trainer
    return swarm


def test_a_trainer_finishing_mid_round_ends_the_run_without_a_restart(tmp_path, monkeypatch):
    swarm = swarm_with_trainer(tmp_path, 0)
    trainer = swarm.roles["trainer"]
    started = []
    monkeypatch.setattr(Swarm, "start", lambda self, role: started.append(role.name))

    def update(view):  # the race, every time: the trainer exits while the metrics are read
        trainer.proc.wait()

    monkeypatch.setattr(local.LiveView, "update", update)
    out = io.StringIO()
    code = watch(swarm, load_config(None, []), Console(file=out, width=200), stop=[])
    assert code == 0
    assert trainer.restarts == 0 and trainer.due == 0.0 and started == []
    assert "restarting" not in out.getvalue(), out.getvalue()


def test_a_trainer_that_dies_is_restarted_with_resume(tmp_path, monkeypatch):
    swarm = swarm_with_trainer(tmp_path, 9)
    trainer = swarm.roles["trainer"]
    trainer.proc.wait()
    started = []

    def start(self, role):  # the restart: a trainer that then finishes
        started.append(role.args)
        role.proc = subprocess.Popen([sys.executable, "-c", "exit(0)"])

    monkeypatch.setattr(Swarm, "start", start)
    monkeypatch.setattr(local.LiveView, "update", lambda view: None)
    # The 1 s backoff passes at once: each round's 0.5 s sleep is 10 ms of real time.
    real_sleep, real_clock, skipped = local.time.sleep, local.time.monotonic, [0.0]

    def sleep(s):
        skipped[0] += s
        real_sleep(0.01)

    monkeypatch.setattr(local.time, "sleep", sleep)
    monkeypatch.setattr(local.time, "monotonic", lambda: real_clock() + skipped[0])
    out = io.StringIO()
    code = watch(swarm, load_config(None, []), Console(file=out, width=200), stop=[])
    assert code == 0, out.getvalue()
    assert trainer.restarts == 1 and started == [("trainer", "--resume")]
    assert "trainer exited (9); restarting it in 1 s (restart 1)" in out.getvalue()
