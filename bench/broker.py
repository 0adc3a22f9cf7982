"""Benchmark: broker ingest under a swarm. N simulated samplers push scored groups (G = 8,
64-256 tokens each; one group per push, or `--per-push K` per push-batch) while a trainer
pulls and acks; the broker is a real `echorl broker` process with its verifier pool.

    python bench/broker.py [--samplers 1 8 64 256] [--per-push 1 8] [--seconds 8]
                           [--tasks add math_word]

Per (task, K, N): groups stored/s, groups scored/s (ready for the trainer), push latency
p50/p99, the trainer's pull and ack p99, and the verifier pool's utilisation. Targets
(2 cores, task add, N = 64): >= 2,000 groups/s, push p99 < 50 ms, pull/ack p99 < 50 ms.
The samplers are asyncio tasks in this process, the trainer runs in a process of its
own (as in a run); both share the machine's cores with the broker and its verifiers.
Writes bench/results/broker.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from broker_start import free_port, wait_healthy  # noqa: E402

from echorl.models.tokenizer import RunTokenizer  # noqa: E402
from echorl.tasks import get_task  # noqa: E402

TRAINER, ENROL = "t" * 32, "s" * 32
G, B = 8, 64
CODEC = RunTokenizer.builtin()


def start_broker(data: str, port: int, task: str, workers: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "echorl.cli", "broker", "--data-dir", data, "--port", str(port)]
    for o in (
        f"task.name={task}",
        "broker.mode=async",
        "broker.max_staleness=1000",  # admission never binds: ingest is what is measured
        f"train.batch_prompts={B}",
        f"train.group_size={G}",
        "sampling.max_new_tokens=256",
        f"verify.workers={workers}",
        "broker.max_leased_per_sampler=64",
        f"broker.trainer_token={TRAINER}",
        f"broker.sampler_token={ENROL}",
    ):
        args += ["-o", o]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(port, proc)
    return proc


def completions(task, rng: random.Random, n: int = 64) -> list[str]:
    """`n` plausible completions of 64-256 tokens that end in an answer, as JSON (built once:
    the simulated samplers spend their CPU on requests, not on making up text)."""
    out = []
    for _ in range(n):
        answer = str(rng.randint(0, 200))
        text = ("Let me think step by step. " * 10)[: rng.randint(60, 240)]
        text = f"{answer}\n{text}" if task.name != "math_word" else f"{text} \\boxed{{{answer}}}"
        ids = CODEC.encode(text)[:256]
        out.append(json.dumps({"token_ids": ids, "logprobs": [-0.7] * len(ids), "finished": True}))
    return out


class Stats:
    def __init__(self) -> None:
        self.push: list[float] = []
        self.pull: list[float] = []
        self.ack: list[float] = []
        self.stored = 0
        self.pulled = 0
        self.errors = 0
        self.empty = 0  # pulls that found nothing ready


async def sampler(
    url: str, task, stats: Stats, stop: asyncio.Event, k: int, pool, per_push: int
) -> None:
    rng = random.Random(k)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        reply = await http.post(
            "/v1/samplers",
            json={"name": f"bench-{k}", "tokenizer": CODEC.fingerprint, "task": task.name},
            headers={"Authorization": f"Bearer {ENROL}"},
        )
        me = reply.json()
        http.headers["Authorization"] = f"Bearer {me['credential']}"
        sid = me["sampler_id"]
        while not stop.is_set():
            r = await http.post(
                "/v1/jobs/lease", json={"sampler_id": sid, "n": max(4, per_push), "wait_s": 1}
            )
            jobs = r.json().get("jobs", [])
            for i in range(0, len(jobs), per_push):
                groups = [
                    f'{{"job_id":{job["job_id"]},"version":0,'
                    f'"prompt_ids":{json.dumps(job["prompt_ids"])},'
                    f'"completions":[{",".join(rng.choice(pool) for _ in range(G))}],'
                    f'"rewards":{json.dumps([0.0] * G)}}}'
                    for job in jobs[i : i + per_push]
                ]
                if per_push == 1:
                    path, body = "/v1/rollouts", f'{{"sampler_id":"{sid}","group":{groups[0]}}}'
                else:
                    path = "/v1/rollouts/batch"
                    body = f'{{"sampler_id":"{sid}","groups":[{",".join(groups)}]}}'
                t0 = time.perf_counter()
                r = await http.post(
                    path, content=body, headers={"Content-Type": "application/json"}
                )
                if stop.is_set():
                    break
                stats.push.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    stats.errors += len(groups)
                elif per_push == 1:
                    stats.stored += r.json()["stored"]
                    stats.errors += not r.json()["stored"]
                else:
                    stored = sum(x["stored"] for x in r.json()["results"])
                    stats.stored += stored
                    stats.errors += len(groups) - stored


async def trainer(url: str, stats: Stats, stop: asyncio.Event) -> None:
    headers = {"Authorization": f"Bearer {TRAINER}"}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await http.post("/v1/batches/pull", json={"n": B, "step": 0, "wait_s": 0.0})
            stats.pull.append(time.perf_counter() - t0)
            ids = [g["job_id"] for g in r.json()["groups"]]
            if not ids:
                stats.empty += 1
                await asyncio.sleep(0.01)
                continue
            t0 = time.perf_counter()
            await http.post("/v1/batches/ack", json={"job_ids": ids, "step": 0})
            stats.ack.append(time.perf_counter() - t0)
            stats.pulled += len(ids)


def trainer_process(url: str, begin, end, out) -> None:
    """The trainer in a process of its own, as in a run (its latencies are the broker's, not
    the samplers' event loop's); it pulls from the start and measures from `begin` to `end`
    (the samplers' window)."""

    async def main():
        stats, stop = Stats(), asyncio.Event()
        task = asyncio.create_task(trainer(url, stats, stop))
        await asyncio.to_thread(begin.wait)
        stats.__init__()
        await asyncio.to_thread(end.wait)
        stop.set()
        await task
        out.put(
            {"pull": stats.pull, "ack": stats.ack, "pulled": stats.pulled, "empty": stats.empty}
        )

    asyncio.run(main())


def p(xs: list[float], q: int) -> float:
    if len(xs) < 2:
        return xs[0] * 1000 if xs else float("nan")
    return statistics.quantiles(xs, n=100)[q - 1] * 1000


async def measure(url: str, task, n: int, seconds: float, per_push: int) -> dict:
    stats, stop = Stats(), asyncio.Event()
    pool = completions(task, random.Random(0))
    ctx = mp.get_context("spawn")
    results, begin, end = ctx.Queue(), ctx.Event(), ctx.Event()
    trainer_proc = ctx.Process(target=trainer_process, args=(url, begin, end, results))
    trainer_proc.start()
    tasks = [
        asyncio.create_task(sampler(url, task, stats, stop, k, pool, per_push)) for k in range(n)
    ]
    while stats.stored < 4 * n:  # warm-up: every sampler registered and pushing
        await asyncio.sleep(0.1)
    stats.__init__()
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TRAINER}"}) as h:
        before = (await h.get("/v1/status")).json()
        begin.set()
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        end.set()
        wall = time.perf_counter() - t0
        after = (await h.get("/v1/status")).json()
    trained = await asyncio.to_thread(results.get, True, 120)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    trainer_proc.join(30)
    stats.pull, stats.ack, stats.pulled = trained["pull"], trained["ack"], trained["pulled"]
    stats.empty = trained["empty"]

    def scored(st):
        return sum(v for k, v in st["rollouts"].items() if k != "scoring")

    return {
        "task": task.name,
        "samplers": n,
        "per_push": per_push,
        "stored_per_s": stats.stored / wall,
        "scored_per_s": (scored(after) - scored(before)) / wall,
        "pulled_per_s": stats.pulled / wall,
        "push_p50_ms": p(stats.push, 50),
        "push_p99_ms": p(stats.push, 99),
        "pull_p99_ms": p(stats.pull, 99),
        "pulls": len(stats.pull),
        "empty_pulls": stats.empty,
        "ack_p99_ms": p(stats.ack, 99),
        "verifier_busy": after["verifier_busy"],
        "refused": stats.errors,
    }


