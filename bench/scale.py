"""The swarm at scale, emulated (echorl/emulate): the real broker with K emulated samplers on
GPU-speed profiles and wide-area links, and an emulated trainer sized to the swarm
(ECHO-2's provisioning ratio `--capacity`: the samplers' profile tokens/s over the
trainer's). Each row is one run of `--steps` trainer steps.

    python bench/scale.py                          # K = 16, 64, 256 x sync, async
    python bench/scale.py --k 1024 --modes async   # one row
    python bench/scale.py --k 64 --churn 0.1 --hostile 0.05
    python bench/scale.py --spread --k 256 1024     # a version to every sampler, alone

Per row: steps per emulated minute, the trainer's utilisation (compute over wall, steady
state) and its mean wait a step against what the provisioning rule predicts, the consumed
groups' staleness, wasted tokens (pushed, never consumed), a version's fetch (median,
emulated s), the broker's CPU share and /healthz p99 (real ms), and the emulation's own
real seconds. Writes bench/results/scale.json and bench/results/scale.png.

`--spread`: no training, only the versions: one published, every sampler told to fetch it
at once (after the one before, held by all), the emulated seconds until every honest sampler
holds it against the lower bound (each sampler takes the bytes over its own downlink; the
broker sends them once): full from the broker alone, full with peers (fan-out 2), as a delta
with peers, and full with peers of which `--hostile` (default 5%) trickle. Writes
bench/results/scale_spread.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
from echorl.emulate.swarm import Scenario, emulate, spread  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# A 10x spread of speeds (RTX 3090 to H200, profiles.toml) and links from the datacenter to
# cable; beats every 10 s (lease_silence_s 30): 1,024 samplers beat 100 times a second.
GPUS = {"H200": 0.05, "H100": 0.1, "A100": 0.2, "L40S": 0.2, "RTX4090": 0.25, "RTX3090": 0.2}
LINKS = {"datacenter": 0.3, "fiber": 0.4, "cable": 0.3}


def scenario(k: int, mode: str, args) -> Scenario:
    return Scenario(
        samplers=k,
        mode=mode,
        steps=args.steps,
        capacity=args.capacity,
        speedup=args.speedup,
        batch_prompts=max(16, k // 2),  # a step's batch grows with the swarm
        mean_tokens=args.tokens,
        model_bytes=args.model_gb * 1e9,
        gpus=GPUS,
        links=LINKS,
        deltas=args.deltas,
        churn_per_hour=args.churn,
        hostile=args.hostile,
        token_scale=args.token_scale,
        lease_s=args.lease_s,
        broker_overrides=["broker.lease_silence_s=30", "broker.sampler_timeout=120"],
    )


def row(r: dict) -> list[str]:
    sc = r["scenario"]
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    return [
        str(sc["samplers"]),
        sc["mode"],
        f(r["steps_per_emulated_min"]),
        f(r["trainer_util"]),
        f(r["trainer_wait_s"], 1),
        f(r["predicted_wait_s"], 1),
        str(r["staleness_max"]),
        f(r["wasted_token_share"]),
        f(r["fetch_s_median"], 1),
        f(r["broker_cpu_share"]),
        f(r["healthz_p99_ms"], 1),
        f(r["real_s"], 0),
    ]


HEAD = ["K", "mode", "steps/min", "trainer util", "wait s", "rule s", "stale max", "wasted",
        "fetch s", "broker cpu", "healthz p99 ms", "real s"]  # fmt: skip


def plot(results: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode in ("sync", "async"):
        rs = [r for r in results if r["scenario"]["mode"] == mode]
        ks = [r["scenario"]["samplers"] for r in rs]
        axes[0].plot(ks, [r["trainer_util"] for r in rs], "o-", label=mode)
        axes[1].plot(ks, [r["trainer_wait_s"] for r in rs], "o-", label=f"{mode}: measured")
        axes[1].plot(ks, [r["predicted_wait_s"] for r in rs], "x--", label=f"{mode}: the rule")
    for ax, title in zip(axes, ("trainer utilisation", "trainer wait a step (emulated s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("emulated samplers")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


SPREADS = {
    "full, broker alone": {"peer_fanout": 0},
    "full, peers": {"peer_fanout": 2},
    "delta, peers": {"peer_fanout": 2, "deltas": True},
    "full, peers, hostile": {"peer_fanout": 2, "hostile": None},  # None: --hostile
}


def spreads(args, console: Console) -> None:
    rows = []
    for k in args.k:
        for name, knobs in SPREADS.items():
            knobs = {**knobs, "hostile": knobs.get("hostile", 0.0)}
            if knobs["hostile"] is None:
                knobs["hostile"] = args.hostile or 0.05
            if knobs["peer_fanout"] == 0 and k > 64:
                continue  # K full copies over the broker's uplink: its bound, K x W / B
            sc = Scenario(
                samplers=k,
                model_bytes=args.model_gb * 1e9,
                gpus=GPUS,
                links=LINKS,
                speedup=args.speedup,
                broker_overrides=["broker.lease_silence_s=30", "broker.sampler_timeout=600"],
                **knobs,
            )
            t0 = time.perf_counter()
            r = spread(sc, versions=1)
            r.pop("trail")
            ratio = r["seconds_to_all"] / r["lower_bound_s"]
            rows.append({"k": k, "how": name, **knobs, **r, "over_bound": ratio,
                         "real_s": time.perf_counter() - t0})  # fmt: skip
            console.print(
                f"K={k} {name}: {r['seconds_to_all']:.0f} s against {r['lower_bound_s']:.0f} "
                f"({ratio:.2f}x), {r['sources']} ({time.perf_counter() - t0:.0f} real s)"
            )
    table = Table(title=f"a {args.model_gb:g} GB version to every sampler (emulated)")
    for h in ("K", "how", "s to all", "lower bound s", "x bound", "sources", "real s"):
        table.add_column(h)
    for r in rows:
        table.add_row(
            str(r["k"]), r["how"], f"{r['seconds_to_all']:.0f}", f"{r['lower_bound_s']:.0f}",
            f"{r['over_bound']:.2f}", str(r["sources"]), f"{r['real_s']:.0f}",
        )  # fmt: skip
    console.print(table)
    out = RESULTS / "scale_spread.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    console.print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--modes", nargs="+", default=["sync", "async"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--capacity", type=float, default=1.5, help="swarm tokens/s over the trainer's")
    ap.add_argument("--speedup", type=float, default=10.0, help="emulated seconds per real second")
    ap.add_argument("--lease-s", type=float, default=60.0, help="emulated seconds a lease asks for")
    ap.add_argument("--tokens", type=float, default=2048, help="mean completion tokens")
    ap.add_argument("--token-scale", type=int, default=64, help="real tokens per wire token")
    ap.add_argument("--model-gb", type=float, default=8.0, help="a version's size")
    ap.add_argument("--deltas", action="store_true", help="versions as deltas")
    ap.add_argument("--churn", type=float, default=0.0, help="departures per sampler-hour")
    ap.add_argument("--hostile", type=float, default=0.0, help="share that lease and never push")
    ap.add_argument("--progress", action="store_true", help="print each trainer step")
    ap.add_argument("--spread", action="store_true", help="only a version to every sampler")
    ap.add_argument("--out", default=str(RESULTS / "scale.json"))
    args = ap.parse_args()
    console = Console()
    if args.spread:
        return spreads(args, console)
    results = []
    for k in args.k:
        for mode in args.modes:
            t0 = time.perf_counter()
            r = emulate(scenario(k, mode, args), progress=args.progress)
            r.pop("steps_log")
            results.append(r)
            console.print(f"K={k} {mode}: {time.perf_counter() - t0:.0f} s")
    table = Table(
        title=f"emulated swarm ({args.model_gb:g} GB versions, capacity {args.capacity:g}x)"
    )
    for h in HEAD:
        table.add_column(h)
    for r in results:
        table.add_row(*row(r))
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {__import__('os').cpu_count()} cores"
    out.write_text(
        json.dumps({"machine": machine, "args": vars(args), "results": results}, indent=1)
    )
    plot(results, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
