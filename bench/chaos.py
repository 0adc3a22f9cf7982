"""Chaos: decoupled async runs (`echorl run`) while every role is killed with SIGKILL at
random times, several times each (the broker, the trainer, each sampler), some kills
landing inside a role's start-up (just after the launcher restarted it), and the
launcher's supervisor restarts it. Then, per seed, from the broker's database and the
trainer's last checkpoint: every step trained exactly B groups, no group was trained
twice, no acknowledged group was lost, the run finished, and no process of it is left
(counted by the sessions its roles ran in).

    python bench/chaos.py [--steps 200] [--kills 4] [--seeds 0-9] [--out runs/chaos]

Prints a table of seeds and writes OUT/chaos.json (and bench/results/chaos.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

B, G = 4, 4
ROLES = ("broker", "trainer", "sampler-0", "sampler-1")
START_UP = 0.3  # the share of kills aimed inside a start-up: 0-0.5 s after a restart


def processes() -> dict[int, tuple[int, int, list[str]]]:
    """pid -> (parent pid, session id, command line) of every process (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        found[int(entry.name)] = (int(fields[1]), int(fields[3]), [a.decode() for a in cmd])
    return found


def children(pid: int) -> dict[str, int]:
    """Role -> pid of the `echorl` children of the launcher `pid`."""
    found = {}
    for child, (ppid, _, args) in processes().items():
        if ppid != pid or "echorl.cli" not in args:
            continue
        verb = args[args.index("echorl.cli") + 1]
        found[args[args.index("--name") + 1] if "--name" in args else verb] = child
    return found


def check(out: Path, steps: int) -> dict:
    """The run's books, from the broker's database and the trainer's last checkpoint."""
    with sqlite3.connect(out / "broker" / "broker.sqlite") as db:
        consumed = db.execute(
            "SELECT job_id, consumed_step FROM rollouts WHERE state = 'consumed'"
        ).fetchall()
    latest = (out / "checkpoints" / "LATEST").read_text().strip()
    state = torch.load(out / "checkpoints" / latest / "trainer_state.pt", weights_only=False)
    lineage = state["extra"]["consumed"]  # every group trained into the final model, in order
    per_step = Counter(step for _, step in consumed)
    at_broker = {job for job, _ in consumed}
    return {
        "steps_done": state["step"],
        "steps_with_B_groups": sum(per_step[s] == B for s in range(steps)),
        "groups_trained": len(lineage),
        "trained_twice": len(lineage) - len(set(lineage)),
        "lost": len(set(lineage) ^ at_broker),  # trained but not booked, or booked not trained
    }


def kill_on_plan(run: subprocess.Popen, plan: list[str], rng: random.Random, log) -> tuple:
    """Kill each role of `plan` in turn, 1-3 s apart; after a kill, a START_UP share of the
    time, kill that role's next start too, 0-0.5 s after the launcher starts it (inside its
    start-up), counted against its share of the plan. Returns (kills per role, the sessions
    the roles ran in)."""
    kills: Counter = Counter()
    sessions: set[int] = set()
    plan = list(plan)
    while plan and run.poll() is None:
        role = plan.pop(0)
        time.sleep(rng.uniform(1.0, 3.0))
        pid, starting = kill(run, role, None, sessions), False
        while pid is not None:
            kills[role] += 1
            log(f"kill -9 {role} (pid {pid}{', starting' if starting else ''})")
            if role not in plan or rng.random() >= START_UP:
                break
            plan.remove(role)
            pid, starting = kill(run, role, pid, sessions, rng.uniform(0.0, 0.5)), True
    return kills, sessions


def kill(run, role: str, last: int | None, sessions: set[int], after: float = 0.0) -> int | None:
    """SIGKILL `role`'s process once it runs under a pid other than `last` (the launcher
    restarted it), `after` seconds after it appeared; its pid (None: the run ended)."""
    pid = None
    while run.poll() is None and pid in (None, last):
        roles = children(run.pid)
        sessions.update(roles.values())  # each role leads a session of its own
        pid = roles.get(role)
        if pid in (None, last):
            time.sleep(0.05)
    if run.poll() is not None:
        return None
    time.sleep(after)
    with contextlib.suppress(ProcessLookupError):  # died on its own meanwhile: a kill of it
        os.kill(pid, signal.SIGKILL)
    return pid


def left_over(sessions: set[int], launcher: int) -> list[str]:
    """The processes of the run still alive: in a role's session, or the launcher's children."""
    return [
        f"{pid} {' '.join(args)[:100]}"
        for pid, (ppid, sid, args) in processes().items()
        if sid in sessions or ppid == launcher
    ]


def one_seed(seed: int, args, console: Console) -> dict:
    out = Path(args.out) / f"seed{seed}"
    rng = random.Random(seed)
    overrides = [
        "broker.mode=async",
        "broker.port=0",
        f"train.steps={args.steps}",
        f"train.batch_prompts={B}",
        f"train.group_size={G}",
        "train.checkpoint_every=5",
        "train.eval_prompts=20",
        "train.drop_flat_groups=false",
        "sft.steps=100",
        "launch.samplers=2",
        "launch.max_restarts=100",
        "broker.lease_seconds=5",
        "broker.sampler_timeout=5",
        "broker.trainer_lease_seconds=5",
        "sampler.jobs_per_lease=2",
    ]
    cmd = [sys.executable, "-m", "echorl.cli", "run", "--out", str(out)]
    for o in overrides:
        cmd += ["-o", o]
    t0 = time.monotonic()
    printed = Path(args.out) / f"seed{seed}.log"
    with printed.open("w") as sink:
        run = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    plan = [role for role in ROLES for _ in range(args.kills)]
    rng.shuffle(plan)
    while run.poll() is None and not children(run.pid).keys() >= set(ROLES):  # after warm-up
        time.sleep(0.2)

    def log(what: str) -> None:
        console.print(f"  seed {seed} {time.monotonic() - t0:6.1f} s  {what}")

    kills, sessions = kill_on_plan(run, plan, rng, log)
    while run.poll() is None and time.monotonic() - t0 < args.timeout:
        sessions.update(children(run.pid).values())  # the roles' last starts, too
        time.sleep(0.5)
    if run.poll() is None:
        log(f"no end after {args.timeout:.0f} s: stopping it")
        run.send_signal(signal.SIGTERM)
        run.wait()
    wall = time.monotonic() - t0
    time.sleep(2.0)  # a helper's parent-death signal is delivered at once; give it a moment
    left = left_over(sessions, run.pid)
    books = check(out, args.steps) if run.returncode == 0 else {}
    ok = bool(books) and books["steps_done"] == books["steps_with_B_groups"] == args.steps
    ok = ok and not books["lost"] and not books["trained_twice"] and not left
    if not ok:
        console.print(printed.read_text()[-3000:], markup=False)
        console.print("\n".join(left), markup=False)
    return {
        "seed": seed,
        "B": B,
        "ok": ok,
        "exit_code": run.returncode,
        "wall_s": round(wall, 1),
        "kills": dict(kills),
        "left_over": len(left),
        **books,
    }


def seeds(text: str) -> list[int]:
    """'0-9' or '1,2,7' or '3'."""
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kills", type=int, default=4, help="kills of each role")
    ap.add_argument("--seeds", type=seeds, default=seeds("0-9"), help="e.g. 0-9 or 1,2,7")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per seed")
    ap.add_argument("--out", default="runs/chaos")
    ap.add_argument("--json", default="bench/results/chaos.json")
    args = ap.parse_args()
    if Path(args.out).exists():
        raise SystemExit(f"--out {args.out} exists: pick a fresh folder")
    console = Console()
    Path(args.out).mkdir(parents=True)
    results = [one_seed(seed, args, console) for seed in args.seeds]
    table = Table(
        title=f"chaos: {args.steps} async steps of B = {B}, each role killed {args.kills} times"
    )
    for column in ("seed", "finished", "steps", "B each", "trained twice", "lost", "left", "s"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            str(r["seed"]),
            "yes" if r["exit_code"] == 0 else f"no ({r['exit_code']})",
            str(r.get("steps_done", "-")),
            str(r.get("steps_with_B_groups", "-")),
            str(r.get("trained_twice", "-")),
            str(r.get("lost", "-")),
            str(r["left_over"]),
            f"{r['wall_s']:.0f}",
        )
    console.print(table)
    passed = sum(r["ok"] for r in results)
    console.print(f"{passed} of {len(results)} seeds finished with the books balanced")
    summary = {"steps": args.steps, "B": B, "kills_per_role": args.kills, "seeds": results}
    Path(args.out, "chaos.json").write_text(json.dumps(summary, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=2))
    raise SystemExit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
