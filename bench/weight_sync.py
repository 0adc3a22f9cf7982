"""Benchmark: what one weight version costs on the wire, trainer -> broker -> sampler.

    python bench/weight_sync.py [--presets 1m 10m 50m] [--versions 5]

For each tiny-model preset (and, for the largest, samplers served bfloat16), a real
`echorl broker` process on a loopback port receives `--versions` versions, each as
the trainer publishes it: snapshot the state dict and hash it as a safetensors
stream (`serialise`), upload the stream (the broker hashes, fsyncs and stores it), then as a sampler fetches it: download into memory
and verify, load in place. Medians per version. Loopback only: the network a real
swarm crosses adds size / bandwidth on top.

Writes bench/results/weight_sync.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load

sys.path.insert(0, str(Path(__file__).parent))
from broker_start import free_port, wait_healthy  # noqa: E402

from echorl.client import BrokerClient  # noqa: E402
from echorl.models.tiny import build_tiny_model  # noqa: E402
from echorl.trainer.weights import stream_safetensors  # noqa: E402


def start_broker(data: str, port: int, dtype: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "echorl.cli", "broker", "--insecure-no-auth", "--data-dir", data]
        + ["--port", str(port), "-o", "broker.mode=async", "-o", f"broker.sampler_dtype={dtype}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_healthy(port, proc)
    return proc


def measure(preset: str, dtype: str, versions: int) -> dict:
    trainer_model, _ = build_tiny_model(preset, seed=0)
    sampler_model, _ = build_tiny_model(preset, seed=1)
    times: dict[str, list[float]] = {"serialise": [], "publish": [], "fetch": [], "load": []}
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        proc = start_broker(data, port, dtype)
        try:
            with BrokerClient(f"http://127.0.0.1:{port}") as client:
                for v in range(versions):
                    t0 = time.perf_counter()
                    state = {k: t.detach().clone() for k, t in trainer_model.state_dict().items()}
                    digest, size, chunks = stream_safetensors(state, {"format": "pt"})
                    t1 = time.perf_counter()
                    info = client.publish_stream(v, digest, size, chunks)
                    t2 = time.perf_counter()
                    fetched = client.fetch(info)
                    t3 = time.perf_counter()
                    weights = {k: t.to(torch.float32) for k, t in load(fetched).items()}
                    sampler_model.load_state_dict(weights, strict=True)
                    t4 = time.perf_counter()
                    for key, a, b in zip(times, (t0, t1, t2, t3), (t1, t2, t3, t4)):
                        times[key].append(b - a)
        finally:
            proc.terminate()
            proc.wait(10)
    ms = {f"{k}_ms": 1000 * statistics.median(v) for k, v in times.items()}
    total = sum(ms.values())
    return {
        "preset": preset,
        "params_m": sum(p.numel() for p in trainer_model.parameters()) / 1e6,
        "sampler_dtype": dtype,
        "upload_mb": size / 1e6,
        "download_mb": info.size_bytes / 1e6,
        **ms,
        "total_ms": total,
        "upload_mb_per_s": size / 1e6 / (ms["publish_ms"] / 1000),
        "download_mb_per_s": info.size_bytes / 1e6 / (ms["fetch_ms"] / 1000),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["1m", "10m", "50m"])
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "weight_sync.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = [(p, "float32") for p in args.presets] + [(args.presets[-1], "bfloat16")]
    rows = [measure(p, d, args.versions) for p, d in cases]
    table = Table(
        title=f"one weight version, trainer -> broker -> sampler (median of {args.versions})"
    )
    cols = ("preset", "sampler dtype", "MB up", "MB down", "serialise ms", "publish ms")
    cols += ("fetch ms", "load ms", "total ms", "up MB/s", "down MB/s")
    for c in cols:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(
            r["preset"],
            r["sampler_dtype"],
            f"{r['upload_mb']:.1f}",
            f"{r['download_mb']:.1f}",
            *(f"{r[k]:.1f}" for k in ("serialise_ms", "publish_ms", "fetch_ms", "load_ms")),
            f"{r['total_ms']:.0f}",
            f"{r['upload_mb_per_s']:.0f}",
            f"{r['download_mb_per_s']:.0f}",
        )
    Console(width=160).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"versions": args.versions, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
