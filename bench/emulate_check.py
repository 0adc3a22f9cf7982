"""The emulator checked against real runs: does it predict what the real swarm did?

Swarms (`bench/swarm.py`'s runs, K = 1-8 uneven samplers on this machine): each run's
machines are measured from its own logs (each sampler's generation tokens/s and its time to
fetch and load a version; the trainer's compute a step and its bookkeeping beside it), the
emulator runs the same configuration on those machines against a real broker, and its
trainer steps/s and wait per step are set beside the run's. What the emulator predicts is
the queueing between them: leases, versions, staleness admission, the trainer's waits.

Versions (`bench/fanout.py`'s rows, K = 1-8 fetchers behind tc-limited 50 Mbit/s links, the
broker alone, peers, deltas; and one sending at 5 Mbit/s): the emulator's link model on the
same links, with the real broker naming sources; its time for a version to reach every
fetcher beside the measured one.

    python bench/swarm.py --configs sync async --steps 20 --no-updates --work runs/bench_swarm
    python bench/emulate_check.py --runs runs/bench_swarm

Prints a table, writes bench/results/emulate_check.json and .png. A row is within the mark
when the emulator is within 15% of the measured figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.swarm import measure  # noqa: E402
from echorl.emulate.swarm import Scenario, emulate, spread  # noqa: E402
from echorl.metrics import read_metrics  # noqa: E402

MARK = 0.15


def calibrate(run: Path) -> tuple[Scenario, dict]:
    """A scenario of `run`'s own machines (measured from its logs) and its configuration."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    train = [r for r in read_metrics(run / "metrics.jsonl") if "reward/mean" in r]
    steady = train[1:]
    step_s = statistics.mean(r["trainer/step_s"] for r in steady)
    walls = [r["trainer/wall_s"] for r in train]
    per_step = (walls[-1] - walls[0]) / (len(train) - 1)
    idle = statistics.mean(r["trainer/idle_s"] for r in steady)
    machines = []
    for log in sorted((run / "samplers").glob("sampler-*.jsonl")):
        leases = [b for b in read_metrics(log) if b.get("jobs")]
        busy = sum(b["sampler/gen_s"] + b.get("sampler/throttle_s", 0.0) for b in leases)
        fetches = [b["sampler/download_s"] for b in leases if b.get("sampler/download_s")]
        # Its time a lease beside the lease call, generating and fetching: the push and its
        # own work (encoding, serialising), between two leases' records.
        beside = [
            b["time"] - a["time"] - b["sampler/gen_s"] - b.get("sampler/throttle_s", 0.0)
            - b["sampler/download_s"] - b["sampler/idle_s"]
            for a, b in zip(leases, leases[1:])
        ]  # fmt: skip
        machines.append(
            {
                "name": log.stem,
                "tokens_per_s": sum(b["sampler/tokens"] for b in leases) / busy,
                "fetch_s": statistics.mean(fetches) if fetches else 0.0,
                "overhead_s": statistics.median(beside) if beside else 0.0,
            }
        )
    b = cfg["broker"]
    sc = Scenario(
        samplers=len(machines),
        mode=b["mode"],
        batch_prompts=cfg["train"]["batch_prompts"],
        group_size=cfg["train"]["group_size"],
        mean_tokens=statistics.mean(r["rollout/completion_tokens_mean"] for r in steady),
        length_sigma=0.3,
        token_scale=1,
        speedup=1.0,
        steps=len(train),
        max_staleness=b["max_staleness"],
        overprovision=b["overprovision"],
        peer_fanout=0,
        machines=machines,
        jobs_per_lease=cfg["sampler"]["jobs_per_lease"],
        lease_wait_s=cfg["sampler"]["lease_wait_s"],
        trainer_step_s=step_s,
        trainer_overhead_s=max(0.0, per_step - idle - step_s),
        model_bytes=1.0,
        broker_overrides=[f"broker.lease_by_speed={str(b['lease_by_speed']).lower()}"],
    )
    return sc, {"trainer_step_s": step_s, "machines": machines}


def emulated(result: dict) -> dict:
    """The emulator's steps/s and wait, taken as bench/swarm.py takes the real ones."""
    steps = result["steps_log"]
    span = steps[-1]["t"] - steps[0]["t"]
    return {
        "steps_per_s": (len(steps) - 1) / span if span else None,
        "trainer_wait_s": statistics.mean(s["waited"] for s in steps[1:]),
    }


def off(pred: float, real: float) -> float:
    return (pred - real) / real if real else 0.0


def check_swarms(runs: Path, console: Console) -> list[dict]:
    rows = []
    for run in sorted(p for p in runs.iterdir() if (p / "metrics.jsonl").is_file()):
        sc, machines = calibrate(run)
        real = measure(run, sc.samplers, sc.batch_prompts)
        emu = emulated(emulate(sc))
        row = {
            "run": run.name,
            "k": sc.samplers,
            "mode": sc.mode,
            "calibrated": machines,
            "real": {k: real[k] for k in ("steps_per_s", "trainer_wait_s")},
            "emulated": emu,
        }
        row["off"] = {k: off(emu[k], row["real"][k]) for k in emu}
        rows.append(row)
        console.print(f"{run.name}: real {row['real']}, emulated {emu}")
    return rows