def run_one(task, n: int, per_push: int, args) -> dict:
    """One row: a fresh broker (its own data dir), v0 published, then the swarm."""
    with tempfile.TemporaryDirectory() as data:
        port = free_port()
        proc = start_broker(data, port, task.name, args.workers)
        try:
            url = f"http://127.0.0.1:{port}"
            blob = b"weights"
            headers = {
                "Authorization": f"Bearer {TRAINER}",
                "X-Sha256": hashlib.sha256(blob).hexdigest(),
            }
            httpx.put(f"{url}/v1/weights/0", content=blob, headers=headers).raise_for_status()
            return asyncio.run(measure(url, task, n, args.seconds, per_push))
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samplers", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument(
        "--per-push", type=int, nargs="+", default=[1], help="groups per push (>1: push-batch)"
    )
    ap.add_argument("--tasks", nargs="+", default=["add", "math_word"])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="verify.workers")
    ap.add_argument("--out", default="bench/results/broker.json")
    args = ap.parse_args()
    rows = []
    for name in args.tasks:
        task = get_task(name)
        for per_push in args.per_push:
            for n in args.samplers:
                rows.append(run_one(task, n, per_push, args))
                print(rows[-1], flush=True)
    table = Table(title=f"broker ingest ({os.cpu_count()} cores, G = {G})")
    cols = list(rows[0])
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()])
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cores": os.cpu_count(), "G": G, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
