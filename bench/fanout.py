"""Time for a new weight version to reach every sampler, behind real slow links: the broker
alone vs samplers passing it on to their peers (broker.peer_fanout, sampler.serve_peers).

The broker runs in the root namespace behind an uplink of --broker-mbit; K fetchers each in
a network namespace of their own behind --sampler-mbit each way (bench/netns.py: tc tbf on
veth cables; root needed). A fetcher is a sampler's weight path alone (register, ask the
broker for a source, fetch, verify the sha256, serve peers: `echorl.rollout.peers.obtain`),
without a model, so K = 8 fits 2 cores. The versions are bf16 weights (one tensor of random
bits; the broker keeps bf16: `broker.sampler_dtype`); v0 is fetched whole by all first, then
each version is the last with --step-share of its words changed (a small step), every fetcher is told to fetch it at once, and the time until the last
one holds it whole is taken. "+ delta": fetchers take the broker's delta against the version
they hold (transfer.apply_delta, checked by the sha256) instead of the whole version.

    sudo python bench/fanout.py                          # K = 1, 2, 4, 8; broker, fanout 1, 2
    sudo python bench/fanout.py --k 8 --size-mb 16       # one size

The lower bound a version can reach every sampler in: W / min(B_broker, B_sampler), one copy
over the slowest link on its way (a peer passes bytes on as they come, so each hop of the tree
adds little more than a round trip). Broker alone, its uplink carries K copies: at best
max(K W / B_broker, W / B_sampler). Prints a table and writes bench/results/fanout.json
and fanout.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.netns import HOST_IP, Net, unavailable  # noqa: E402
from echorl.client import BrokerClient  # noqa: E402
from echorl.models.tokenizer import RunTokenizer  # noqa: E402
from echorl.protocol import SamplerInfo  # noqa: E402
from echorl.rollout.peers import PeerServer, Shelf, obtain, reachable_host, with_served  # noqa: E402
from echorl.transfer import Partial, apply_delta  # noqa: E402

TRAINER, SAMPLER = "fanout-trainer", "fanout-sampler"


def fetcher(url: str, name: str, serve: bool, delta: bool) -> None:
    """In a sampler's namespace: register, then for each `go V` line on stdin fetch version V
    (as a delta against the one held where `delta` and the broker has one) and print when it
    was whole (and from whom); serve peers until stdin closes."""
    identity = {"tokenizer": RunTokenizer.builtin().fingerprint, "task": "add"}
    server = PeerServer(Shelf()).__enter__() if serve else None
    held: tuple[int, bytes, str] | None = None
    took = None  # the last whole download's time from its source: told with the next ask
    with BrokerClient(url, SAMPLER, timeout=30) as client:
        peer_url = server.url(reachable_host(url)) if server else None
        terms = client.join(SamplerInfo(name=name, **identity, peer_url=peer_url))
        if server:
            server.secret = terms.peer_secret
        print("ready", flush=True)
        for line in sys.stdin:
            version = int(line.split()[1])
            info = client.describe(version)
            part = Partial(info.sha256, info.size_bytes)
            if server:
                server.shelf.put(part)
            if delta and held and info.delta_base == held[0]:
                patch = client.fetch_delta(version)
                part.write(apply_delta(held[1], patch))
                source, fetched = "delta", len(patch)
            else:
                if took and server:  # how fast it passed the last one on (as a sampler)
                    took = with_served(took, server.shelf, held[2])
                got = obtain(client, info, part, name, took)
                took = got.took
                source, fetched = "peer" if got.peer else "broker", info.size_bytes
            assert part.whole
            held = (version, part.value(), info.sha256)
            print(json.dumps({"done": time.time(), "source": source, "bytes": fetched}))
            sys.stdout.flush()


def weights(words: np.ndarray, path: Path) -> None:
    """A safetensors file of one bf16 tensor holding `words` (what the broker stores as is
    with `broker.sampler_dtype = bfloat16`)."""
    save_file({"w": torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)}, path)


def small_step(words: np.ndarray, share: float, seed: int) -> np.ndarray:
    """`words` with `share` of them changed: a bf16 version after a small step."""
    moved = np.random.default_rng(seed).random(len(words)) < share
    out = words.copy()
    out[moved] ^= 0x0001
    return out


def measure(net: Net, k: int, fanout: int, delta: bool, size: int, share: float, versions: int):
    """Seconds for each of versions 1..`versions` (each a small step from the last; v0, fetched
    whole by all first, is not timed) to reach all `k` fetchers, and where they came from."""
    port = 18000 + k * 10 + fanout + 5 * delta
    data = Path(f"/tmp/echorl-fanout-{os.getpid()}-{k}-{fanout}-{delta}")
    data.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"ECHORL_TRAINER_TOKEN": TRAINER, "ECHORL_SAMPLER_TOKEN": SAMPLER}
    broker = subprocess.Popen(
        [sys.executable, "-m", "echorl.cli", "broker", "--data-dir", str(data / "b")]
        + ["--port", str(port), "-o", "broker.host=0.0.0.0", "-o", f"broker.peer_fanout={fanout}"]
        + ["-o", f"broker.max_weights_bytes={4 * size}", "-o", "broker.sampler_dtype=bfloat16"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://{HOST_IP}:{port}"
    fetchers = []
    try:
        with BrokerClient(f"http://127.0.0.1:{port}", TRAINER, retries=30, backoff=0.5) as trainer:
            trainer.run_info()
            for i, link in enumerate(net.links[:k]):
                cmd = [sys.executable, str(Path(__file__).resolve()), "--fetcher", url, f"f{i}"]
                cmd += ["--serve"] if fanout else []
                cmd += ["--delta"] if delta else []
                fetchers.append(
                    subprocess.Popen(
                        link.exec(*cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                    )
                )
            for f in fetchers:
                assert f.stdout.readline().strip() == "ready"
            times, sources, fetched = [], Counter(), 0
            words = np.frombuffer(os.urandom(size), "<u2").copy()
            for v in range(versions + 1):
                words = words if v == 0 else small_step(words, share, v)
                weights(words, data / "w.safetensors")
                trainer.publish(v, data / "w.safetensors")
                t0 = time.time()
                for f in fetchers:
                    f.stdin.write(f"go {v}\n")
                    f.stdin.flush()
                done = [json.loads(f.stdout.readline()) for f in fetchers]
                if v:
                    times.append(max(d["done"] for d in done) - t0)
                    sources.update(d["source"] for d in done)
                    fetched += sum(d["bytes"] for d in done)
    finally:
        for f in fetchers:
            f.stdin.close()
            f.wait(30)
        broker.terminate()
        broker.wait(30)
        subprocess.run(["rm", "-rf", str(data)])
    share = fetched / (versions * k * size)  # bytes a sampler fetched per version, of W
    return times, {s: n / versions for s, n in sources.items()}, share


def tree_depth(k: int, fanout: int) -> int:
    """Hops from the broker to the deepest of `k` samplers in broker/fanout.py's tree (the
    broker and every sampler pass a version on to `fanout` others)."""
    if fanout == 0:
        return 1
    depth, reached = 0, 0
    while reached < k:
        depth += 1
        reached += fanout**depth
    return depth


def render(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    cols = ("K", "source", "s to all", "bound: any tree", "bound: broker alone", "came from")
    for col in (*cols, "bytes / version"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["k"]),
            r["source"],
            f"{r['seconds_to_all']:.2f}",
            f"{r['lower_bound_s']:.2f}",
            f"{r['broker_alone_bound_s']:.2f}",
            ", ".join(f"{s} {n:g}" for s, n in sorted(r["sources_per_version"].items())),
            f"{r['bytes_per_version_share']:.1%}",
        )
    return table


def plot(rows: list[dict], path: Path, title: str, ax=None) -> None:
    """Seconds to every sampler against K, a line per source, with the two bounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for source in dict.fromkeys(r["source"] for r in rows):
        mine = [r for r in rows if r["source"] == source]
        ax.plot([r["k"] for r in mine], [r["seconds_to_all"] for r in mine], "o-", label=source)
    ks = sorted({r["k"] for r in rows})
    bounds = {r["k"]: r for r in rows}
    ax.plot(
        ks,
        [bounds[k]["broker_alone_bound_s"] for k in ks],
        "k--",
        lw=1,
        label="bound: broker alone",
    )
    ax.plot(
        ks,
        [bounds[k]["lower_bound_s"] for k in ks],
        "k:",
        lw=1,
        label="bound: one copy, slowest link",
    )
    ax.set_xlabel("samplers K")
    ax.set_ylabel("s until every sampler holds the version")
    ax.set_xticks(ks)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    if own:
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def sweep(
    ks: list[int],
    configs: list[tuple[int, bool]],
    size_mb: float,
    broker_mbit: float,
    sampler_mbit: float,
    step_share: float,
    console: Console,
    slow_uplink: float | None = None,
    versions: int = 2,
) -> list[dict]:
    """One row per K and (fan-out, delta) configuration; needs root (`unavailable()`).
    `slow_uplink`: the first sampler sends at this many Mbit/s only (a home line): a poor
    peer to pass a version on."""
    size = int(size_mb * (1 << 20))
    bits = size * 8 / 1e6  # Mbit
    rows = []
    with Net(broker_mbit=broker_mbit) as net:
        for k in range(max(ks)):
            net.add(f"f{k}", mbit=sampler_mbit, up_mbit=slow_uplink if k == 0 else None)
        for k in ks:
            for fanout, delta in configs:
                if fanout and k == 1 and not delta:
                    continue  # nobody to pass it on to
                times, sources, share = measure(net, k, fanout, delta, size, step_share, versions)
                seconds = sum(times) / len(times)
                label = "broker" if not fanout else f"peers, fan-out {fanout}"
                rows.append(
                    {
                        "k": k,
                        "source": label + (" + delta" if delta else ""),
                        "fanout": fanout,
                        "delta": delta,
                        "seconds_to_all": round(seconds, 2),
                        "seconds_per_version": [round(t, 2) for t in times],
                        "lower_bound_s": round(bits / min(broker_mbit, sampler_mbit), 2),
                        "broker_alone_bound_s": round(
                            max(k * bits / broker_mbit, bits / sampler_mbit), 2
                        ),
                        "tree_depth": tree_depth(k, fanout),
                        "slow_uplink_mbit": slow_uplink,
                        "sources_per_version": sources,
                        "bytes_per_version_share": round(share, 4),
                    }
                )
                console.print(rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fetcher", nargs=2, metavar=("URL", "NAME"), help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--fanout", type=int, nargs="+", default=[0, 1, 2], help="0: broker alone")
    ap.add_argument(
        "--delta-fanout", type=int, nargs="*", default=[1], help="the same, samplers taking deltas"
    )
    ap.add_argument("--step-share", type=float, default=0.03, help="16-bit words a version changes")
    ap.add_argument("--delta", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--versions", type=int, default=2, help="versions timed (after v0)")
    ap.add_argument("--size-mb", type=float, default=8.0, help="bytes of a version (W)")
    ap.add_argument("--broker-mbit", type=float, default=50.0)
    ap.add_argument("--sampler-mbit", type=float, default=50.0)
    ap.add_argument(
        "--slow-uplink", type=float, help="Mbit/s the first sampler sends at (default: as fast)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fanout.json")
    args = ap.parse_args()
    if args.fetcher:
        return fetcher(*args.fetcher, args.serve, args.delta)
    console = Console()
    if why := unavailable():
        console.print(f"[red]bench/fanout.py needs network namespaces: {why}")
        raise SystemExit(2)
    configs = [(f, False) for f in args.fanout] + [(f, True) for f in args.delta_fanout]
    rows = sweep(args.k, configs, args.size_mb, args.broker_mbit, args.sampler_mbit,
                 args.step_share, console, args.slow_uplink, args.versions)  # fmt: skip
    slow = f", one sending at {args.slow_uplink:g}" if args.slow_uplink else ""
    title = (
        f"a {args.size_mb:g} MB version to every sampler: broker {args.broker_mbit:g} "
        f"Mbit/s, samplers {args.sampler_mbit:g} Mbit/s each{slow} (tc tbf, network namespaces)"
    )
    table = render(rows, title)
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "size_mb": args.size_mb,
                "broker_mbit": args.broker_mbit,
                "sampler_mbit": args.sampler_mbit,
                "slow_uplink_mbit": args.slow_uplink,
                "versions": args.versions,
                "rows": rows,
            },
            indent=1,
        )
    )
    png = args.out.with_suffix(".png")
    plot(rows, png, title)
    console.print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
