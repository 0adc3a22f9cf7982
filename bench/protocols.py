"""Co-located reference loop vs the decoupled swarm under sync and async, on the same cores.

Echo's claim, measured here: decoupling sampling from training keeps the reward per
step of the co-located loop while overlapping generation with training (async).

For each seed it warms one tiny model up, then runs the same number of trainer steps
on `add` with:

- colocated:  one process, generate then train, all threads (`echorl train --colocated`);
- colocated-1t: the same on one thread: only the trainer's core (Echo's baseline: the
  training hardware doing both jobs);
- sync:       broker + 1 sampler (1 thread) + trainer (1 thread), sequential pull;
- async-1/2:  the same swarm, push-pull with max_staleness 1 and 2;
- async-2-spot: async-2 auditing a quarter of the groups that need a pass of their own;
- async-2-trusted: async-2 auditing only what the update's own pass covers (free).
- async-2-auditor: async-2 with an `echorl auditor` (on a core of its own where there is
  one; on 2 cores, the samplers') auditing what the update's pass does not cover: the
  trainer's audit is as free as async-2-trusted's.

    python bench/protocols.py                          # 3 seeds x 4 configs x 60 steps
    python bench/protocols.py --seeds 0 --steps 20     # a quick look
    python bench/protocols.py --reuse --target 0.85    # re-measure the last runs

Prints a table and writes bench/results/protocols.json and bench/results/protocols.png:
final reward (mean +- std over seeds), held-out accuracy, wall-clock per step,
time to a target reward, trainer and sampler utilisation, and the overlap efficiency
of async = steps/s / (1 / max(T_generate, T_train)) from the measured phase times, in
steady state: from the end of the first step (the pipeline's fill, the samplers' first
batch, is `fill_s`). T_update (the update alone, without the trainer's audit of the
samplers) and T_train (with it) are set against colocated-1t's training phase, which
runs on the same core as the decoupled trainer (core 0). A sampler's T_generate is its
phase per batch: fetching and loading the version it needs (T_fetch) and generating.
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

from echorl.metrics import read_metrics  # noqa: E402

CONFIGS = {
    "colocated": [],
    "colocated-1t": [],  # on one core: the trainer's hardware alone (Echo's baseline)
    "sync": ["broker.mode=sync"],
    "async-1": ["broker.mode=async", "broker.max_staleness=1"],
    "async-2": ["broker.mode=async", "broker.max_staleness=2"],
    # the same, auditing a quarter of the groups that need a pass of their own (flat, stale)
    "async-2-spot": [
        "broker.mode=async",
        "broker.max_staleness=2",
        "quarantine.audit_fraction=0.25",
    ],
    # the same, auditing only what the update's pass covers: trusted samplers, as co-located
    "async-2-trusted": [
        "broker.mode=async",
        "broker.max_staleness=2",
        "quarantine.audit_fraction=0",
    ],
    # the same, every group audited: the update's pass covers some, an auditor the rest
    "async-2-auditor": ["broker.mode=async", "broker.max_staleness=2", "launch.auditors=1"],
}


def echorl(*args: str, cores: set[int] | None = None) -> None:
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
    proc = subprocess.run(
        [sys.executable, "-m", "echorl.cli", *args], capture_output=True, text=True, preexec_fn=pin
    )
    if proc.returncode:
        raise SystemExit(f"echorl {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")


def run_one(name: str, model: Path, out: Path, seed: int, steps: int, threads: int) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    common = [f"train.seed={seed}", f"task.seed={seed}", f"train.steps={steps}"]
    common += ["train.eval_every=0", "train.checkpoint_every=0"]
    if name.startswith("colocated"):
        args = ["train", "--colocated", "--model", str(model), "--out", str(out)]
        common.append(f"model.threads={1 if name == 'colocated-1t' else threads}")
    else:
        args = ["run", "--out", str(out)]
        common += [f"model.path={model}", "broker.port=0", *CONFIGS[name]]
    for o in common:
        args += ["-o", o]
    # colocated-1t on the core `echorl run` gives the decoupled trainer: the same core's work
    one_core = name == "colocated-1t" and hasattr(os, "sched_setaffinity")
    echorl(*args, cores={min(os.sched_getaffinity(0))} if one_core else None)
    return out


def time_to(train: list[dict], wall: list[float], target: float, window: int = 10) -> float | None:
    """Seconds until the `window`-step moving average of the train reward first reaches `target`."""
    for i in range(window - 1, len(train)):
        if sum(r["reward/mean"] for r in train[i - window + 1 : i + 1]) / window >= target:
            return wall[i]
    return None


def measure(name: str, out: Path, target: float) -> dict:
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    if name.startswith("colocated"):
        walls, acc = [], 0.0
        for r in train:
            acc += r["perf/total_s"]
            walls.append(acc)
        gen = [r["perf/gen_s"] for r in train]
        sampler_busy = sum(gen) / walls[-1]
        t_gen = statistics.mean(gen)
        t_fetch = 0.0  # the policy is in hand
    else:
        walls = [r["trainer/wall_s"] for r in train]
        batches = [b for b in read_metrics(out / "samplers" / "sampler-0.jsonl") if b["jobs"]]
        span = batches[-1]["time"] - batches[0]["time"] + batches[0]["sampler/gen_s"]
        # A sampler's phase per batch (one lease): fetch and load the version it needs, then
        # generate. The fetch is the samplers' share of the weight sync, on their hardware.
        gen = [b["sampler/gen_s"] for b in batches]
        fetch = [b.get("sampler/download_s", 0.0) for b in batches]
        sampler_busy = (sum(gen) + sum(fetch)) / max(span, walls[-1])
        t_fetch = statistics.mean(fetch)
        t_gen = statistics.mean(gen) + t_fetch
    t_train = statistics.mean(r["trainer/step_s"] for r in train)
    # The update alone, without the decoupled trainer's audit of the samplers (its passes over
    # flat groups and stale versions): what compares with the co-located loop's training phase.
    t_update = statistics.mean(r.get("trainer/update_s", r["trainer/step_s"]) for r in train)
    steps_per_s = len(train) / walls[-1]
    # Steady state: from the end of the first step, whose wait is the samplers' first batch.
    steady_steps_per_s = (len(train) - 1) / (walls[-1] - walls[0])
    t_phase = max(t_gen, statistics.mean(r["trainer/step_s"] for r in train[1:]))
    k = min(10, len(train))
    return {
        "final_reward": sum(r["reward/mean"] for r in train[-k:]) / k,
        "eval_before": evals[0] if evals else None,
        "eval_after": evals[-1] if evals else None,
        "s_per_step": walls[-1] / len(train),
        "steps_per_s": steps_per_s,
        "time_to_target_s": time_to(train, walls, target),
        "trainer_util": sum(r["trainer/step_s"] for r in train) / walls[-1],
        "sampler_util": sampler_busy,
        "t_generate_s": t_gen,
        "t_fetch_s": t_fetch,
        "t_train_s": t_train,
        "t_update_s": t_update,
        # Async's promise: a step costs only the slower phase. Meaningless for a serial loop.
        "overlap_eff": None if name.startswith("colocated") else steady_steps_per_s * t_phase,
        "fill_s": None if name.startswith("colocated") else walls[0] - train[0]["trainer/step_s"],
        # Sync alternates by design: only async can hope for a step as cheap as its slower phase.
        "ideal_s_per_step": max(t_gen, t_train) if name.startswith("async") else None,
        "curve": [(w, r["reward/mean"]) for w, r in zip(walls, train)],
    }


def mean_std(xs: list[float | None]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2, help="cores: co-located uses them all")
    ap.add_argument("--target", type=float, default=0.8, help="train reward to time (10-step avg)")
    ap.add_argument(
        "--reuse", action="store_true", help="measure finished runs in --work again, run the rest"
    )
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--work", type=Path, default=Path("runs/bench_protocols"))
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    console = Console(width=200)
    model = args.work / "sft"
    if not model.is_dir():
        console.print("warming the tiny model up on add (shared by every run)")
        echorl("sft", "--task", "add", "--out", str(model))
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    for seed in args.seeds:
        for name in args.configs:
            t0 = time.time()
            out = run_one(
                name, model, args.work / f"{name}-s{seed}", seed, args.steps, args.threads
            )
            results[name].append(measure(name, out, args.target))
            console.print(f"seed {seed} {name:9s} done in {time.time() - t0:.0f} s")
    table = Table(title=f"protocols: add, 1m model, {args.steps} steps x {len(args.seeds)} seeds")
    cols = ("final_reward", "eval_after", "s_per_step", "time_to_target_s", "trainer_util")
    cols += (
        "sampler_util",
        "t_generate_s",
        "t_fetch_s",
        "t_train_s",
        "t_update_s",
        "fill_s",
        "overlap_eff",
    )
    table.add_column("config")
    for c in cols:
        table.add_column(c.replace("_", " "))
    table.add_column("x colocated")
    table.add_column("ideal x")
    summary = {}
    base = statistics.mean(r["steps_per_s"] for r in results.get("colocated", [{"steps_per_s": 0}]))
    for name, runs in results.items():
        keep = (*cols, "steps_per_s", "eval_before", "ideal_s_per_step")
        summary[name] = {c: [r[c] for r in runs] for c in keep}
        speedup = ideal = None
        if base:
            speedup = statistics.mean(r["steps_per_s"] for r in runs) / base
            summary[name]["speedup_vs_colocated"] = speedup
            if runs[0]["ideal_s_per_step"] is not None:
                # Perfect overlap: a step costs only the slower phase, as measured in this run.
                ideal = 1 / base / statistics.mean(r["ideal_s_per_step"] for r in runs)
                summary[name]["ideal_speedup"] = ideal
        table.add_row(
            name,
            *(mean_std([r[c] for r in runs]) for c in cols),
            "-" if speedup is None else f"{speedup:.2f}",
            "-" if ideal is None else f"{ideal:.2f}",
        )
    console.print(table)
    if "colocated-1t" in results:  # the same work on the same one core, with and without I/O
        alone = statistics.mean(r["t_update_s"] for r in results["colocated-1t"])
        for name, runs in results.items():
            if not name.startswith("colocated"):
                update = statistics.mean(r["t_update_s"] for r in runs) / alone
                train = statistics.mean(r["t_train_s"] for r in runs) / alone
                summary[name]["update_vs_colocated_1t"] = update
                summary[name]["train_vs_colocated_1t"] = train
                console.print(
                    f"{name}: T_update / colocated-1t's T_train = {update:.3f}; "
                    f"T_train (with the audit) / colocated-1t's = {train:.3f}"
                )
    console.print(
        "x colocated: steps/s over the co-located loop's (all cores); ideal x: what perfect "
        "overlap would give, colocated s/step / max(T_generate, T_train) of this config"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "protocols.json").write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()} x{args.threads} cores",
                "steps": args.steps,
                "seeds": args.seeds,
                "target_reward": args.target,
                "summary": summary,
                "curves": {n: [r["curve"] for r in runs] for n, runs in results.items()},
            },
            indent=1,
        )
    )
    plot(results, args.out / "protocols.png")
    console.print(f"wrote {args.out / 'protocols.json'} and {args.out / 'protocols.png'}")


def plot(results: dict[str, list[dict]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for (name, runs), color in zip(
        results.items(),
        ("black", "tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"),
    ):
        for i, r in enumerate(runs):
            wall, reward = zip(*r["curve"])
            smooth = [
                sum(reward[max(0, j - 9) : j + 1]) / len(reward[max(0, j - 9) : j + 1])
                for j in range(len(reward))
            ]
            ax.plot(wall, smooth, color=color, alpha=0.8, label=name if i == 0 else None)
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("train reward (10-step avg)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("co-located vs decoupled (sync, async) on 2 cores")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
