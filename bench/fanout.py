"""Time for a new weight version to reach every sampler, behind real slow links: the broker
alone vs samplers passing it on to their peers (broker.peer_fanout, sampler.serve_peers).

The broker runs in the root namespace behind an uplink of --broker-mbit; K fetchers each in
a network namespace of their own behind --sampler-mbit each way (bench/netns.py: tc tbf on
veth cables; root needed). A fetcher is a sampler's weight path alone (register, ask the
broker for a source, fetch, verify the sha256, serve peers: `echorl.rollout.peers.obtain`),
without a model, so K = 8 fits 2 cores. Each version is published, every fetcher is told to
fetch it at once, and the time until the last one holds it whole is taken.

    sudo python bench/fanout.py                          # K = 1, 2, 4, 8; broker, fanout 1, 2
    sudo python bench/fanout.py --k 8 --size-mb 16       # one size

The lower bound a version can reach every sampler in: W / min(B_broker, B_sampler), one copy
over the slowest link on its way (a peer passes bytes on as they come, so each hop of the tree
adds little more than a round trip). Broker alone, its uplink carries K copies: at best
max(K W / B_broker, W / B_sampler). Prints a table and writes bench/results/fanout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.netns import HOST_IP, Net, unavailable  # noqa: E402
from echorl.client import BrokerClient  # noqa: E402
from echorl.models.tokenizer import RunTokenizer  # noqa: E402
from echorl.protocol import SamplerInfo  # noqa: E402
from echorl.rollout.peers import PeerServer, Shelf, obtain, reachable_host  # noqa: E402
from echorl.transfer import Partial  # noqa: E402

TRAINER, SAMPLER = "fanout-trainer", "fanout-sampler"
VERSIONS = 2  # versions timed per configuration; the mean is reported


def fetcher(url: str, name: str, serve: bool) -> None:
    """In a sampler's namespace: register, then for each `go V` line on stdin fetch version V
    and print when it was whole (and from whom); serve peers until stdin closes."""
    identity = {"tokenizer": RunTokenizer.builtin().fingerprint, "task": "add"}
    server = PeerServer(Shelf()).__enter__() if serve else None
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
            got = obtain(client, info, part, name)
            assert part.whole
            print(json.dumps({"done": time.time(), "peer": got.peer, "failures": got.failures}))
            sys.stdout.flush()


def measure(net: Net, k: int, fanout: int, size: int, broker_mbit: float, sampler_mbit: float):
    """Mean seconds for VERSIONS versions to reach all `k` fetchers, and who served them."""
    port = 18000 + k * 10 + fanout
    data = Path(f"/tmp/echorl-fanout-{os.getpid()}-{k}-{fanout}")
    env = os.environ | {"ECHORL_TRAINER_TOKEN": TRAINER, "ECHORL_SAMPLER_TOKEN": SAMPLER}
    broker = subprocess.Popen(
        [sys.executable, "-m", "echorl.cli", "broker", "--data-dir", str(data), "--port", str(port)]
        + ["-o", "broker.host=0.0.0.0", "-o", f"broker.peer_fanout={fanout}"]
        + [
            "-o",
            f"broker.max_weights_bytes={4 * size}",
            "-o",
            "broker.registrations_per_minute=600",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://{HOST_IP}:{port}"
    fetchers = []
    try:
        with BrokerClient(f"http://127.0.0.1:{port}", TRAINER, retries=30, backoff=0.5) as trainer:
            trainer.run_info()
            links = net.links[:k]
            for i, link in enumerate(links):
                cmd = [sys.executable, str(Path(__file__).resolve()), "--fetcher", url, f"f{i}"]
                fetchers.append(
                    subprocess.Popen(
                        link.exec(*cmd, *(["--serve"] if fanout else [])),
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            for f in fetchers:
                assert f.stdout.readline().strip() == "ready"
            times, from_peers = [], 0
            for v in range(VERSIONS):
                blob = data / f"w{v}.bin"
                blob.write_bytes(os.urandom(size))
                trainer.publish(v, blob)
                t0 = time.time()
                for f in fetchers:
                    f.stdin.write(f"go {v}\n")
                    f.stdin.flush()
                done = [json.loads(f.stdout.readline()) for f in fetchers]
                times.append(max(d["done"] for d in done) - t0)
                from_peers += sum(d["peer"] is not None for d in done)
            sources = trainer.status(0).weight_sources
    finally:
        for f in fetchers:
            f.stdin.close()
            f.wait(30)
        broker.terminate()
        broker.wait(30)
        subprocess.run(["rm", "-rf", str(data)])
    return sum(times) / len(times), from_peers / VERSIONS, sources


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fetcher", nargs=2, metavar=("URL", "NAME"), help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--fanout", type=int, nargs="+", default=[0, 1, 2], help="0: broker alone")
    ap.add_argument("--size-mb", type=float, default=8.0, help="bytes of a version (W)")
    ap.add_argument("--broker-mbit", type=float, default=50.0)
    ap.add_argument("--sampler-mbit", type=float, default=50.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fanout.json")
    args = ap.parse_args()
    if args.fetcher:
        return fetcher(*args.fetcher, args.serve)
    console = Console()
    if why := unavailable():
        console.print(f"[red]bench/fanout.py needs network namespaces: {why}")
        raise SystemExit(2)
    size = int(args.size_mb * (1 << 20))
    bits = size * 8 / 1e6  # Mbit
    rows = []
    with Net(broker_mbit=args.broker_mbit) as net:
        for k in range(max(args.k)):
            net.add(f"f{k}", mbit=args.sampler_mbit)
        for k in args.k:
            for fanout in args.fanout:
                if fanout and k == 1:
                    continue  # nobody to pass it on to
                seconds, from_peers, sources = measure(
                    net, k, fanout, size, args.broker_mbit, args.sampler_mbit
                )
                bound = bits / min(args.broker_mbit, args.sampler_mbit)
                broker_only = max(k * bits / args.broker_mbit, bits / args.sampler_mbit)
                rows.append(
                    {
                        "k": k,
                        "source": "broker" if not fanout else f"peers (fanout {fanout})",
                        "fanout": fanout,
                        "seconds_to_all": round(seconds, 2),
                        "lower_bound_s": round(bound, 2),
                        "tree_depth": tree_depth(k, fanout),
                        "broker_alone_bound_s": round(broker_only, 2),
                        "from_peers_per_version": from_peers,
                        "named": sources,
                    }
                )
                console.print(rows[-1])
    table = Table(
        title=f"a {args.size_mb:g} MB version to every sampler: broker {args.broker_mbit:g} "
        f"Mbit/s, samplers {args.sampler_mbit:g} Mbit/s each (tc tbf, network namespaces)"
    )
    for col in ("K", "source", "s to all", "bound: any tree", "bound: broker alone", "from peers"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["k"]),
            r["source"],
            f"{r['seconds_to_all']:.2f}",
            f"{r['lower_bound_s']:.2f}",
            f"{r['broker_alone_bound_s']:.2f}",
            f"{r['from_peers_per_version']:g}/{r['k']}",
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "size_mb": args.size_mb,
                "broker_mbit": args.broker_mbit,
                "sampler_mbit": args.sampler_mbit,
                "rows": rows,
            },
            indent=1,
        )
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
