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
import collections
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

from echorl.client import CHUNK, PEER_CHECK_S
from echorl.emulate.links import Flow, Network, Node
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Took
from echorl.rollout.peers import PEER_TRIES
from echorl.tasks import get_task

TRAINER, ENROL = "t" * 32, "s" * 32
MBIT = 1e6 / 8  # bytes/s
FREE = 1e13  # bytes/s: a link that costs nothing
# A real sampler passes on what arrives in the pieces it writes them to its shelf in: from
# the broker the client's CHUNK (httpx's iter_bytes), from a peer each socket read (raw:
# httpcore reads 64 KiB at a time).
PEER_READ = 64 << 10
HOSTILE_UP = 1e3  # bytes/s a hostile sampler serves its peers at
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
    # Cost-aware activation (broker.activation): "all", or "cheapest" with its margin and
    # hold (the broker's clock: real seconds).
    activation: str = "all"
    activation_margin: float = 0.2
    activation_hold_s: float = 5.0
    only: list[int] | None = None  # the samplers (by index of the drawn swarm) that run
    seed: int = 0
    broker_overrides: list[str] = field(default_factory=list)

    model_bytes: float | None = None  # a version's size (default: the model's, bf16)
    progress_every: bool = False  # print as it goes
    # Calibrated machines instead of drawn ones (bench/emulate_check.py: a real run's
    # measured samplers): each {"tokens_per_s", "fetch_s"} (a version's download and load
    # in emulated seconds), on links that cost nothing.
    machines: list[dict] | None = None
    jobs_per_lease: int | None = None  # fixed; default: about lease_s of generation
    lease_wait_s: float = 5.0  # the lease's long poll
    broker_mbit: float | None = None  # the broker's uplink (default: a datacentre's)
    delta_fraction: float | None = None  # a delta's size, of the full (default: profile's)
    load_s_per_gb: float | None = None  # a version's load (default: the profile's)
    length_sigma: float = 0.5  # completion lengths: lognormal around mean_tokens
    trainer_step_s: float | None = None  # fixed compute a step (default: from tokens/s)
    trainer_overhead_s: float = 0.0  # a step's own work beside compute (metrics, publish)

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
        f"broker.activation={sc.activation}",
        f"broker.activation_margin={sc.activation_margin}",
        f"broker.activation_hold_s={sc.activation_hold_s}",
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
        up = (sc.broker_mbit or dc["up_mbit"]) * MBIT
        self.broker = Node("broker", dc["down_mbit"] * MBIT, up)
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
        self.trail: list[tuple] = []  # (version, sampler, its source, emulated time named)
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
        if self.sc.machines:
            m = self.sc.machines[k % len(self.sc.machines)]
            node = Node(
                f"emu{k}",
                m.get("down_mbit", math.inf) * MBIT,
                m.get("up_mbit", math.inf) * MBIT,
                m.get("rtt_ms", 0.0) / 1000,
            )
            node.down, node.up = min(node.down, FREE), min(node.up, FREE)
            s = EmuSampler(self, k, m.get("name", "measured"), "given", node, hostile)
            s.tokens_per_s, s.fetch_fixed = m.get("tokens_per_s", 0.0), m.get("fetch_s")
            s.overhead_s = m.get("overhead_s", 0.0)
            s.per_lease = self.sc.jobs_per_lease or s.per_lease
            self.samplers.append(s)
            if self.sc.peer_fanout:
                self.by_url[s.peer_url] = s
            return s
        gpu, link = self.draw(self.sc.gpus), self.draw(self.sc.links)
        spec = self.prof["link"][link]
        node = Node(
            f"emu{k}",
            spec["down_mbit"] * MBIT,
            spec["up_mbit"] * MBIT,
            spec["rtt_ms"] / 1000,
            spec["loss"],
        )
        if hostile:  # as a peer it trickles: its takers must leave it (min_rate) or wait
            node.up = HOSTILE_UP
        s = EmuSampler(self, k, gpu, link, node, hostile)
        s.per_lease = self.sc.jobs_per_lease or s.per_lease
        self.samplers.append(s)
        if self.sc.peer_fanout:
            self.by_url[s.peer_url] = s
        return s


class EmuSampler:
    """One emulated sampler: the real sampler's calls, emulated generation and downloads."""

    def __init__(self, swarm: Swarm, k: int, gpu: str, link: str, node: Node, hostile: bool):
        self.swarm, self.k, self.gpu, self.link, self.node = swarm, k, gpu, link, node
        self.hostile = hostile
        gpus = swarm.prof["gpu"].get(gpu, {})
        self.tokens_per_s = gpus.get(f"tokens_per_s_{swarm.sc.model}", 0.0)
        self.price = gpus.get("price_per_hour")
        self.fetch_fixed: float | None = None  # a calibrated machine's fetch and load
        self.overhead_s = 0.0  # and its time a lease beside generating, fetching and waiting
        self.name = f"emu{k}-{gpu}-{link}"
        self.peer_url = f"http://127.0.0.1:{20000 + k}"
        self.id = self.token = ""
        self.held: int | None = None
        self.receiving: dict[int, object] = {}  # version -> the flow bringing it
        self.took: Took | None = None
        # What it passed on: [version, start, end (None: still going), the flow], recent ones
        self.served: collections.deque[list] = collections.deque(maxlen=64)
        self.fetch_s: float | None = None
        self.alive = True
        self.joined, self.gone = swarm.net.now(), None  # emulated s
        self.parked: list[list] = []  # [from, until (None: still)], emulated s
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
            "wait_s": sc.lease_wait_s,
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
        self.park(reply.get("parked", False))
        if not jobs:  # as the real sampler: idle or parked, it fetches nothing
            self.empty += 1
            return
        want = max([latest, *[j["required_version"] or 0 for j in jobs]])
        if want >= 0 and (self.held is None or self.held < want) and want in sw.versions:
            t0 = sw.net.now()
            await self.fetch(want)
            self.spent["fetch"] += sw.net.now() - t0
        self.leased += len(jobs)
        if self.hostile:
            return  # it holds them and never pushes: its leases lapse
        lengths = [
            [
                max(1.0, sw.rng.lognormvariate(math.log(sc.mean_tokens), sc.length_sigma))
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
        if self.overhead_s:  # a calibrated machine's own work a lease, beside its push
            await sw.net.sleep(self.overhead_s - (sw.net.now() - t0))

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
        if self.fetch_fixed is not None:
            await sw.net.sleep(self.fetch_fixed)
        elif sc.deltas and self.held == version - 1:
            share = sc.delta_fraction or sw.prof["model"]["delta_fraction"]
            await sw.net.transfer(sw.broker, self.node, size * share)
        else:
            await self.obtain(version, size)
        if self.fetch_fixed is None:
            per_gb = sc.load_s_per_gb
            per_gb = sw.prof["model"]["load_s_per_gb"] if per_gb is None else per_gb
            await sw.net.sleep(size / 1e9 * per_gb)
        self.held = version
        self.fetch_s = (sw.net.now() - t0) / sc.speedup
        sw.fetches.append(sw.net.now() - t0)
        arrived = sw.arrivals.setdefault(version, {})
        arrived[self.id] = sw.net.now() - sw.versions[version]["published"]

    async def obtain(self, version: int, size: float) -> None:
        """As the real sampler's `peers.obtain`: from the source the broker names, up to
        PEER_TRIES peers, each failure reported with the next ask; from the broker once it
        names itself, a peer is under its `min_rate` after PEER_CHECK_S (left, unreported),
        or they all failed. The time taken is told with the next ask, in the broker's bytes
        (the stored blob is tiny: seconds scaled so the rate it sees is the emulated one).
        As the real sampler's shelf, what is arriving can be passed on from the start, before
        its source is known (a taker gets nothing until it is)."""
        sw = self.swarm
        failed, t_src = None, sw.net.now()
        for _ in range(PEER_TRIES):
            self.receiving[version] = flow = sw.net.open(None, self.node, size)
            took = self.took
            if took is not None and self.held is not None:
                took = took.model_copy(update={"served": self.served_rate(self.held)})
            body = {"failed": failed, "took": took.model_dump() if took else None}
            self.took = None
            r = await sw.call(
                "POST", f"/v1/versions/{version}/source", self.token, "source", json=body
            )
            if r.status_code >= 400:
                break
            named = r.json()
            peer = sw.by_url.get(named["url"]) if named["url"] else None
            if peer is None:
                break
            sw.trail.append((version, self.name, peer.name, sw.net.now()))
            try:
                if await self.pull(flow, peer, version, named.get("min_rate") or 0.0):
                    self.told(version, t_src, size)
                    return
                break  # too slow: the broker, unreported
            except ConnectionError:
                failed, t_src = named["url"], sw.net.now()
                sw.trail.append((version, self.name, "failed " + peer.name, t_src))
        sw.trail.append((version, self.name, "broker", sw.net.now()))
        if version not in self.receiving:
            self.receiving[version] = flow = sw.net.open(None, self.node, size)
        await self.pull(flow, None, version, 0.0)
        self.told(version, t_src, size)

    async def pull(self, flow: Flow, peer: EmuSampler | None, version: int, min_rate: float):
        """`flow` (this sampler's arrival of `version`) from `peer` (None: the broker);
        False if the peer was left as under `min_rate` (emulated bytes/s) after
        PEER_CHECK_S. Its own takers follow the bytes as they arrive (in CHUNK pieces from
        the broker, PEER_READ from a peer)."""
        sw = self.swarm
        if peer is None:
            flow.source = sw.broker
        else:
            flow.source, flow.after = peer.node, peer.receiving.get(version)
        flow.grain = CHUNK if peer is None else PEER_READ
        t0 = sw.net.now()
        served = None
        try:
            await sw.net.start(flow)
            if peer is not None:
                served = [version, sw.net.now(), None, flow]
                peer.served.append(served)
            done = asyncio.ensure_future(sw.net.finish(flow))
            if peer is not None and min_rate:
                await asyncio.wait([done], timeout=PEER_CHECK_S / sw.sc.speedup)
                if not done.done():
                    got = sw.net.arrived(flow)
                    if got < min_rate * (sw.net.now() - t0) and got < flow.size:
                        done.cancel()
                        sw.net.drop(flow, ConnectionError(f"{self.name} left its source"))
                        sw.trail.append((version, self.name, "left " + peer.name, sw.net.now()))
                        return False
            await done
            return True
        finally:
            self.receiving.pop(version, None)
            if served is not None:
                served[2] = sw.net.now()

    def told(self, version: int, t0: float, size: float) -> None:
        """The Took for the next ask: emulated seconds, scaled to the broker's blob size (the
        rate the broker sees is the emulated one)."""
        scale = self.swarm.real_size / size
        self.took = Took(version=version, seconds=max((self.swarm.net.now() - t0) * scale, 1e-9))

    def served_rate(self, version: int) -> float | None:
        """As the real shelf's: emulated bytes/s `version` went out to peers while any was
        reading, all of them together; None: it went to nobody."""
        sent = [(start, end, flow) for v, start, end, flow in self.served if v == version]
        if not sent:
            return None
        now = self.swarm.net.now()
        busy = max(now if end is None else end for _, end, _ in sent) - min(s for s, _, _ in sent)
        moved = sum(self.swarm.net.arrived(f) for _, _, f in sent)
        return moved / busy if moved and busy > 0 else None

    def park(self, parked: bool) -> None:
        """The broker parked (or woke) this sampler: parked time costs nothing."""
        now = self.swarm.net.now()
        if parked and not (self.parked and self.parked[-1][1] is None):
            self.parked.append([now, None])
        elif not parked and self.parked and self.parked[-1][1] is None:
            self.parked[-1][1] = now

    def parked_s(self, start: float, end: float) -> float:
        """Emulated seconds of [start, end] it was parked."""
        return sum(_overlap(a, end if b is None else b, start, end) for a, b in self.parked)

    def active_s(self, start: float, end: float) -> float:
        """Emulated seconds of [start, end] it was registered and not parked."""
        gone = end if self.gone is None else self.gone
        return _overlap(self.joined, gone, start, end) - self.parked_s(start, end)

    def cost(self, start: float, end: float) -> float:
        """What it cost from `start` to `end` (emulated s): its price for the time it was
        registered and not parked."""
        return (self.price or 0.0) * self.active_s(start, end) / 3600

    def crash(self) -> None:
        self.alive, self.gone = False, self.swarm.net.now()
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
        self.t0 = 0.0  # emulated time of its first pull

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

    async def hello(self) -> None:
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

    async def run(self) -> None:
        sw, sc = self.swarm, self.swarm.sc
        await self.hello()
        await self.publish(0)
        t_start = self.t0 = sw.net.now()
        upload = None
        ahead = asyncio.ensure_future(self.pull(0))
        for step in range(sc.steps):
            t_wait = sw.net.now()
            groups, _ = await ahead
            waited = sw.net.now() - t_wait  # what the prefetch (async) left to wait
            if sw.stop.is_set():
                return
            tokens = sum(len(c["token_ids"]) for g in groups for c in g["completions"])
            compute = sc.trainer_step_s or tokens * sc.token_scale / self.rate
            if sc.mode == "async":  # the next batch is pulled while this one trains
                ahead = asyncio.ensure_future(self.pull(step + 1))
            await sw.net.sleep(compute)
            self.busy += compute
            t_books = sw.net.now()
            ids = [g["job_id"] for g in groups]
            for g in groups:
                self.consumed[g["job_id"]] = self.consumed.get(g["job_id"], 0) + 1
                self.staleness.append(step - g["version"])
            ack = {"job_ids": ids, "step": step, "train_s": compute / sc.speedup, "tokens": tokens}
            ack["idle_s"] = waited / sc.speedup
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
            if sc.trainer_overhead_s:  # a calibrated trainer's own work a step, beside these
                await sw.net.sleep(sc.trainer_overhead_s - (sw.net.now() - t_books))
            if upload is not None:
                await upload  # one upload at a time, as the trainer's I/O process
            upload = asyncio.ensure_future(self.publish(step + 1))
            if sc.mode == "sync":  # asked for at once: the wait includes the upload
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


def _overlap(a: float, b: float, start: float, end: float) -> float:
    return max(0.0, min(b, end) - max(a, start))


def p99(xs: list[float]) -> float | None:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else (xs[0] if xs else None)


async def _emulate(sc: Scenario, url: str, broker_pid: int, progress: bool) -> dict:
    sw = Swarm(sc, url, progress)
    n_hostile = round(sc.hostile * sc.samplers)
    hostile = set(sw.rng.sample(range(sc.samplers), n_hostile))
    for k in range(sc.samplers):
        sw.add_sampler(k, hostile=k in hostile)
    trainer = EmuTrainer(sw)  # sized to the whole drawn swarm, whichever of it runs
    for s in sw.samplers:
        if sc.only is not None and s.k not in sc.only:
            s.alive, s.gone = False, s.joined
    tasks = [asyncio.ensure_future(s.run()) for s in sw.samplers if s.alive]
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
            gone.alive, gone.gone = False, sw.net.now()
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
        # What the priced samplers cost (registered and not parked), per trainer step.
        "cost_per_step": sum(s.cost(trainer.t0, trainer.t0 + span) for s in sw.samplers)
        / max(1, len(steps)),
        # ... over the run's second half (a policy that adapts has settled by then)
        "cost_per_step_late": sum(
            s.cost(trainer.t0 + steps[len(steps) // 2]["t"], trainer.t0 + span) for s in sw.samplers
        )
        / max(1, len(steps) - len(steps) // 2 - 1)
        if len(steps) > 2
        else None,
        "active_samplers_mean": sum(s.active_s(trainer.t0, trainer.t0 + span) for s in sw.samplers)
        / max(span, 1e-9),
        "parks": sum(len(s.parked) for s in sw.samplers),
        "machines": [
            {
                "k": s.k,
                "gpu": s.gpu,
                "link": s.link,
                "tokens_per_s": s.tokens_per_s,
                "price": s.price,
                "hostile": s.hostile,
                "parked_s": s.parked_s(trainer.t0, trainer.t0 + span),
            }
            for s in sw.samplers
        ],  # fmt: skip
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


async def _spread(sc: Scenario, url: str, versions: int) -> dict:
    """Versions 0..`versions` published one at a time, every sampler told to fetch each at
    once (v0 not timed: every sampler fetches it whole first); the emulated seconds until
    the last honest one holds each (hostile samplers, `sc.hostile`, fetch too, and serve
    their takers at a trickle), against the lower bound: every sampler takes the bytes
    over its own downlink, and the broker sends them at least once."""
    sw = Swarm(sc, url)
    hostile = set(sw.rng.sample(range(sc.samplers), round(sc.hostile * sc.samplers)))
    for k in range(sc.samplers):
        sw.add_sampler(k, hostile=k in hostile)
    trainer = EmuTrainer(sw)
    await trainer.hello()
    await asyncio.gather(*(s.register() for s in sw.samplers))
    beats = [asyncio.ensure_future(s.beat()) for s in sw.samplers]
    honest = [s for s in sw.samplers if not s.hostile]
    times = []
    try:
        for v in range(versions + 1):
            await trainer.publish(v)
            t0 = sw.net.now()
            others = [asyncio.ensure_future(s.fetch(v)) for s in sw.samplers if s.hostile]
            await asyncio.gather(*(s.fetch(v) for s in honest))
            if v:
                times.append(sw.net.now() - t0)
            await asyncio.gather(*others)
            if sc.progress_every and v:
                print(f"version {v}: {times[-1]:.1f} emulated s to all", file=sys.stderr)
    finally:
        for s in sw.samplers:
            s.alive = False
        for b in beats:
            b.cancel()
        await asyncio.gather(*beats, return_exceptions=True)
        await sw.http.aclose()
    named = collections.Counter(
        "broker" if src == "broker" else src.split()[0] if " " in src else "peer"
        for _, _, src, _ in sw.trail
    )
    return {
        "seconds_per_version": times,
        "seconds_to_all": statistics.mean(times),
        "lower_bound_s": sc.size() / min(sw.broker.up, *(s.node.down for s in honest)),
        "sources": dict(named),  # named: broker / peer; failed / left: peers given up
        "trail": sw.trail,
        "refusals": sw.refusals,
    }


def spread(sc: Scenario, versions: int = 2, workdir: str | Path | None = None) -> dict:
    """The time for a version to reach every sampler of `sc` (see `_spread`), against a
    real broker started for it."""
    with _broker(sc, workdir) as url:
        return asyncio.run(_spread(sc, url, versions))


@contextlib.contextmanager
def _broker(sc: Scenario, workdir: str | Path | None):
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        port = free_port()
        broker = start_broker(sc, Path(tmp) / "broker", port)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            broker.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                broker.wait(timeout=30)
            if broker.poll() is None:
                broker.kill()


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
