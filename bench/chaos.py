"""Chaos: a decoupled async run (`echorl run`) while every role is killed with SIGKILL at
random times, several times each (the broker, the trainer, each sampler), and the
launcher's supervisor restarts it. Then, from the broker's database and the trainer's
last checkpoint: every step trained exactly B groups, no group was trained twice, no
acknowledged group was lost, and the run finished.

    python bench/chaos.py [--steps 200] [--kills 3] [--seed 0] [--out runs/chaos]

Prints the counts and writes OUT/chaos.json (and bench/results/chaos.json).
"""

from __future__ import annotations

import argparse
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


def children(pid: int) -> dict[str, int]:
    """Role -> pid of the `echorl` children of the launcher `pid` (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid != pid or b"echorl.cli" not in cmd:
            continue
        args = [a.decode() for a in cmd]
        verb = args[args.index("echorl.cli") + 1]
        name = args[args.index("--name") + 1] if "--name" in args else verb
        found[name] = int(entry.name)
    return found


def check(out: Path, steps: int) -> dict:
    """The run's books, from the broker's database and the trainer's last checkpoint."""
    with sqlite3.connect(out / "broker" / "broker.sqlite") as db:
        consumed = db.execute(
            "SELECT job_id, consumed_step FROM rollouts WHERE state = 'consumed'"
        ).fetchall()
        states = dict(db.execute("SELECT state, COUNT(*) FROM rollouts GROUP BY state"))
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
        "rollouts": states,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kills", type=int, default=3, help="kills of each role")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/chaos")
    ap.add_argument("--json", default="bench/results/chaos.json")
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"--out {out} exists: pick a fresh folder")
    rng = random.Random(args.seed)
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
    console = Console()
    console.print(f"chaos: {' '.join(cmd)}")
    t0 = time.monotonic()
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    plan = [role for role in ROLES for _ in range(args.kills)]
    rng.shuffle(plan)
    kills: Counter = Counter()
    # Wait for the swarm (after the warm-up) and its first steps, then kill on the plan.
    while run.poll() is None and not (out / "metrics.jsonl").exists():
        time.sleep(0.5)
    for role in plan:
        time.sleep(rng.uniform(1.0, 3.0))
        if run.poll() is not None:
            break
        pids = children(run.pid)
        while role not in pids and run.poll() is None:  # being restarted: wait for it
            time.sleep(0.5)
            pids = children(run.pid)
        if role in pids:
            os.kill(pids[role], signal.SIGKILL)
            kills[role] += 1
            console.print(f"  {time.monotonic() - t0:6.1f} s  kill -9 {role} (pid {pids[role]})")
    printed = run.communicate()[0]
    wall = time.monotonic() - t0
    books = check(out, args.steps) if run.returncode == 0 else {}
    result = {
        "steps": args.steps,
        "B": B,
        "exit_code": run.returncode,
        "wall_s": wall,
        "kills": dict(kills),
        **books,
    }
    table = Table(title=f"chaos: {args.steps} async steps, each role killed {args.kills} times")
    table.add_column("")
    table.add_column("value")
    for key, value in result.items():
        table.add_row(key, f"{value:.1f}" if isinstance(value, float) else str(value))
    console.print(table)
    if run.returncode != 0:
        console.print(printed[-3000:], markup=False)
    (out / "chaos.json").write_text(json.dumps(result, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    ok = books and books["steps_done"] == args.steps and not books["lost"]
    ok = ok and not books["trained_twice"] and books["steps_with_B_groups"] == args.steps
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
