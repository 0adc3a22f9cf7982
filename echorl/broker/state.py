"""What the broker's routes share: the run's task and tokenizer, the store, the weights, the
long-poll bells and the metrics. Built once at start, where everything the run needs is
checked, so a broker that cannot serve its run refuses to start with the reason.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from echorl.broker.activation import Activation
from echorl.broker.auth import Auth, RateLimit
from echorl.broker.capacity import Pace, capacity
from echorl.broker.dashboard import Board
from echorl.broker.fanout import FanOut
from echorl.broker.intake import Limits, PushParser
from echorl.broker.standing import Standing
from echorl.broker.store import Admission, BrokerStore, Probation
from echorl.broker.swarm import Quarantine
from echorl.broker.weights import WeightStore
from echorl.broker.writer import Writer
from echorl.config import ModelConfig, RunConfig
from echorl.models.tokenizer import RunTokenizer, TokenizerError
from echorl.protocol import (
    Arrival,
    GroupAudit,
    HeartbeatRequest,
    NotFound,
    ProtocolError,
    RunInfo,
    SamplerStatus,
    ScoredGroup,
    StatusReply,
    TooMany,
    Unprocessable,
    WeightVersion,
)
from echorl.rollout.verify import StoredGroup, Verdict, VerifierPool, VerifierSpec
from echorl.tasks import Environment, Task, get_task

T = TypeVar("T")
log = logging.getLogger("echorl.broker")


class SetupError(ValueError):
    """The broker cannot serve this run; the message is one line that says why."""


class Bell:
    """Wakes the long polls waiting for one kind of change; rung from any thread."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None  # set once the server runs
        self.event = asyncio.Event()

    def ring(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._ring)

    def _ring(self) -> None:
        self.event.set()  # wakes everyone waiting now; later waiters wait for the next ring
        self.event = asyncio.Event()

    async def poll(
        self, wait_s: float, attempt: Callable[[], T], pool: Executor | None = None
    ) -> T:
        """Run `attempt` (blocking, in `pool`, else on the loop's default threads) until it
        returns something non-empty, trying again after each ring; after `wait_s` without a
        ring, the last result stands."""
        deadline = time.monotonic() + wait_s
        loop = asyncio.get_running_loop()
        while True:
            rung = self.event  # taken before the attempt: a ring during it is not missed
            result = await loop.run_in_executor(pool, attempt)
            left = deadline - time.monotonic()
            if result or left <= 0:
                return result
            try:
                await asyncio.wait_for(rung.wait(), left)
            except TimeoutError:
                return result


class Intake:
    """Bytes of push bodies held at once, in all and per sampler: what a flood of big
    pushes can hold of the broker's memory is bounded (the rest are refused, 429, before
    their bodies are read)."""

    def __init__(self, total: int, per_sampler: int):
        self.total, self.per_sampler = total, per_sampler
        self.held: dict[str, int] = {}
        self.all = 0

    def take(self, who: str, n: int) -> bool:
        """Hold `n` more bytes for `who`, if both bounds allow (nothing held otherwise)."""
        mine = self.held.get(who, 0)
        if self.all + n > self.total or mine + n > self.per_sampler:
            return False
        self.held[who], self.all = mine + n, self.all + n
        return True

    def give(self, who: str, n: int) -> None:
        left = self.held.pop(who, 0) - n
        if left > 0:
            self.held[who] = left
        self.all -= n


