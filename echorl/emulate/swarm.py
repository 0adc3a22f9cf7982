"""An emulated swarm against the real broker: hundreds of samplers and a trainer, as asyncio
tasks in one process, speaking the broker's real wire (register, heartbeat, lease, push,
ask for a source, pull, ack, audit, publish), on machines and links from `profiles.toml`.

What is emulated is time: a sampler's generation takes what its GPU's tokens/s says for the
tokens it "generates", a version's download what the link model (`links.py`) says for its
size, the trainer's step what its GPUs' tokens/s says; everything else is the broker's own
doing, in real time. `speedup` emulated seconds pass per real second, and a completion of L
tokens goes over the wire as L / `token_scale` tokens (the broker parses, stores, scores
and serves every group for real; it need not parse a million tokens a second to do so).
The groups answer the `add` task's prompts, right or wrong, so the broker's verifiers
score them for real and the trainer gets informative groups.

    from echorl.emulate.swarm import Scenario, emulate
    result = emulate(Scenario(samplers=64, mode="async", steps=20))
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import httpx

from echorl.emulate.links import Network, Node
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Took
from echorl.tasks import get_task

TRAINER, ENROL = "t" * 32, "s" * 32
MBIT = 1e6 / 8  # bytes/s
TASK = "add"


def profiles() -> dict:
    """The machines, links, trainer and churn the emulator draws from (with sources)."""
    return tomllib.loads(resources.files("echorl.emulate").joinpath("profiles.toml").read_text())


@dataclass
class Scenario:
    samplers: int = 64
    mode: str = "async"  # or "sync"
    model: str = "4b"  # or "8b"
    # Shares of the swarm: GPU classes and links (profiles.toml's names).
    gpus: dict[str, float] = field(
        default_factory=lambda: {
            "H100": 0.1,
            "A100": 0.2,
            "L40S": 0.2,
            "RTX4090": 0.3,
            "RTX3090": 0.2,
        }
    )
    links: dict[str, float] = field(
        default_factory=lambda: {"datacenter": 0.3, "fiber": 0.4, "cable": 0.3}
    )
    batch_prompts: int = 64
    group_size: int = 8
    mean_tokens: float = 1024.0  # completion length, lognormal with sigma 0.5
    token_scale: int = 64  # real tokens per token on the wire
    speedup: float = 10.0  # emulated seconds per real second
    steps: int = 20
    max_staleness: int = 1
    trainer_gpus: float = 8
    # Or: the trainer sized so that the swarm's tokens/s (its GPUs' profile figures,
    # summed) are this multiple of what it consumes (ECHO-2's provisioning ratio).
    capacity: float | None = None
    lease_s: float = 10.0  # emulated seconds of generation a lease asks for, about
    peer_fanout: int = 2  # 0: every sampler fetches from the broker
    deltas: bool = False  # versions as deltas to samplers holding the one before
    churn_per_hour: float = 0.0  # leaves and crashes per sampler per emulated hour
    hostile: float = 0.0  # share of samplers that lease and never push
    overprovision: float = 1.0  # sync: jobs out per version, a multiple of B
    seed: int = 0
    broker_overrides: list[str] = field(default_factory=list)

    model_bytes: float | None = None  # a version's size (default: the model's, bf16)

    def size(self) -> float:
        return self.model_bytes or profiles()["model"][f"bytes_{self.model}"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(sc: Scenario, data: Path, port: int) -> subprocess.Popen:
    """The real broker, unchanged, on loopback."""
    overrides = [
        f"task.name={TASK}",
        f"broker.mode={sc.mode}",
        f"broker.max_staleness={sc.max_staleness}",
        f"train.batch_prompts={sc.batch_prompts}",
        f"train.group_size={sc.group_size}",
        f"broker.peer_fanout={sc.peer_fanout}",
        f"broker.overprovision={sc.overprovision}",
        f"broker.max_samplers={max(256, 2 * sc.samplers)}",
        "broker.registrations_per_minute=0",
        "broker.sampler_calls_per_s=0",
        "broker.lease_by_speed=true",
        "sampling.max_new_tokens=4096",
        f"broker.trainer_token={TRAINER}",
        f"broker.sampler_token={ENROL}",
        "verify.workers=1",
        *sc.broker_overrides,
    ]
    args = [sys.executable, "-m", "echorl.cli", "broker", "--data-dir", str(data)]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    for o in overrides:
        args += ["-o", o]
    log = open(data.parent / "broker.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the broker exited: {(data.parent / 'broker.log').read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the broker did not answer /healthz in 120 s")


def weights_blob(version: int) -> bytes:
    """A version as the broker stores it: a tiny safetensors file (its emulated size is the
    scenario's), different for every version."""
    import torch
    from safetensors.torch import save

    return save({"w": torch.full((4,), float(version))})


class Swarm:
    """The emulated machines of one run, their wire clients, and what they measure."""

    def __init__(self, sc: Scenario, url: str, progress: bool = False):
        self.sc, self.url, self.progress = sc, url, progress
        self.prof = profiles()
        self.rng = random.Random(sc.seed)
        self.net = Network(sc.speedup)
        dc = self.prof["link"]["datacenter"]
        self.broker = Node("broker", dc["down_mbit"] * MBIT, dc["up_mbit"] * MBIT)
        self.trainer_node = Node("trainer", dc["down_mbit"] * MBIT, dc["up_mbit"] * MBIT)
        self.codec = RunTokenizer.builtin()
        self.task = get_task(TASK)
        self.http = httpx.AsyncClient(
            base_url=url,
            timeout=60,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
        )
        self.samplers: list[EmuSampler] = []
        self.by_url: dict[str, EmuSampler] = {}
        self.versions: dict[int, dict] = {}  # version -> {"sha256", "published"(emulated)}
        self.latest = -1
        self.stop = asyncio.Event()
        self.arrivals: dict[
            int, dict[str, float]
        ] = {}  # version -> sampler -> emulated s after publish
        self.calls: dict[str, list[float]] = {}  # route -> real seconds of each call
        self.refusals: dict[str, int] = {}  # "route status" -> how many (4xx, 5xx)
        self.reasons: dict[str, str] = {}  # "route status" -> the first reason
        self.generated_tokens = 0.0
        self.joined: list[asyncio.Future] = []  # samplers that joined during the run (churn)
        self.fetches: list[float] = []  # emulated seconds of each fetch and load
        self.real_size = len(weights_blob(0))

    async def call(self, method: str, path: str, token: str, route: str, **kw) -> httpx.Response:
        t0 = time.perf_counter()
        r = await self.http.request(
            method, path, headers={"Authorization": f"Bearer {token}"}, **kw
        )
        self.calls.setdefault(route, []).append(time.perf_counter() - t0)
        if r.status_code >= 400:
            key = f"{route} {r.status_code}"
            self.refusals[key] = self.refusals.get(key, 0) + 1
            self.reasons.setdefault(key, r.text[:200])
        return r

    def draw(self, shares: dict[str, float]) -> str:
        names = list(shares)
        return self.rng.choices(names, weights=[shares[n] for n in names])[0]

    def add_sampler(self, k: int, hostile: bool = False) -> EmuSampler:
        gpu, link = self.draw(self.sc.gpus), self.draw(self.sc.links)
        spec = self.prof["link"][link]
        node = Node(
            f"emu{k}",
            spec["down_mbit"] * MBIT,
            spec["up_mbit"] * MBIT,
            spec["rtt_ms"] / 1000,
            spec["loss"],
        )
        s = EmuSampler(self, k, gpu, link, node, hostile)
        self.samplers.append(s)
        if self.sc.peer_fanout:
            self.by_url[s.peer_url] = s
        return s


class EmuSampler:
    """One emulated sampler: the real sampler's calls, emulated generation and downloads."""

    def __init__(self, swarm: Swarm, k: int, gpu: str, link: str, node: Node, hostile: bool):
        self.swarm, self.k, self.gpu, self.link, self.node = swarm, k, gpu, link, node
        self.hostile = hostile
        gpus = swarm.prof["gpu"][gpu]
        self.tokens_per_s = gpus[f"tokens_per_s_{swarm.sc.model}"]
        self.price = gpus.get("price_per_hour")
        self.name = f"emu{k}-{gpu}-{link}"
        self.peer_url = f"http://127.0.0.1:{20000 + k}"
        self.id = self.token = ""
        self.held: int | None = None
        self.receiving: dict[int, object] = {}  # version -> the flow bringing it
        self.took: Took | None = None
        self.fetch_s: float | None = None
        self.alive = True
        self.pushed = self.leased = self.empty = 0  # groups pushed, jobs leased, empty leases
        self.spent = {"lease": 0.0, "fetch": 0.0, "generate": 0.0, "push": 0.0}  # emulated s
        self.beat_s = 2.0
        # Jobs a lease asks for: about 10 emulated seconds of generation at its speed.
        group_tokens = swarm.sc.group_size * swarm.sc.mean_tokens
        self.per_lease = max(1, min(64, round(self.tokens_per_s * swarm.sc.lease_s / group_tokens)))

    async def register(self) -> None:
        sw = self.swarm
        info = {
            "name": self.name,
            "hardware": self.gpu,
            "backend": "vllm",
            "max_batch": 256,
            "tokenizer": sw.codec.fingerprint,
            "task": sw.task.name,
            "cost_per_hour": self.price,
            "peer_url": self.peer_url if sw.sc.peer_fanout else None,
        }
        r = await sw.call("POST", "/v1/samplers", ENROL, "register", json=info)
        r.raise_for_status()
        reply = r.json()
        self.id, self.token, self.beat_s = (
            reply["sampler_id"],
            reply["credential"],
            reply["heartbeat_s"],
        )

    async def run(self) -> None:
        await self.register()
        beat = asyncio.create_task(self.beat())
        try:
            while not self.swarm.stop.is_set() and self.alive:
                await self.work()
        finally:
            beat.cancel()

    async def beat(self) -> None:
        sw = self.swarm
        while self.alive:
            await asyncio.sleep(self.beat_s)
            body = {"version_held": self.held, "fetch_s": self.fetch_s}
            self.fetch_s = None
            if self.held is not None:
                body["sha256_held"] = sw.versions[self.held]["sha256"]
            with contextlib.suppress(httpx.HTTPError):
                await sw.call(
                    "POST", f"/v1/samplers/{self.id}/heartbeat", self.token, "heartbeat", json=body
                )

    async def work(self) -> None:
        sw, sc = self.swarm, self.swarm.sc
        body = {
            "sampler_id": self.id,
            "n": self.per_lease,
            "wait_s": 5.0,
            "version_held": self.held,
        }
        if self.held is not None:
            body["sha256_held"] = sw.versions[self.held]["sha256"]
        t0 = sw.net.now()
        r = await sw.call("POST", "/v1/jobs/lease", self.token, "lease", json=body)
        self.spent["lease"] += sw.net.now() - t0
        if r.status_code >= 400:
            await asyncio.sleep(1.0)
            return
        reply = r.json()
        jobs = reply["jobs"]
        latest = reply["latest_version"]
        want = max([latest, *[j["required_version"] or 0 for j in jobs]]) if jobs else latest
        if want >= 0 and (self.held is None or self.held < want) and want in sw.versions:
            t0 = sw.net.now()
            await self.fetch(want)
            self.spent["fetch"] += sw.net.now() - t0
        if not jobs:
            self.empty += 1
            return
        self.leased += len(jobs)
        if self.hostile:
            return  # it holds them and never pushes: its leases lapse
        lengths = [
            [
                max(1.0, sw.rng.lognormvariate(math.log(sc.mean_tokens), 0.5))
                for _ in range(sc.group_size)
            ]
            for _ in jobs
        ]
        tokens = sum(map(sum, lengths))
        await sw.net.sleep(tokens / self.tokens_per_s)
        self.spent["generate"] += tokens / self.tokens_per_s
        if not self.alive or self.held is None:
            return
        sw.generated_tokens += tokens
        groups = [self.group(j, ls) for j, ls in zip(jobs, lengths)]
        t0 = sw.net.now()
        r = await sw.call(
            "POST",
            "/v1/rollouts/batch",
            self.token,
            "push",
            json={"sampler_id": self.id, "groups": groups},
        )
        self.spent["push"] += sw.net.now() - t0
        if r.status_code < 400:
            self.pushed += sum(x["stored"] for x in r.json()["results"])

    def group(self, job: dict, lengths: list[float]) -> dict:
        """A group for `job` at the version held: each completion the right answer (half of
        them, about) or a wrong one, padded to its length on the wire."""
        sw = self.swarm
        answer = sw.task.problem(job["seed"]).answer
        completions = []
        for length in lengths:
            text = answer if sw.rng.random() < 0.5 else str(sw.rng.randint(0, 999))
            ids = sw.codec.encode(text + "\n")
            n = max(len(ids), round(length / sw.sc.token_scale))
            ids = (ids + sw.codec.encode("." * n))[:n]
            completions.append({"token_ids": ids, "logprobs": [-0.5] * n, "finished": True})
        return {
            "job_id": job["job_id"],
            "version": self.held,
            "prompt_ids": job["prompt_ids"],
            "completions": completions,
            "rewards": [0.0] * len(completions),
        }

    async def fetch(self, version: int) -> None:
        """`version` from where the broker says (a peer passes on what it receives), or as a
        delta from the broker; then loaded; told with the next beat."""
        sw, sc = self.swarm, self.swarm.sc
        t0 = sw.net.now()
        size = sc.size()
        if sc.deltas and self.held == version - 1:
            await sw.net.transfer(sw.broker, self.node, size * sw.prof["model"]["delta_fraction"])
        else:
            failed = None
            for _ in range(3):
                body = {"failed": failed, "took": self.took.model_dump() if self.took else None}
                r = await sw.call(
                    "POST", f"/v1/versions/{version}/source", self.token, "source", json=body
                )
                if r.status_code >= 400:
                    await asyncio.sleep(0.5)
                    continue
                url = r.json()["url"]
                peer = sw.by_url.get(url) if url else None
                source, after = (
                    (sw.broker, None) if peer is None else (peer.node, peer.receiving.get(version))
                )
                t_src = sw.net.now()
                try:
                    flow = await sw.net.start(source, self.node, size, after=after)
                    self.receiving[version] = flow  # what its own takers wait on
                    await sw.net.finish(flow)
                except ConnectionError:
                    failed = url
                    continue
                finally:
                    self.receiving.pop(version, None)
                seconds = (sw.net.now() - t_src) / sc.speedup
                self.took = Took(version=version, seconds=max(seconds, 1e-3))
                break
            else:
                await sw.net.transfer(sw.broker, self.node, size)
        await sw.net.sleep(size / 1e9 * sw.prof["model"]["load_s_per_gb"])
        self.held = version
        self.fetch_s = (sw.net.now() - t0) / sc.speedup
        sw.fetches.append(sw.net.now() - t0)
        arrived = sw.arrivals.setdefault(version, {})
        arrived[self.id] = sw.net.now() - sw.versions[version]["published"]

    def crash(self) -> None:
        self.alive = False
        self.swarm.net.cut(self.node, ConnectionError(f"{self.name} crashed"))


class EmuTrainer:
    """The trainer: pulls B groups (the next batch while it trains, in async), trains for
    what its GPUs' tokens/s says, acks, audits, and publishes the next version (uploaded
    over its link while the next step trains)."""

    def __init__(self, swarm: Swarm):
        self.swarm = swarm
        sc, prof = swarm.sc, swarm.prof
        self.rate = prof["trainer"][f"tokens_per_s_per_gpu_{sc.model}"] * sc.trainer_gpus
        if sc.capacity:
            self.rate = sum(s.tokens_per_s for s in swarm.samplers if not s.hostile) / sc.capacity
        self.steps: list[dict] = []
        self.consumed: dict[int, int] = {}  # job id -> times consumed
        self.staleness: list[int] = []
        self.busy = 0.0

    async def pull(self, step: int) -> tuple[list[dict], float]:
        """B groups for `step` (sync: of version `step`); the emulated seconds waited."""
        sw, sc = self.swarm, self.swarm.sc
        t0, groups, held = sw.net.now(), [], set()
        while len(groups) < sc.batch_prompts and not sw.stop.is_set():
            body = {"n": sc.batch_prompts - len(groups), "step": step, "wait_s": 2.0}
            r = await sw.call("POST", "/v1/batches/pull", TRAINER, "pull", json=body)
            r.raise_for_status()
            fresh = [g for g in r.json()["groups"] if g["job_id"] not in held]
            held |= {g["job_id"] for g in fresh}
            groups += fresh
        return groups, sw.net.now() - t0

    async def publish(self, version: int) -> None:
        sw = self.swarm
        await sw.net.transfer(sw.trainer_node, sw.broker, sw.sc.size())
        blob = weights_blob(version)
        sha = hashlib.sha256(blob).hexdigest()
        r = await sw.http.put(
            f"/v1/weights/{version}",
            content=blob,
            headers={"Authorization": f"Bearer {TRAINER}", "X-Sha256": sha},
        )
        r.raise_for_status()
        sw.versions[version] = {"sha256": sha, "published": sw.net.now()}
        sw.latest = version

    async def run(self) -> None:
        sw, sc = self.swarm, self.swarm.sc
        hello = {
            "tokenizer": sw.codec.fingerprint,
            "task": sw.task.name,
            "batch_prompts": sc.batch_prompts,
            "group_size": sc.group_size,
        }
        (
            await sw.call("POST", "/v1/trainer/hello", TRAINER, "hello", json=hello)
        ).raise_for_status()
        await self.publish(0)
        t_start = sw.net.now()
        upload = None
        ahead = asyncio.ensure_future(self.pull(0))
        for step in range(sc.steps):
            groups, waited = await ahead
            if sw.stop.is_set():
                return
            tokens = sum(len(c["token_ids"]) for g in groups for c in g["completions"])
            compute = tokens * sc.token_scale / self.rate
            if sc.mode == "async":  # the next batch is pulled while this one trains
                ahead = asyncio.ensure_future(self.pull(step + 1))
            await sw.net.sleep(compute)
            self.busy += compute
            ids = [g["job_id"] for g in groups]
            for g in groups:
                self.consumed[g["job_id"]] = self.consumed.get(g["job_id"], 0) + 1
                self.staleness.append(step - g["version"])
            ack = {"job_ids": ids, "step": step, "train_s": compute / sc.speedup, "tokens": tokens}
            (await sw.call("POST", "/v1/batches/ack", TRAINER, "ack", json=ack)).raise_for_status()
            audits = [
                {
                    "job_id": g["job_id"],
                    "tokens": sum(len(c["token_ids"]) for c in g["completions"]),
                    "abs_delta": 0.0,
                    "kl": 0.0,
                    "beyond": 0,
                    "exact": True,
                }
                for g in groups
            ]
            await sw.call(
                "POST", "/v1/trainer/audit", TRAINER, "audit", json={"step": step, "groups": audits}
            )
            if upload is not None:
                await upload  # one upload at a time, as the trainer's I/O process
            upload = asyncio.ensure_future(self.publish(step + 1))
            if sc.mode == "sync":
                await upload
                ahead = asyncio.ensure_future(self.pull(step + 1))
            if self.swarm.progress:
                print(
                    f"step {step}: waited {waited:.1f} s, trained {compute:.1f} s (emulated)",
                    file=sys.stderr,
                    flush=True,
                )
            self.steps.append(
                {
                    "step": step,
                    "t": sw.net.now() - t_start,
                    "waited": waited,
                    "compute": compute,
                    "tokens": tokens * sc.token_scale,
                }
            )
        if upload is not None:
            await upload
        ahead.cancel()


def probe_healthz(url: str, stop, out) -> None:
    """A process of its own: GET /healthz every 100 ms, each latency in ms (what a
    load balancer or a new sampler would meet)."""
    times = []
    with httpx.Client(timeout=10) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            with contextlib.suppress(httpx.HTTPError):
                http.get(url + "/healthz")
            times.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.1)
    out.put(times)


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process `pid` and its children (Linux /proc)."""
    total = 0.0
    todo = [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                todo += [int(c) for c in children]
    return total


def p99(xs: list[float]) -> float | None:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else (xs[0] if xs else None)


async def _emulate(sc: Scenario, url: str, broker_pid: int, progress: bool) -> dict:
    sw = Swarm(sc, url, progress)
    n_hostile = round(sc.hostile * sc.samplers)
    hostile = set(sw.rng.sample(range(sc.samplers), n_hostile))
    for k in range(sc.samplers):
        sw.add_sampler(k, hostile=k in hostile)
    trainer = EmuTrainer(sw)
    tasks = [asyncio.ensure_future(s.run()) for s in sw.samplers]
    churn = asyncio.ensure_future(_churn(sw)) if sc.churn_per_hour else None
    cpu0, t0 = cpu_seconds(broker_pid), time.perf_counter()
    try:
        await trainer.run()
    finally:
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(broker_pid) - cpu0
        sw.stop.set()
        if churn is not None:
            churn.cancel()
        tasks += sw.joined
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    status = (
        await sw.call("GET", "/v1/status", TRAINER, "status", params={"limit": 100000})
    ).json()
    await sw.http.aclose()
    return summarise(sc, sw, trainer, status, wall, cpu)


async def _churn(sw: Swarm) -> None:
    """Samplers leave (half cleanly, half crashing) at the scenario's rate; each is replaced
    by a fresh one (the swarm's size holds, its members change)."""
    sc = sw.sc
    rate = sc.churn_per_hour * sc.samplers / 3600  # departures per emulated second
    crash_share = sw.prof["churn"]["crash_share"]
    while True:
        await sw.net.sleep(sw.rng.expovariate(rate))
        alive = [s for s in sw.samplers if s.alive and s.id]
        if not alive:
            continue
        gone = sw.rng.choice(alive)
        if sw.rng.random() < crash_share:
            gone.crash()
        else:
            gone.alive = False
            sw.net.cut(gone.node, ConnectionError(f"{gone.name} left"))
            with contextlib.suppress(httpx.HTTPError):
                await sw.call("POST", f"/v1/samplers/{gone.id}/leave", gone.token, "leave")
        fresh = sw.add_sampler(len(sw.samplers))
        sw.joined.append(asyncio.ensure_future(fresh.run()))


def predicted_wait(sc: Scenario, sw: Swarm, steady: list, fetches: list) -> float | None:
    """The trainer's wait per step that ECHO-2's provisioning rule (broker/capacity.py)
    predicts, in emulated seconds: a step's groups take the swarm step_tokens / its tokens/s
    to make, after a version's spread (the median fetch); up to max_staleness + 1 steps of
    training hide both (async; none in sync); what they do not hide, the trainer waits."""
    if not steady or not fetches:
        return None
    tokens = statistics.mean(s["tokens"] for s in steady)
    swarm = sum(s.tokens_per_s for s in sw.samplers if not s.hostile)
    compute = statistics.mean(s["compute"] for s in steady)
    hidden = (sc.max_staleness + 1) * compute if sc.mode == "async" else 0.0
    return max(0.0, statistics.median(fetches) + tokens / swarm - hidden)


def summarise(
    sc: Scenario, sw: Swarm, trainer: EmuTrainer, status: dict, wall: float, cpu: float
) -> dict:
    steps = trainer.steps
    fetches = sw.fetches
    span = steps[-1]["t"] if steps else 0.0
    steady = steps[len(steps) // 4 :] or steps
    t_steady = (steady[-1]["t"] - steady[0]["t"] + steady[0]["compute"]) if steady else 0.0
    busy = sum(s["compute"] for s in steady)
    pushed = sum(s["pushed_tokens"] for s in status["samplers"])
    consumed = sum(s["consumed_tokens"] for s in status["samplers"])
    complete = {}
    for v, arrived in sw.arrivals.items():
        holders = len(arrived)
        if holders >= 0.95 * len([s for s in sw.samplers if s.alive and not s.hostile]):
            complete[v] = max(arrived.values())
    return {
        "scenario": asdict(sc),
        "steps": len(steps),
        "emulated_s": span,
        "real_s": wall,
        "steps_per_emulated_min": 60 * len(steps) / span if span else 0.0,
        "trainer_util": busy / t_steady if t_steady else 0.0,
        "swarm_tokens_per_s": sum(s.tokens_per_s for s in sw.samplers if not s.hostile),
        "trainer_tokens_per_s": trainer.rate,
        "trainer_wait_s": statistics.mean(s["waited"] for s in steady) if steady else None,
        "step_compute_s": statistics.mean(s["compute"] for s in steady) if steady else None,
        "staleness": {str(k): trainer.staleness.count(k) for k in sorted(set(trainer.staleness))},
        "staleness_max": max(trainer.staleness, default=0),
        "consumed_twice": sum(1 for n in trainer.consumed.values() if n > 1),
        "groups_consumed": sum(trainer.consumed.values()),
        "wasted_token_share": 1 - consumed / pushed if pushed else 0.0,
        "version_spread_s": statistics.median(complete.values()) if complete else None,
        "fetch_s_median": statistics.median(fetches) if fetches else None,
        "predicted_wait_s": predicted_wait(sc, sw, steady, fetches),
        "broker_cpu_share": cpu / wall if wall else 0.0,
        "broker_calls_p99_ms": {k: 1000 * p99(v) for k, v in sw.calls.items() if v},
        "capacity": status.get("capacity"),
        "samplers_alive": status["sampler_counts"].get("alive", 0),
        # Where the samplers' emulated time went (shares of all of it), and empty leases.
        "sampler_time": {
            k: sum(s.spent[k] for s in sw.samplers) / max(1e-9, span * len(sw.samplers))
            for k in ("lease", "fetch", "generate", "push")
        },
        "empty_leases": sum(s.empty for s in sw.samplers),
        "refusals": sw.refusals,
        "refusal_reasons": sw.reasons,
        "steps_log": steps,
    }


def emulate(sc: Scenario, workdir: str | Path | None = None, progress: bool = False) -> dict:
    """Run scenario `sc` against a real broker started for it; the figures (see
    `summarise`) with /healthz's p99 while it ran."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        port = free_port()
        broker = start_broker(sc, Path(tmp) / "broker", port)
        url = f"http://127.0.0.1:{port}"
        stop, out = mp.Event(), mp.Queue()
        probe = mp.Process(target=probe_healthz, args=(url, stop, out), daemon=True)
        probe.start()
        try:
            result = asyncio.run(_emulate(sc, url, broker.pid, progress))
        finally:
            stop.set()
            times = out.get(timeout=30) if probe.is_alive() or not out.empty() else []
            probe.join(timeout=10)
            broker.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                broker.wait(timeout=30)
            if broker.poll() is None:
                broker.kill()
        result["healthz_p99_ms"] = p99(times)
        return result


if __name__ == "__main__":  # a quick look: python -m echorl.emulate.swarm [K] [mode]
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    mode = sys.argv[2] if len(sys.argv) > 2 else "async"
    r = emulate(Scenario(samplers=k, mode=mode, steps=10))
    r.pop("steps_log")
    print(json.dumps(r, indent=1))
