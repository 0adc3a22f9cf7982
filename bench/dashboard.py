"""Benchmark: what open dashboards cost a running swarm. A real broker, 2 samplers and the
trainer (the 1m tiny model, async, B = 8 x G = 4) run for `--seconds` with no dashboard open,
then as long with `--viewers` pages open (each one the page's live stream plus its first
snapshot, as a browser holds them). Measured in each phase: `/healthz` latency (probed every
20 ms: p50, p99), the trainer's steps/s and its mean wait for groups (`trainer/idle_s`), and
the broker's pull waits (its `broker_trainer_pull_wait_seconds` histogram, p99 by bucket).

    python bench/dashboard.py [--seconds 30] [--viewers 5]

Prints a table; writes bench/results/dashboard.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echorl.models import save_tiny_model  # noqa: E402
from tests.integration.conftest import (  # noqa: E402
    TRAINER,
    free_port,
    read_jsonl,
    start_broker,
    start_sampler,
    start_trainer,
    stop_broker,
    wait_until,
)

RUN = ["-o", "train.batch_prompts=8", "-o", "train.group_size=4", "-o", "broker.mode=async"]
RUN += ["-o", "sampling.max_new_tokens=8", "-o", "train.eval_prompts=4"]
RUN += ["-o", "train.drop_flat_groups=false"]


def probe(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(url + "/healthz")
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)


def viewer(url: str, stop: threading.Event, seen: list[int]) -> None:
    """One open page: its first snapshot, then the live stream until `stop`."""
    with httpx.Client(base_url=url, timeout=30) as c:
        c.get("/ui", params={"token": TRAINER}, follow_redirects=True)
        c.get("/ui/api/snapshot")
        with c.stream("GET", "/ui/events") as events:
            for line in events.iter_lines():
                if line.startswith("data: "):
                    seen.append(len(line))
                if stop.is_set():
                    return


def pull_wait_p99(url: str) -> dict[str, float]:
    """The broker's pull-wait histogram: cumulative counts by upper bound."""
    text = httpx.get(url + "/metrics").text
    buckets = {}
    for line in text.splitlines():
        if line.startswith("broker_trainer_pull_wait_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets[le] = float(line.rsplit(" ", 1)[1])
    return buckets


def p99_between(before: dict, after: dict) -> float | None:
    """The 99th percentile's bucket bound of the pulls made between two readings."""
    diffs = {le: after[le] - before.get(le, 0) for le in after}
    total = diffs.get("+Inf", 0)
    if not total:
        return None
    for le, n in sorted(diffs.items(), key=lambda kv: float(kv[0])):
        if n >= 0.99 * total:
            return float(le)
    return None


def phase(url: str, out: Path, seconds: float, viewers: int) -> dict:
    stop, lat, seen = threading.Event(), [], []
    threads = [threading.Thread(target=probe, args=(url, stop, lat), daemon=True)]
    threads += [
        threading.Thread(target=viewer, args=(url, stop, seen), daemon=True) for _ in range(viewers)
    ]
    before = pull_wait_p99(url)
    t0 = time.time()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    t1 = time.time()
    after = pull_wait_p99(url)
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "time" in r and t0 <= r["time"] <= t1]
    lat.sort()
    return {
        "viewers": viewers,
        "healthz_p50_ms": 1000 * statistics.median(lat),
        "healthz_p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))],
        "steps_per_s": len(steps) / (t1 - t0),
        "trainer_idle_s": statistics.mean(r["trainer/idle_s"] for r in steps) if steps else None,
        "pull_wait_p99_s": p99_between(before, after),
        "snapshots_sent": len(seen),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--viewers", type=int, default=5)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = save_tiny_model(tmp / "v0", "1m", seed=0)
    proc, url = start_broker(tmp / "b", free_port(), *RUN)
    samplers = [start_sampler(url, model, f"s{k}", *RUN) for k in range(2)]
    trainer = start_trainer(url, model, tmp / "out", *RUN, "-o", "train.steps=100000")
    rows = []
    try:
        wait_until(lambda: len(read_jsonl(tmp / "out" / "metrics.jsonl")) > 10, what="10 steps")
        rows.append(phase(url, tmp / "out", a.seconds, 0))
        rows.append(phase(url, tmp / "out", a.seconds, a.viewers))
    finally:
        for p in [trainer, *samplers]:
            p.terminate()
            p.communicate(timeout=60)
        stop_broker(proc)
    table = Table(title="open dashboards against a running swarm (2 samplers, async)")
    for col in rows[0]:
        table.add_column(col)
    for r in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()))
    Console(width=160).print(table)
    results = ROOT / "bench" / "results" / "dashboard.json"
    results.write_text(json.dumps({"seconds": a.seconds, "rows": rows}, indent=1))
    print(results)


if __name__ == "__main__":
    main()