class Metrics:
    """The Prometheus series the broker exports at /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.pushed = Counter(
            "broker_groups_pushed",
            "groups pushed, scored and ready for the trainer",
            registry=self.registry,
        )
        self.dropped = Counter(
            "broker_groups_dropped_stale", "groups dropped as too stale", registry=self.registry
        )
        self.latest = Gauge(
            "broker_latest_version", "newest published policy version", registry=self.registry
        )
        self.verifier_failures = Counter(
            "broker_verifier_failures",
            "completions scored 0 because the verifier overran its time (timeout) or memory "
            "(memory), crashed its process (crash) or raised (error)",
            ["task", "kind"],
            registry=self.registry,
        )
        self.refused = Counter(
            "broker_groups_refused",
            "stored groups the verifier refused (not what the task produces); jobs re-queued",
            registry=self.registry,
        )
        self.cancelled = Counter(
            "broker_jobs_cancelled",
            "sync: jobs still leased for a version when the next was published, queued again",
            registry=self.registry,
        )
        self.quarantined = Counter(
            "broker_samplers_quarantined",
            "samplers quarantined by the trainer's log-prob audit",
            registry=self.registry,
        )
        self.verifier_busy = Gauge(
            "broker_verifier_utilisation",
            "fraction of the verifier workers' time spent scoring",
            registry=self.registry,
        )
        self.samplers = Gauge(
            "broker_samplers",
            "samplers the broker knows, by state",
            ["state"],
            registry=self.registry,
        )
        # Per operator (admin-enrolled names, few: bounded), "" for the shared token.
        self.consumed = Counter(
            "broker_groups_consumed",
            "groups the trainer consumed, by the operator of the sampler that made them",
            ["operator"],
            registry=self.registry,
        )
        self.staleness = Histogram(
            "broker_consumed_staleness",
            "trainer step minus the version that made each consumed group",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
            registry=self.registry,
        )
        self.dissemination = Histogram(
            "broker_version_fetch_seconds",
            "a version's download and load at a sampler, as it reported it",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self.trainer_wait = Histogram(
            "broker_trainer_pull_wait_seconds",
            "how long each of the trainer's pulls waited for groups",
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=self.registry,
        )


@dataclass
class BrokerState:
    cfg: RunConfig
    task: Task | Environment
    codec: RunTokenizer
    store: BrokerStore
    weights: WeightStore
    auth: Auth
    admission: Admission
    metrics: Metrics
    jobs_bell: Bell  # samplers wait for admitted jobs (a new version, a returned lease)
    groups_bell: Bell  # the trainer waits for ready groups (a push, an expired pull)
    audits_bell: Bell  # auditors wait for consumed groups to audit (an ack, a new version)
    verifier: VerifierPool  # the broker's own rewards, off the request path
    parser: PushParser  # push bodies parsed off the server's process
    # Store calls of the hot routes run on one writer thread, batched into group commits;
    # the trainer's lane goes first (sampler traffic never queues in front of it).
    writer: Writer
    push_slots: asyncio.Semaphore  # pushes in progress at once (app.Gate)
    fanout: FanOut  # which sampler fetches a weight version from whom
    pace: Pace  # the trainer's steps and the versions' spread, for capacity figures
    activation: Activation  # which priced samplers are parked (broker/activation.py)
    standing: Standing  # who is proven (leases, verifier turns): broker/standing.py
    auditors: dict[str, float] = field(default_factory=dict)  # name -> last lease call
    board: Board = field(default_factory=Board)  # what the dashboard shows (broker/dashboard.py)
    # Registrations per enrolment token and per client address (a sybil's identities).
    registrations: RateLimit = field(default_factory=lambda: RateLimit(0, 1))
    calls: RateLimit = field(default_factory=lambda: RateLimit(0, 1))  # per sampler
    intake: Intake = field(default_factory=lambda: Intake(1 << 40, 1 << 40))  # push bodies

    @cached_property
    def probation(self) -> Probation | None:
        """None when a first lease is as large as anyone's (`broker.first_lease` >=
        `max_leased_per_sampler`): no probation, newcomers lease from the budget."""
        b, batch = self.cfg.broker, self.cfg.train.batch_prompts
        if b.first_lease >= (b.max_leased_per_sampler or batch):
            return None
        newcomers = b.newcomer_jobs or max(1, batch // 4)
        return Probation(b.first_lease, newcomers, self.standing.proven_tokens)

    def may_register(self, operator: str, address: str) -> None:
        """TooMany (with when to try again) beyond `broker.registrations_per_minute` from
        this enrolment token or this address."""
        now = time.monotonic()
        for key in (f"token:{operator}", f"address:{address}"):
            if wait := self.registrations.take(key, now):
                raise TooMany(
                    f"too many registrations from this {key.split(':')[0]} "
                    f"(broker.registrations_per_minute); try again in {wait:.0f} s",
                    retry_after=wait,
                )

    def check_peer_url(self, peer_url: str, address: str) -> None:
        """Unprocessable unless `peer_url` names the address the registration came from, or
        a network in `broker.peer_hosts`; link-local never (a cloud's metadata service),
        loopback only where the broker is itself on loopback. Honest samplers would be sent
        wherever a sampler's peer_url points."""
        host = urlsplit(peer_url).hostname or ""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise Unprocessable(
                f"peer_url {peer_url}: name the host by its IP address (the one this "
                f"sampler reaches the broker from, {address})"
            ) from None
        broker_on_loopback = self.cfg.broker.host in ("localhost", "127.0.0.1", "::1")
        if ip.is_link_local or (ip.is_loopback and not broker_on_loopback):
            raise Unprocessable(f"peer_url {peer_url}: {host} is not an address peers can reach")
        allowed = [ipaddress.ip_network(n, strict=False) for n in self.cfg.broker.peer_hosts]
        if _plain(ip) != _plain(address) and not any(ip in net for net in allowed):
            raise Unprocessable(
                f"peer_url {peer_url}: not the address this registration came from "
                f"({address}); a sampler behind a NAT is allowed by broker.peer_hosts"
            )

    def auditors_alive(self) -> int:
        """Auditors heard from within `broker.sampler_timeout`."""
        since = time.time() - self.cfg.broker.sampler_timeout
        return sum(seen >= since for seen in self.auditors.values())

    def retain_weights(self, newest: int) -> None:
        """Drop the weight versions nobody needs once `newest` is published. While an auditor
        is alive, the newest two final versions stay too, whatever keep_versions says: an
        auditor audits a version once its groups can no longer be consumed."""
        keep = self.weights.keep
        if self.auditors_alive():
            keep = max(keep, self.admission.max_staleness + 3)
        self.weights.retain(newest, self.store.referenced_versions(), keep)

    def lease_audits(self, n: int) -> tuple[int | None, list[str]]:
        """Consumed groups of one final version to audit (`BrokerStore.lease_audits`): final
        once no step can consume its groups any more, i.e. older than the latest version
        minus the staleness bound."""
        b = self.cfg.broker
        if not self.cfg.quarantine.enabled:  # reports would change nothing
            return None, []
        final_below = self.store.latest_version() - self.admission.max_staleness
        return self.store.lease_audits(
            n, time.time(), b.lease_seconds, final_below, set(self.weights.versions())
        )

    async def write(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` in the samplers' lane of the writer; returns once committed."""
        return await asyncio.wrap_future(self.writer.samplers.submit(fn, *args))

    def sampler_statuses(self, limit: int) -> list[SamplerStatus]:
        return [
            SamplerStatus(
                **row,
                standing=self.standing.describe(row["id"], row["audited_tokens"]),
                fetch_s=self.pace.fetch_of(row["id"]),
                parked=self.activation.is_parked(row["id"]),
            )
            for row in self.store.samplers(limit)
        ]

    def activate(self) -> None:
        """Park or wake priced samplers (`broker.activation`, broker/activation.py); the
        long polls of woken samplers are answered."""
        b, pace = self.cfg.broker, self.pace
        if b.activation != "cheapest":
            return
        needed = pace.step_tokens / pace.train_s if pace.train_s and pace.step_tokens else None
        busy = None  # the share of its steps the trainer was not blocked on groups
        if b.mode == "async" and pace.recent:  # the steps since who works last changed
            busy = pace.fed(since=self.activation.changed_at)
        elif b.mode == "async" and pace.step_s and pace.train_s:  # one that tells no idle_s
            busy = min(1.0, pace.train_s / pace.step_s)
        samplers = self.sampler_statuses(b.max_samplers)
        parked, woken = self.activation.decide(samplers, needed, busy)
        names = {s.id: s.name for s in samplers}
        if parked or woken:  # seen in the broker's output: who works changed
            log.warning(
                "activation: parked %s; woke %s (%d parked in all; %s)",
                ", ".join(sorted(names.get(i, i) for i in parked)) or "none",
                ", ".join(sorted(names.get(i, i) for i in woken)) or "none",
                len(self.activation.parked),
                self.activation.reason or "gone",
            )
        if woken:
            self.jobs_bell.ring()

    def status_reply(self, limit: int) -> StatusReply:
        """`GET /v1/status`'s answer (also the dashboard's)."""
        samplers = self.sampler_statuses(max(limit, 1000))
        return StatusReply(
            mode=self.cfg.broker.mode,
            latest_version=self.store.latest_version(),
            samplers=samplers[:limit],
            sampler_counts=self.store.sampler_counts(),
            verifier=dict(self.verifier.failures) | {"refused": self.verifier.refused},
            verifier_busy=self.verifier.utilisation(),
            verifier_error=self.verifier.first_error,
            auditors=self.auditors_alive(),
            weight_sources=dict(self.fanout.named),
            capacity=capacity(self.pace, samplers, self.admission.max_staleness),
            **self.store.counts(),
        )

    async def for_trainer(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` in the trainer's lane of the writer; returns once committed."""
        return await asyncio.wrap_future(self.writer.trainer.submit(fn, *args))

    def verify_later(
        self, seed: int, created: float, group: Arrival | ScoredGroup, who: Hashable = ""
    ) -> None:
        """Score a stored group in the verifier pool: the sampler's claims are never trusted.
        (Its token ids were checked against the vocabulary when it was stored.) `who`: its
        turn in the pool (`Standing.turn` of the sampler that pushed it); the pool serves
        turns in order, proven ones first, so one whose groups hang the verifier delays
        nobody else's, and unproven identities wait behind proven work."""
        completions = (
            StoredGroup(group.body, group.group_size)  # parsed by the worker that scores it
            if isinstance(group, Arrival)
            else group.completions
        )
        self.verifier.submit((group.job_id, created), seed, completions, self.on_scored, key=who)

    def on_scored(self, pairs: list[tuple[tuple[int, float], Verdict]]) -> None:
        """Verdicts scored together (on the pool's thread, as soon as they are), stored in one
        transaction in the trainer's lane: what makes groups ready never queues behind the
        swarm's pushes, and the pool goes on scoring meanwhile."""
        for (job_id, _), v in pairs:
            for kind, n in v.failed.items():
                self.metrics.verifier_failures.labels(self.task.name, kind).inc(n)
            if v.refused:
                log.warning("the group for job %d is refused: %s", job_id, v.refused)
        verdicts = [
            (job_id, created, None if v.refused else v.rewards, v.parts)
            for (job_id, created), v in pairs
        ]
        self.writer.trainer.submit(self.store.scored, verdicts).add_done_callback(self._stored)

    def _stored(self, future: Future) -> None:
        try:
            ready, refused, promoted = future.result()
        except Exception:  # the store failed; the groups stay `scoring`, re-scored at start
            log.exception("verdicts could not be stored")
            return
        self.metrics.pushed.inc(ready)
        self.metrics.refused.inc(refused)
        self.metrics.verifier_busy.set(self.verifier.utilisation())
        if ready:
            self.groups_bell.ring()
        if promoted and not self.standing.proven_tokens:  # proven by its first scored group
            self.standing.observe(self.store.standing_rows())
            self.jobs_bell.ring()
        if refused:
            self.jobs_bell.ring()

    def audit(self, groups: list[GroupAudit], step: int) -> dict[str, str]:
        """The trainer's log-prob audit: samplers over the bounds are quarantined (id -> why)."""
        q = self.cfg.quarantine
        if not q.enabled:
            return {}
        policy = Quarantine(q.min_tokens, q.max_mean_abs, q.max_kl, q.max_beyond, q.decay)
        quarantined = dict(self.store.audit(groups, policy, step))
        for sampler_id in quarantined:
            self.fanout.forget(sampler_id)
            self.standing.forget(sampler_id)
        self.standing.observe(self.store.standing_rows())
        self.metrics.quarantined.inc(len(quarantined))
        # Their leases and dropped groups' jobs are queued again, or newcomers were proven.
        self.jobs_bell.ring()
        return quarantined

    def foreign(self, beat: HeartbeatRequest) -> bool:
        """Whether the weights a sampler says it holds are not those of that number here (a
        resumed trainer re-published it with others); unsaid or forgotten: not foreign."""
        if beat.version_held is None or beat.sha256_held is None:
            return False
        stored = self.stored_version(beat.version_held)
        return stored is not None and stored.sha256 != beat.sha256_held

    def stored_version(self, version: int) -> WeightVersion | None:
        """`version`'s WeightVersion, or None (none yet, or forgotten by a rewind just now)."""
        try:
            return self.weights.describe(version) if version >= 0 else None
        except NotFound:
            return None

    def run_info(self) -> RunInfo:
        b, t = self.cfg.broker, self.cfg.train
        return RunInfo(
            task=self.task.name,
            tokenizer=self.codec.fingerprint,
            mode=b.mode,
            max_staleness=b.staleness,
            batch_prompts=t.batch_prompts,
            group_size=t.group_size,
            latest_version=self.store.latest_version(),
        )

    def check_peer(self, who: str, tokenizer: str, task: str) -> None:
        """A sampler's or trainer's tokenizer and task must be the run's (409 naming both)."""
        ours = self.codec.fingerprint
        if tokenizer != ours:
            raise ProtocolError(
                f"this {who}'s tokenizer (fingerprint {tokenizer[:16]}) is not the run's "
                f"({ours[:16]}): load the run's model (model.path / model.tokenizer)"
            )
        if task != self.task.name:
            raise ProtocolError(f"this {who} runs task {task!r}, the run is {self.task.name!r}")


def run_tokenizer(model: ModelConfig) -> RunTokenizer:
    """The run's tokenizer: `model.tokenizer`, else `model.path`'s, else the built-in one."""
    folder = model.tokenizer or model.path
    return RunTokenizer.from_folder(folder) if folder else RunTokenizer.builtin()


def open_store(
    cfg: RunConfig, task: Task | Environment, codec: RunTokenizer, read_only: bool = False
) -> BrokerStore:
    """The data dir's store, checked: the first job can be made as a lease would make it, and
    the data dir serves this run (task, tokenizer, prompt format; recorded at the first
    start that gets this far). SetupError otherwise. `read_only`: a finished run's, shown."""
    data = Path(cfg.broker.data_dir)
    if read_only and not (data / "broker.sqlite").exists():
        raise SetupError(f"{data} holds no broker.sqlite")
    data.mkdir(parents=True, exist_ok=True)
    store = BrokerStore(
        data / "broker.sqlite",
        task.name,
        task.problem,
        lambda text: codec.encode_prompt(text, cfg.sampling),
        run_seed=cfg.task.seed,
        vocab_size=codec.vocab_size,
        synchronous=cfg.broker.synchronous,
        max_attempts=cfg.broker.max_attempts,
        refill_flat=round(cfg.train.dynamic_sampling_max * cfg.train.batch_prompts)
        if cfg.train.dynamic_sampling
        else 0,
        read_only=read_only,
    )
    identity = {
        "task": task.name,
        "tokenizer": codec.fingerprint,
        "prompts": cfg.sampling.model_dump_json(
            include={"prompt_format", "system_prompt"}
            if cfg.sampling.prompt_format == "chat"
            else {"prompt_format"}
        ),
    }
    try:
        store.first_job()
    except Exception as e:  # the task's or the template's own code: any failure is the reason
        store.close()
        raise SetupError(f"the first job of {task.name!r} cannot be made: {e}") from None
    try:
        store.check_run(identity)
    except ValueError as e:
        store.close()
        raise SetupError(str(e)) from None
    return store


def build_state(cfg: RunConfig, read_only: bool = False) -> BrokerState:
    """Everything the routes need, checked: the task builds, the tokenizer loads, and the first
    job's prompt encodes to ids in the vocabulary. Raises SetupError with the reason.
    `read_only`: a finished run's state, to look at (its store opened read-only)."""
    b = cfg.broker
    try:
        task = get_task(cfg.task.spec)
    except (KeyError, ValueError) as e:
        raise SetupError(f"task.name: {e.args[0] if e.args else e}") from None
    try:
        codec = run_tokenizer(cfg.model)
    except (TokenizerError, OSError, ValueError) as e:
        raise SetupError(f"model.tokenizer: {e}") from None
    data = Path(b.data_dir)
    fresh = not (data / "broker.sqlite").exists()
    try:
        store = open_store(cfg, task, codec, read_only)
        try:
            auth = Auth(b, store.secrets(), store.revoked(), store.operators())
        except ValueError as e:
            store.close()
            raise SetupError(str(e)) from None
    except SetupError:
        if fresh and not read_only:  # a run that never started leaves nothing behind to resume
            for name in ("broker.sqlite", "broker.sqlite-wal", "broker.sqlite-shm"):
                (data / name).unlink(missing_ok=True)
        raise
    # The task loaded here already; its workers start in the background (/healthz answers).
    verifier = VerifierPool(VerifierSpec.for_run(cfg, codec), cfg.verify.workers, wait=False)
    parser = PushParser(Limits.of(task, cfg, codec))
    metrics = Metrics()
    metrics.latest.set(store.latest_version())
    standing = Standing(
        cfg.quarantine.min_tokens if cfg.quarantine.enabled else 0,
        trust_all=b.first_lease >= (b.max_leased_per_sampler or cfg.train.batch_prompts),
    )
    st = BrokerState(
        cfg=cfg,
        task=task,
        codec=codec,
        store=store,
        weights=WeightStore(
            data / "weights", b.sampler_dtype, b.keep_versions, b.max_weights_bytes
        ),
        auth=auth,
        # Sync is admission with max_staleness 0 and every job pinned to the latest version.
        admission=Admission(
            batch=cfg.train.batch_prompts,
            max_staleness=b.staleness,
            pin_version=b.mode == "sync",
            spare=math.ceil((b.overprovision - 1) * cfg.train.batch_prompts - 1e-9)
            if b.mode == "sync"
            else 0,
        ),
        metrics=metrics,
        registrations=RateLimit(b.registrations_per_minute / 60, b.registrations_per_minute),
        calls=RateLimit(b.sampler_calls_per_s, 2 * b.sampler_calls_per_s),
        intake=Intake(
            b.push_bytes_in_flight or 8 * b.max_body_bytes,
            b.push_bytes_per_sampler or 2 * b.max_body_bytes,
        ),
        jobs_bell=Bell(),
        groups_bell=Bell(),
        audits_bell=Bell(),
        verifier=verifier,
        parser=parser,
        writer=Writer(store),
        push_slots=asyncio.Semaphore(b.push_slots),
        fanout=FanOut(b.peer_fanout, standing.trusted),
        pace=Pace(),
        activation=Activation(
            b.activation_margin, b.activation_hold_s, enabled=b.activation == "cheapest"
        ),
        standing=standing,
    )
    st.standing.observe(store.standing_rows())
    st.board.load(store, st.weights)  # what came before a restart, for the dashboard
    for _, created, seed, group in store.scoring():  # stored before a restart
        st.verify_later(seed, created, group, st.standing.turn(group.sampler or ""))
    return st


def _plain(address) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as one IP (an IPv4 address mapped into IPv6 as the IPv4 one); None if
    it is none."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip
