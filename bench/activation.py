"""Cost-aware activation, measured in emulation: the cost per trainer step of the broker's
policy (`broker.activation = cheapest`) against every sampler active, and against the
cheapest set that covers the trainer's need computed offline (knowing every machine's true
speed and price), at the same trainer utilisation.

The swarm is drawn from `echorl/emulate/profiles.toml` (GPU classes with their RunPod
prices, in datacentres: the prices are a cloud's), a 4B model whose versions go as deltas,
the trainer sized so that the swarm makes `--capacity` x what it consumes; a parked sampler
costs nothing. The offline set covers the need x (1 + margin), the same
headroom the policy keeps (an exact cover with no headroom would idle the trainer).

    python bench/activation.py                 # K = 32, capacity 2x, async
    python bench/activation.py --k 64 --steps 60

Prints a table and writes bench/results/activation.json and activation.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from echorl.emulate.swarm import Scenario, emulate  # noqa: E402

COLUMNS = (
    "cost_per_step",
    "cost_per_step_late",
    "trainer_util",
    "active_samplers_mean",
    "parks",
    "trainer_wait_s",
)


def offline_cover(machines: list[dict], rate: float, buckets: int = 400) -> list[int]:
    """The cheapest set of `machines` (true speeds and prices) whose tokens/s reach `rate`:
    a 0/1 covering knapsack over speeds in 1/`buckets` of `rate` (exact up to that)."""
    unit = rate / buckets
    inf = float("inf")
    best = [0.0] + [inf] * buckets  # cost to reach >= b units
    pick: list[list[int]] = [[] for _ in range(buckets + 1)]
    for m in machines:
        units = int(m["tokens_per_s"] // unit)  # rounded down: the cover never falls short
        for b in range(buckets, 0, -1):
            prev = max(0, b - units)
            if best[prev] + m["price"] < best[b]:
                best[b], pick[b] = best[prev] + m["price"], [*pick[prev], m["k"]]
    return pick[buckets]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--capacity", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hold-s", type=float, default=10.0, help="broker.activation_hold_s (real s)")
    ap.add_argument("--margin", type=float, default=0.2)
    ap.add_argument("--mode", default="async", choices=["sync", "async"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/activation.json")
    ap.add_argument(
        "--policy-only", action="store_true", help="rerun the policy; the rest from --out"
    )
    args = ap.parse_args()
    console = Console(width=160)
    base = Scenario(
        samplers=args.k,
        mode=args.mode,
        steps=args.steps,
        capacity=args.capacity,
        max_staleness=2,
        deltas=True,  # 4B bf16 versions, sent as deltas (9% of 8 GB) to holders of the last
        links={"datacenter": 1.0},  # rented GPUs (the prices are a cloud's) sit in datacentres
        gpus={"H100": 0.1, "A100": 0.2, "L40S": 0.2, "RTX4090": 0.3, "RTX3090": 0.2},
        # A step of minutes' worth of tokens, as RL steps are: versions (fetched and loaded
        # in ~5 s) then cost little of a sampler's time, and the speeds the broker measures
        # are about what the machines can do.
        batch_prompts=16 * args.k,
        activation_margin=args.margin,
        activation_hold_s=args.hold_s,
    )
    rows = {}
    if args.policy_only:  # the two rows the policy does not change, from the last run
        rows = json.loads(args.out.read_text())["rows"]
    else:
        rows["all active"] = emulate(base)
        console.print(f"all active: {rows['all active']['cost_per_step']:.4f}/step")
    rows["policy (cheapest)"] = emulate(replace(base, activation="cheapest"))
    console.print(f"policy: {rows['policy (cheapest)']['cost_per_step']:.4f}/step")
    need = rows["all active"]["trainer_tokens_per_s"]
    priced = [m for m in rows["all active"]["machines"] if m["price"] and not m["hostile"]]
    chosen = offline_cover(priced, need * (1 + args.margin))
    if not args.policy_only:
        rows["offline optimum"] = emulate(replace(base, only=chosen))
    rows = {k: rows[k] for k in ("all active", "policy (cheapest)", "offline optimum")}
    table = Table(
        title=f"cost-aware activation: K = {args.k}, capacity {args.capacity:g}x, {args.mode}, "
        f"margin {args.margin:g}, {args.steps} steps (emulated; price per GPU-hour, RunPod)"
    )
    table.add_column("who works")
    for c in COLUMNS:
        table.add_column(c.replace("_", " "), justify="right")
    for name, r in rows.items():
        table.add_row(
            name, *(f"{r[c]:.4f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS)
        )
    console.print(table)
    pol, opt, full = (
        rows[k]["cost_per_step"] for k in ("policy (cheapest)", "offline optimum", "all active")
    )
    verdict: dict = {"offline_set": chosen}
    names = ("policy (cheapest)", "offline optimum", "all active")
    for col in ("cost_per_step", "cost_per_step_late"):
        pol, opt, full = (rows[k][col] for k in names)
        verdict[col] = {"policy_over_optimum": pol / opt - 1, "policy_below_all": 1 - pol / full}
        console.print(
            f"{col}: policy {pol / opt - 1:+.1%} against the offline optimum, "
            f"{1 - pol / full:.1%} below everyone active"
        )
    for r in rows.values():
        r.pop("steps_log", None)
    args.out.write_text(json.dumps({"rows": rows, **verdict}, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    names = list(rows)
    left.bar(names, [rows[n]["cost_per_step"] for n in names], color=["0.6", "C0", "C2"])
    left.set_ylabel("cost per trainer step (USD, GPU-hours x price)")
    right.bar(names, [rows[n]["trainer_util"] for n in names], color=["0.6", "C0", "C2"])
    right.set_ylabel("trainer utilisation")
    right.set_ylim(0, 1.05)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("cost-aware activation (emulated swarm)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
