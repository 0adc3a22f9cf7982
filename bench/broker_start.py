"""Benchmark: seconds from `echorl broker` launch until /healthz answers (target: under 2 s).

    python bench/broker_start.py [--runs 5]

Writes bench/results/broker_start.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until the broker on `port` answers /healthz (it must not exit meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5)
            return
        except httpx.TransportError:
            assert proc.poll() is None, "the broker exited"
            time.sleep(0.05)
    raise RuntimeError(f"the broker did not answer within {timeout:.0f} s")


def one_start() -> float:
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "echorl.cli",
                "broker",
                "--insecure-no-auth",
                "--data-dir",
                data,
                "--port",
                str(port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.2)
                    return time.perf_counter() - t0
                except httpx.TransportError:
                    assert proc.poll() is None, "broker exited"
                    time.sleep(0.01)
        finally:
            proc.terminate()
            proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "broker_start.json"
    )
    args = ap.parse_args()
    times = [one_start() for _ in range(args.runs)]
    row = {"runs": args.runs, "median_s": statistics.median(times), "max_s": max(times)}
    table = Table(title="broker start (launch -> /healthz answers)")
    for col in ("runs", "median s", "max s"):
        table.add_column(col, justify="right")
    table.add_row(str(row["runs"]), f"{row['median_s']:.2f}", f"{row['max_s']:.2f}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
