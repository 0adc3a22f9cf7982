"""The sampler process: lease jobs, hold the right weights, generate, push. Repeat.

    echorl sampler --broker http://127.0.0.1:8000 --token T --model runs/demo/sft

The protocol decides which weights a batch of jobs needs: sync jobs carry
`required_version` (pulled before generating: every call refreshes the
weights); async jobs use the latest version the broker reported, re-checked
between batches. Weights are swapped in place with `load_state_dict` between
generations, never during one. A lease (`sampler.jobs_per_lease` jobs) is
generated as one batch. A lease is a long poll (the broker answers as soon
as a job is admitted, e.g. when a new version is out) and a heartbeat (it
reports the version held and the last batch's speed). A group the broker
refuses (its lease ran out) is counted and dropped; a broker that is down is
waited for. The loop knows nothing of training.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from echorl.client import BrokerClient, BrokerRejected, BrokerUnavailable
from echorl.config import RunConfig
from echorl.metrics import MetricsLog
from echorl.protocol import LeaseReply, RegisterReply, SamplerInfo, ScoredGroup, WeightVersion
from echorl.rollout.backend import Backend
from echorl.rollout.follow import WeightFollower
from echorl.rollout.generate import rollout
from echorl.rollout.peers import PeerServer, reachable_host
from echorl.rollout.verify import VerifierPool
from echorl.seeding import derive_seed
from echorl.stopping import Interrupted, Stop
from echorl.tasks import get_task

log = logging.getLogger("echorl.sampler")

OUTAGE_ALARM_S = 60.0  # a broker answering 5xx (or nothing) this long is reported loudly
PUSH_ENVELOPE = 1024  # bytes of a push beside its groups (the sampler id, the JSON around)
CHECK_AFTER_S = 1.0  # sync: a batch this long asks whether its jobs were cancelled meanwhile


class Sampler:
    def __init__(
        self,
        client: BrokerClient,
        backend: Backend,
        cfg: RunConfig,
        name: str,
        cache: Path,
        metrics: MetricsLog | None = None,
        scorer: VerifierPool | None = None,
        peers: PeerServer | None = None,
    ):
        """`peers`: this sampler's server of weights to its peers (`sampler.serve_peers`)."""
        self.client, self.backend, self.cfg, self.name = client, backend, cfg, name
        self.scorer = scorer  # its own claims, scored in a bounded worker process
        self.cache, self.metrics, self.peers = cache, metrics, peers
        shelf = peers.shelf if peers else None
        self.weights = WeightFollower(client, backend, cache, name, shelf)  # the version in use
        self.pushed = self.rejected = 0
        self.cancelled_jobs = self.wasted_tokens = 0  # sync: work for a version gone by
        self.idle_s = 0.0  # in leases, waiting for admitted jobs, since the last batch
        self.tokens_per_s: float | None = None  # of the last batch (its metrics; the broker
        # measures the speed it goes by from what the sampler delivers)
        self.max_body_bytes = cfg.broker.max_body_bytes  # the broker's, once registered
        self.was_parked = False  # the last lease said parked (broker.activation)

    @property
    def version(self) -> int | None:
        return self.weights.version

    @property
    def sha256(self) -> str | None:
        """The sha256 of the weights held: the broker tells a re-published number by it."""
        return None if self.weights.held is None else self.weights.held[1]

    def ensure_version(self, version: int, known: WeightVersion | None = None) -> float:
        """Hold `version` (`WeightFollower.ensure`); returns the seconds spent."""
        return self.weights.ensure(version, known)

    def parked(self, reply: LeaseReply) -> None:
        """Parked by the broker (`broker.activation = cheapest`: cheaper samplers cover the
        trainer's need): no jobs until woken. It fetches no version meanwhile: parked
        samplers fetching each one shared the broker's uplink with the working ones and
        doubled their fetches (emulated, K = 32 with deltas); woken, it fetches the latest
        with its first lease, as after any idle spell."""
        if not self.was_parked:
            log.warning(
                "%s: parked by the broker (cheaper samplers cover the trainer's need); "
                "waiting to be woken",
                self.name,
            )

    def work(self, sampler_id: str, reply: LeaseReply, beat: Heartbeat | None = None) -> None:
        """Generate the leased jobs as one batch with one version, and push each group."""
        jobs = reply.jobs
        needed = {j.required_version for j in jobs}
        assert len(needed) == 1, f"one lease mixes required versions {needed}"
        (required,) = needed
        download_s = self.ensure_version(
            reply.latest_version if required is None else required, reply.latest
        )
        if download_s and beat is not None:
            beat.loaded(self.version, download_s)
        if required is not None and reply.latest_version > required:  # cancelled already
            self.dropped(jobs, 0, required)
            return
        task = get_task(self.cfg.task.spec)
        t0 = time.perf_counter()
        groups = rollout(
            self.backend,
            task,
            [task.problem(job.seed) for job in jobs],
            [job.prompt_ids for job in jobs],  # as the broker encoded them: never re-encoded
            jobs[0].group_size,
            self.cfg.sampling,
            # One seed per lease: the same jobs leased the same way give the same tokens.
            seed=derive_seed(self.cfg.train.seed, "lease", *[j.job_id for j in jobs]),
            version=self.version,
            format_reward=self.cfg.task.format_reward,
            job_ids=[job.job_id for job in jobs],
            scorer=self.scorer,
        )
        gen_s = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        throttle_s = self.throttle(sampler_id, required, gen_s)
        # Worth a call only after a long batch: a fast one's group for a cancelled job costs
        # one refused push, which is cheaper than asking before every push.
        if (throttle_s or gen_s > CHECK_AFTER_S) and self.cancelled(sampler_id, required):
            self.dropped(jobs, tokens, required)
            return
        groups = [
            g.model_copy(update={"gen_seconds": (gen_s + throttle_s) / len(jobs)}) for g in groups
        ]
        parts, too_big = split_pushes(groups, self.max_body_bytes)
        for g, size in too_big:  # the broker would refuse it (413) however often it was sent
            self.rejected += 1
            log.error(
                "%s: group for job %d is %d bytes, over the broker's limit of %d "
                "(broker.max_body_bytes); dropped: raise the limit, or lower "
                "sampling.max_new_tokens or train.group_size",
                self.name,
                g.job_id,
                size,
                self.max_body_bytes,
            )
        for part in parts:
            for result in self.client.push_many(sampler_id, part):
                if result.refused:  # the lease ran out, or a resumed trainer took the job back
                    self.rejected += 1
                    log.warning(
                        "%s: group for job %d refused: %s",
                        self.name,
                        result.job_id,
                        result.refused,
                    )
                else:
                    self.pushed += 1
        self.tokens_per_s = tokens / (gen_s + throttle_s)
        if self.metrics:
            self.metrics.write(
                {
                    "time": time.time(),
                    "version": self.version,
                    "weights": self.sha256[:12],  # a re-published number has other weights
                    "jobs": len(jobs),
                    "sampler/tokens": tokens,
                    "sampler/gen_s": gen_s,
                    "sampler/throttle_s": throttle_s,
                    "sampler/tokens_per_s": self.tokens_per_s,
                    "sampler/download_s": download_s,
                    "sampler/download_bytes": self.weights.downloaded,
                    "sampler/peer_bytes": self.weights.from_peers,
                    "sampler/delta_bytes": self.weights.delta_bytes,
                    "sampler/peer_failures": self.weights.peer_failures,
                    "sampler/served_bytes": self.peers.served if self.peers else 0,
                    "sampler/idle_s": self.idle_s,
                    "sampler/rejected": self.rejected,
                    "sampler/cancelled": self.cancelled_jobs,
                    "sampler/wasted_tokens": self.wasted_tokens,
                }
            )
        self.idle_s = 0.0

    def throttle(self, sampler_id: str, required: int | None, gen_s: float) -> float:
        """SIMULATION of a slower machine (`sampler.slowdown`): wait (slowdown - 1) x the
        generation's time, as if generating took that much longer, stopping early if the
        jobs are cancelled meanwhile. Returns the seconds waited."""
        if self.cfg.sampler.slowdown == 1:
            return 0.0
        t0 = time.perf_counter()
        end = t0 + (self.cfg.sampler.slowdown - 1) * gen_s
        while (left := end - time.perf_counter()) > 0:
            time.sleep(min(left, 0.5))
            if left > 0.5 and self.cancelled(sampler_id, required):
                break
        return time.perf_counter() - t0

    def cancelled(self, sampler_id: str, required: int | None) -> bool:
        """Sync: a newer version than the jobs' is out, so their groups can never be consumed
        (the broker queued the jobs again when it was published: `broker.overprovision`).
        Asked with a heartbeat; a broker that does not answer cancels nothing."""
        if required is None:
            return False
        try:
            return (
                self.client.heartbeat(sampler_id, self.version, sha256_held=self.sha256) > required
            )
        except BrokerUnavailable:
            return False

    def dropped(self, jobs: list, tokens: int, required: int | None) -> None:
        """Stop work on cancelled jobs: nothing is pushed; the tokens are counted as wasted."""
        self.cancelled_jobs += len(jobs)
        self.wasted_tokens += tokens
        log.info(
            "%s: jobs %s for version %s cancelled (a newer version is out); %d tokens dropped",
            self.name,
            ", ".join(str(job.job_id) for job in jobs),
            required,
            tokens,
        )
        if self.metrics:
            self.metrics.write(
                {
                    "time": time.time(),
                    "version": self.version,
                    "jobs": 0,
                    "sampler/cancelled": self.cancelled_jobs,
                    "sampler/wasted_tokens": self.wasted_tokens,
                }
            )

    def info(self) -> SamplerInfo:
        return SamplerInfo(
            name=self.name,
            hardware=_hardware(),
            backend=self.cfg.sampler.backend,
            tokenizer=self.backend.codec.fingerprint,
            task=get_task(self.cfg.task.spec).name,
            cost_per_hour=self.cfg.sampler.cost_per_hour,
            peer_url=self.peers.url(self.cfg.sampler.peer_host or reachable_host(self.client.url))
            if self.peers
            else None,
        )

    def join(self, stop: threading.Event, outage: Outage) -> RegisterReply | None:
        """Register, waiting out a broker that does not answer (restarting, say: the launcher
        starts roles in any order) until `stop`; None if stopped first."""
        while not stop.is_set():
            try:
                return self.client.join(self.info())
            except BrokerUnavailable as e:
                outage.failed(e)
                stop.wait(2.0)
        return None

    def rejoin(
        self, enrolment: str, stop: threading.Event, outage: Outage, why: BrokerRejected
    ) -> RegisterReply | None:
        """Register again after the broker forgot this sampler (`why`); BrokerRejected naming
        both when it refuses (another run's broker: other tokens, task or tokenizer)."""
        self.client.use_token(enrolment)
        try:
            terms = self.join(stop, outage)
        except BrokerRejected as e:
            raise BrokerRejected(
                e.status,
                f"the broker no longer knows this sampler ({why.reason}) and refused it again: "
                f"{e.reason}. It serves another run now (restarted on a fresh data dir with "
                "other tokens or config?): start this sampler with that run's token and config",
            ) from None
        if terms is not None:
            log.warning(
                "%s: the broker no longer knew this sampler (restarted on a fresh data dir, or "
                "it forgot it after broker.sampler_retention_s): registered again as %s",
                self.name,
                terms.sampler_id,
            )
        return terms

    def run(self, stop: threading.Event) -> None:
        """Lease, generate, push until `stop`. Raises BrokerRejected when the broker refuses
        this sampler: at registration (another tokenizer or task than the run's, too many
        samplers), or later (401/403: it was revoked)."""
        outage = Outage(self.name)
        enrolment = self.client.token  # joining swaps it for this sampler's own credential
        if (terms := self.join(stop, outage)) is None:
            return  # stopped before it could register
        sampler_id, self.max_body_bytes = terms.sampler_id, terms.max_body_bytes
        if self.peers:
            self.peers.secret = terms.peer_secret
        log.info("%s registered as %s", self.name, sampler_id)
        idle = stop.idle if isinstance(stop, Stop) else nullcontext
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                # A long poll: the broker answers as soon as jobs are admitted. It holds no work
                # yet, so a stop signal ends it at once (what it was handed goes back on leaving).
                with idle():
                    reply = self.client.lease(
                        sampler_id,
                        self.cfg.sampler.jobs_per_lease,
                        self.cfg.sampler.lease_wait_s,
                        self.version,
                        self.sha256,
                    )
                self.idle_s += time.perf_counter() - t0
                if reply.jobs:  # silent this long, it would be lost, and its lease with it
                    with Heartbeat(self.client, sampler_id, terms.heartbeat_s, self) as beat:
                        self.work(sampler_id, reply, beat)
                elif reply.parked:
                    self.parked(reply)
                if self.was_parked and not reply.parked:
                    log.warning("%s: woken by the broker: leasing again", self.name)
                self.was_parked = reply.parked
                outage.over()  # a whole lease -> generate -> push went through
            except BrokerUnavailable as e:  # the broker is down: back off and carry on
                outage.failed(e)
                stop.wait(2.0)
            except BrokerRejected as e:
                if e.status == 401 and e.reason.startswith("unknown token"):
                    # Forgotten: a broker restarted on a fresh data dir, or this sampler gone
                    # past sampler_retention_s. Once more with the enrolment token, or the
                    # reason why not.
                    if (terms := self.rejoin(enrolment, stop, outage, e)) is None:
                        break
                    sampler_id, self.max_body_bytes = terms.sampler_id, terms.max_body_bytes
                    if self.peers:
                        self.peers.secret = terms.peer_secret
                    continue
                if e.status in (401, 403):  # revoked or quarantined: it may not call any more
                    raise
                log.warning("%s: %s; leasing again", self.name, e)  # e.g. a version deleted
                stop.wait(0.5)
            except Interrupted:
                pass  # stopped mid-poll
        try:  # hand back what it will not finish, so nobody waits for the lease to expire
            with self.client.clone() as client:  # new connections: a cut poll spent one
                client.leave(sampler_id)
        except (BrokerUnavailable, BrokerRejected):
            log.warning("%s: could not tell the broker it left; its leases will expire", self.name)
        if self.metrics:
            self.metrics.close()