def check_versions(paths: list[Path], console: Console) -> list[dict]:
    rows = []
    for path in paths:
        setup = json.loads(path.read_text())
        slow = setup.get("slow_uplink_mbit")
        for r in setup["rows"]:
            machines = [
                {"down_mbit": setup["sampler_mbit"], "up_mbit": setup["sampler_mbit"], "rtt_ms": 1}
                for _ in range(r["k"])
            ]
            if slow:
                machines[0]["up_mbit"] = slow
            sc = Scenario(
                samplers=r["k"],
                machines=machines,
                peer_fanout=r["fanout"],
                deltas=r["delta"],
                delta_fraction=r["bytes_per_version_share"] if r["delta"] else None,
                model_bytes=setup["size_mb"] * (1 << 20),
                broker_mbit=setup["broker_mbit"],
                load_s_per_gb=0.0,
                speedup=1.0,
            )
            got = spread(sc, versions=setup.get("versions", 2))
            row = {
                "setup": path.stem,
                "k": r["k"],
                "source": r["source"],
                "slow_uplink_mbit": slow,
                "real_s": r["seconds_to_all"],
                "emulated_s": got["seconds_to_all"],
                "lower_bound_s": r["lower_bound_s"],
            }
            row["off"] = off(row["emulated_s"], row["real_s"])
            rows.append(row)
            console.print(row)
    return rows


def render(swarms: list[dict], versions: list[dict]) -> tuple[Table, Table]:
    def cell(x: float) -> str:
        return f"[{'green' if abs(x) <= MARK else 'red'}]{x:+.0%}"

    t1 = Table(title="swarms: bench/swarm.py's runs against the emulator on their machines")
    for c in ("run", "K", "real steps/s", "emulated", "off", "real wait s", "emulated", "off"):
        t1.add_column(c, justify="right")
    for r in swarms:
        re, em, of = r["real"], r["emulated"], r["off"]
        t1.add_row(
            r["run"],
            str(r["k"]),
            f"{re['steps_per_s']:.2f}",
            f"{em['steps_per_s']:.2f}",
            cell(of["steps_per_s"]),
            f"{re['trainer_wait_s']:.3f}",
            f"{em['trainer_wait_s']:.3f}",
            cell(of["trainer_wait_s"]),
        )
    t2 = Table(title="versions: bench/fanout.py's rows against the emulator's links")
    for c in ("setup", "K", "source", "real s to all", "emulated", "off", "lower bound"):
        t2.add_column(c, justify="right")
    for r in versions:
        t2.add_row(
            r["setup"],
            str(r["k"]),
            r["source"],
            f"{r['real_s']:.2f}",
            f"{r['emulated_s']:.2f}",
            cell(r["off"]),
            f"{r['lower_bound_s']:.2f}",
        )
    return t1, t2


def plot(swarms: list[dict], versions: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), dpi=120)
    panels = (
        ("trainer steps/s", [(r["real"]["steps_per_s"], r["emulated"]["steps_per_s"]) for r in swarms]),
        ("trainer wait per step (s)", [(r["real"]["trainer_wait_s"], r["emulated"]["trainer_wait_s"]) for r in swarms]),
        ("s for a version to reach all", [(r["real_s"], r["emulated_s"]) for r in versions]),
    )  # fmt: skip
    for ax, (label, pairs) in zip(axes, panels):
        if not pairs:
            continue
        top = 1.1 * max(max(p) for p in pairs)
        ax.plot([0, top], [0, top], "k-", lw=0.8)
        ax.fill_between([0, top], [0, top * (1 - MARK)], [0, top * (1 + MARK)], alpha=0.15)
        ax.scatter([p[0] for p in pairs], [p[1] for p in pairs], s=18)
        ax.set_xlabel(f"measured: {label}")
        ax.set_ylabel("emulated")
        ax.grid(alpha=0.3)
    fig.suptitle(f"emulator against real runs (band: within {MARK:.0%})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, help="bench/swarm.py's --work folder (its run dirs)")
    ap.add_argument(
        "--versions",
        type=Path,
        nargs="*",
        default=[ROOT / "bench/results/fanout.json", ROOT / "bench/results/fanout_uneven.json"],
        help="bench/fanout.py's results",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/emulate_check.json")
    args = ap.parse_args()
    console = Console(width=160)
    swarms = check_swarms(args.runs, console) if args.runs else []
    versions = check_versions(args.versions, console)
    for t in render(swarms, versions):
        console.print(t)
    n = len(swarms) * 2 + len(versions)
    inside = sum(abs(v) <= MARK for r in swarms for v in r["off"].values())
    inside += sum(abs(r["off"]) <= MARK for r in versions)
    console.print(f"within {MARK:.0%}: {inside} of {n}")
    args.out.write_text(
        json.dumps({"mark": MARK, "swarms": swarms, "versions": versions}, indent=1)
    )
    plot(swarms, versions, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
