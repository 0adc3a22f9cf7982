"""Uneven swarms: K samplers of mixed speed under sync, straggler-tolerant sync and async.

Each run is `echorl run` on `add` with the warmed-up 1m model, K sampler processes and one
trainer. Sampler k runs at `SPEEDS[k % 4]` x slower than it could (`sampler.slowdown`:
a SIMULATION of slower machines, each lease's generation followed by a proportional wait;
on 2 cores the samplers also share one core, so K = 8 is contended as well as uneven).

- sync:           sequential pull, one batch of B jobs out per version (a straggler holds
                  the step until its last group arrives);
- sync-straggler: the same with `broker.overprovision = 1.5` (B/2 spare jobs a version, the
                  first B groups win, the rest are cancelled at the next version) and
                  `broker.lease_by_speed` (a slow sampler leases fewer jobs);
- async:          push-pull, max_staleness 1, leases by speed.

    python bench/swarm.py                       # K = 1, 2, 4, 8 x 3 configs x 30 steps
    python bench/swarm.py --k 4 --steps 20      # a quick look

Prints a table and writes bench/results/swarm.json and bench/results/swarm.png: steps/s (from
the end of the first step), the trainer's wait per step for its batch (steady state), the
slowest sampler's time for a step's work (B groups at its speed), trainer and sampler
utilisation, wasted tokens (sync's cancelled work, broker and samplers) and the final reward.
As root, also the time for a new version to reach all K samplers behind 50 Mbit/s links,
from the broker alone, from peers, and from peers with deltas (bench/fanout.py's sweep, in
network namespaces; --no-updates skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` from anywhere
from bench.fanout import plot as plot_updates  # noqa: E402
from bench.fanout import render, sweep  # noqa: E402
from bench.netns import unavailable  # noqa: E402
from echorl.metrics import read_metrics  # noqa: E402

SPEEDS = (1, 1, 2, 4)  # slowdown of sampler k: SPEEDS[k % 4]
UPDATES = "an 8 MB version (3% of words changed) to every sampler, 50 Mbit/s links"
CONFIGS = {
    "sync": ["broker.mode=sync"],
    "sync-speed": ["broker.mode=sync", "broker.lease_by_speed=true"],
    "sync-straggler": [
        "broker.mode=sync",
        "broker.overprovision=1.25",
        "broker.lease_by_speed=true",
    ],
    "async": ["broker.mode=async", "broker.max_staleness=1", "broker.lease_by_speed=true"],
}
COLUMNS = (
    "steps_per_s",
    "trainer_wait_s",
    "slowest_step_work_s",
    "trainer_util",
    "sampler_util",
    "wasted_tokens",
    "wasted_frac",
    "final_reward",
)


def echorl(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "echorl.cli", *args], capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(f"echorl {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")


def speeds(k: int) -> list[float]:
    return [float(SPEEDS[i % len(SPEEDS)]) for i in range(k)]


def run_one(config: str, k: int, model: Path, out: Path, steps: int, batch: int) -> None:
    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        f"model.path={model}",
        "broker.port=0",
        f"train.steps={steps}",
        f"train.batch_prompts={batch}",
        "train.eval_every=0",
        "train.eval_prompts=50",
        "train.checkpoint_every=0",
        "sampler.jobs_per_lease=4",
        f"launch.samplers={k}",
        f"launch.sampler_slowdowns={json.dumps(speeds(k))}",
        *CONFIGS[config],
    ]
    args = ["run", "--out", str(out)]
    for o in overrides:
        args += ["-o", o]
    echorl(*args)


def measure(out: Path, k: int, batch: int) -> dict:
    """The run's figures from its metrics (trainer) and each sampler's per-lease log."""
    train = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    walls = [r["trainer/wall_s"] for r in train]
    steady = train[1:] or train  # the first step waits for the swarm's first batches
    busy, per_job, tokens, wasted = [], [], 0, train[-1].get("broker/wasted_tokens", 0)
    for i in range(k):
        log = read_metrics(out / "samplers" / f"sampler-{i}.jsonl")
        leases = [b for b in log if b["jobs"]]
        if not leases:
            continue
        span = log[-1]["time"] - leases[0]["time"] + leases[0]["sampler/gen_s"]
        work = [b["sampler/gen_s"] + b.get("sampler/throttle_s", 0.0) for b in leases]
        fetch = sum(b.get("sampler/download_s", 0.0) for b in leases)
        busy.append((sum(work) + fetch) / max(span, 1e-9))
        per_job.append(sum(work) / sum(b["jobs"] for b in leases))
        tokens += sum(b["sampler/tokens"] for b in leases)
        wasted += log[-1].get("sampler/wasted_tokens", 0)  # abandoned before the push
    n = min(10, len(train))
    return {
        "steps_per_s": (len(train) - 1) / (walls[-1] - walls[0]) if len(train) > 1 else None,
        "trainer_wait_s": statistics.mean(r["trainer/idle_s"] for r in steady),
        "slowest_step_work_s": batch * max(per_job),
        "trainer_util": sum(r["trainer/step_s"] for r in train) / walls[-1],
        "sampler_util": statistics.mean(busy),
        "wasted_tokens": wasted,
        "wasted_frac": wasted / max(tokens, 1),
        "final_reward": sum(r["reward/mean"] for r in train[-n:]) / n,
        "staleness_max": max(r["rollout/staleness_max"] for r in train),
        "curve": [(w, r["reward/mean"]) for w, r in zip(walls, train)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8], help="samplers per run")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16, help="train.batch_prompts (B)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--work", type=Path, default=Path("runs/bench_swarm"))
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument(
        "--no-updates",
        action="store_true",
        help="skip the time for a version to reach all K samplers (bench/fanout.py; root)",
    )
    args = ap.parse_args()
    console = Console(width=200)
    model = args.work / "sft"
    if not model.is_dir():
        console.print("warming the tiny model up on add (shared by every run)")
        echorl("sft", "--task", "add", "--out", str(model))
    results: dict[str, dict[int, dict]] = {c: {} for c in args.configs}
    for k in args.k:
        for config in args.configs:
            t0, out = time.time(), args.work / f"{config}-k{k}"
            run_one(config, k, model, out, args.steps, args.batch)
            results[config][k] = measure(out, k, args.batch)
            console.print(f"K={k} {config:15s} done in {time.time() - t0:.0f} s")
    table = Table(title=f"uneven swarms: add, 1m model, B={args.batch}, {args.steps} steps")
    table.add_column("config")
    table.add_column("K")
    table.add_column("speeds")
    for c in COLUMNS:
        table.add_column(c.replace("_", " "))
    for config, by_k in results.items():
        for k, r in by_k.items():
            cells = [
                "-" if r[c] is None else (f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]))
                for c in COLUMNS
            ]
            table.add_row(config, str(k), "/".join(f"{s:g}x" for s in speeds(k)), *cells)
    console.print(table)
    console.print(
        "speeds: simulated slowdowns (sampler.slowdown); trainer wait: its mean wait for a "
        "batch per step after the first; slowest step work: B groups at the slowest sampler's "
        "measured speed; wasted: tokens generated for cancelled jobs (sync only)"
    )
    # Time to all samplers updated: K samplers' weight paths behind 50 Mbit/s links, the broker
    # alone, peers (a chain) and peers with deltas (bench/fanout.py, in network namespaces).
    updates, why = [], "--no-updates" if args.no_updates else unavailable()
    if why is None:
        configs = [(0, False), (1, False), (1, True)]
        updates = sweep(args.k, configs, 8.0, 50.0, 50.0, 0.03, console)
        console.print(render(updates, UPDATES))
    else:
        console.print(f"[yellow]time to all samplers updated: not measured ({why})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "swarm.json").write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
                "steps": args.steps,
                "batch": args.batch,
                "speeds": list(SPEEDS),
                "results": results,
                "updates": updates,
                "updates_setup": UPDATES,
            },
            indent=1,
        )
    )
    plot(results, args.out / "swarm.png", updates)
    console.print(f"wrote {args.out / 'swarm.json'} and {args.out / 'swarm.png'}")


def plot(results: dict[str, dict[int, dict]], path: Path, updates: list[dict]) -> None:
    panels = 3 if updates else 2
    fig, (left, right, *rest) = plt.subplots(1, panels, figsize=(5 * panels, 4), dpi=120)
    if updates:
        plot_updates(updates, path, UPDATES, ax=rest[0])
    for config, by_k in results.items():
        ks = sorted(by_k)
        left.plot(ks, [by_k[k]["steps_per_s"] or 0 for k in ks], marker="o", label=config)
        right.plot(ks, [by_k[k]["trainer_wait_s"] for k in ks], marker="o", label=config)
    left.set_ylabel("trainer steps/s")
    right.set_ylabel("trainer wait per step (s)")
    for ax in (left, right):
        ax.set_xlabel("samplers K (speeds 1x, 1x, 2x, 4x, ...)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("uneven swarms on 2 cores (slowdowns simulated)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