def split_pushes(
    groups: list[ScoredGroup], max_body_bytes: int
) -> tuple[list[list[ScoredGroup]], list[tuple[ScoredGroup, int]]]:
    """`groups` in as few pushes as fit the broker's body limit (long completions make a
    lease's groups larger than one request may be), in order; and those over the limit on
    their own, with their sizes."""
    room = max_body_bytes - PUSH_ENVELOPE
    parts: list[list[ScoredGroup]] = []
    too_big: list[tuple[ScoredGroup, int]] = []
    used = room
    for g in groups:
        size = len(g.model_dump_json()) + 1  # and a comma
        if size > room:
            too_big.append((g, size))
            continue
        if used + size > room:
            parts.append([])
            used = 0
        parts[-1].append(g)
        used += size
    return parts, too_big


ENDED = (401, 403, 404, 409)  # a beat refused so: this sampler's standing at the broker is over


class Heartbeat:
    """Beats for a sampler, every `interval` seconds, while it downloads, generates and
    pushes a lease: a lease may take longer than the broker's `sampler_timeout` (a slow
    machine, long completions), and a sampler the broker hears nothing from is lost."""

    def __init__(self, client: BrokerClient, sampler_id: str, interval: float, sampler: Sampler):
        # Its own connections, no retries, and no longer a wait than a beat's interval: a
        # missed beat is retried by the next one, never held up by one stuck on a bad link.
        self.client = BrokerClient(
            **client.settings() | {"retries": 0, "timeout": max(1.0, interval)}
        )
        self.sampler_id, self.interval = sampler_id, interval
        self.sampler = sampler
        self.done = threading.Event()
        self.wake = threading.Event()  # beat now, not at the interval's end
        self.fetched: tuple[int, float] | None = None  # a version just loaded, and its seconds
        self.thread = threading.Thread(target=self.beat, name="heartbeat", daemon=True)

    def loaded(self, version: int, seconds: float) -> None:
        """Beat at once: `version` is loaded, in `seconds` (the broker times how long versions
        take to reach the swarm), told without holding up the work."""
        self.fetched = (version, seconds)
        self.wake.set()

    def beat(self) -> None:
        while True:
            self.wake.wait(self.interval)
            self.wake.clear()
            if self.done.is_set():
                return
            fetched, self.fetched = self.fetched, None
            version, seconds = fetched or (self.sampler.version, None)
            try:
                self.client.heartbeat(
                    self.sampler_id, version, fetch_s=seconds, sha256_held=self.sampler.sha256
                )
            except BrokerUnavailable as e:  # the main loop finds out on its next call
                log.debug("%s: heartbeat failed: %s", self.sampler.name, e)
            except BrokerRejected as e:
                if e.status in ENDED:
                    return  # revoked, quarantined, left or forgotten: the main loop's next call says so
                # A rate limit (429; a saturated link's beats bunched up): the next beat counts.
                log.debug("%s: heartbeat refused: %s", self.sampler.name, e)

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.wake.set()
        self.thread.join(timeout=1.0)
        if not self.thread.is_alive():  # else a beat is in flight: it closes with the process
            self.client.close()


class Outage:
    """How long the broker has been failing: a warning per failure, and an error with the
    broker's own reason once it has failed for `OUTAGE_ALARM_S` (then once a minute)."""

    def __init__(self, name: str):
        self.name = name
        self.since: float | None = None
        self.alarmed_at = 0.0

    def failed(self, e: BrokerUnavailable) -> None:
        now = time.monotonic()
        self.since = self.since or now
        down = now - self.since
        if down >= OUTAGE_ALARM_S and now - self.alarmed_at >= OUTAGE_ALARM_S:
            self.alarmed_at = now
            log.error(
                "%s: THE BROKER HAS FAILED EVERY CALL FOR %.0f s; its last answer: %s. "
                "Nothing is being generated; see the broker's log",
                self.name,
                down,
                e,
            )
        else:
            log.warning("%s: broker unavailable (%s); retrying", self.name, e)

    def over(self) -> None:
        if self.since is not None and time.monotonic() - self.since >= OUTAGE_ALARM_S:
            log.warning("%s: the broker answers again", self.name)
        self.since = None


def _hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu x{torch.get_num_threads()}"
