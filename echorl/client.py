"""BrokerClient: the typed HTTP client every sampler and trainer uses to talk to the broker.

    client = BrokerClient("http://127.0.0.1:8000", token="...")
    run = client.run_info()  # the task and tokenizer fingerprint a sampler must match
    sid = client.register(SamplerInfo(name="laptop", tokenizer=run.tokenizer, task=run.task))
    jobs = client.lease(sid, n=4).jobs

Errors:

    BrokerError              any failed call; .status (None for transport errors) and .reason
     +-- BrokerRejected      4xx: the request is wrong or not allowed now; never retried
     +-- BrokerUnavailable   connection errors and 5xx after every retry was spent

Connection errors and 5xx are retried with exponential backoff and full jitter
(idempotent on the broker's side: a push is stored once, an ack counted once).
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx

from echorl.protocol import (
    AckReply,
    AckRequest,
    AuditLease,
    AuditLeaseRequest,
    AuditReply,
    AuditReport,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseReply,
    LeaseRequest,
    LeaveReply,
    OperatorReply,
    OperatorRequest,
    PullReply,
    PullRequest,
    PushManyReply,
    PushManyRequest,
    PushReply,
    PushRequest,
    PushResult,
    RegisterReply,
    RevokeReply,
    RewindReply,
    RewindRequest,
    RunInfo,
    SamplerInfo,
    ScoredGroup,
    SourceRequest,
    StatusReply,
    Took,
    TrainerHello,
    TrainerMetrics,
    TrainerMetricsReply,
    WeightSource,
    WeightVersion,
)
from echorl.transfer import Partial

CHUNK = 1 << 20
# A peer's transfer is given up (and the peer reported) when it is silent this long, or
# slower than PEER_MIN_RATE bytes/s on average once PEER_GRACE_S have passed: a peer that
# trickles cannot hold a sampler, and the samplers it feeds, for long.
PEER_TIMEOUT_S, PEER_GRACE_S, PEER_MIN_RATE = 10.0, 10.0, 64 << 10
# A peer slower than the broker's `min_rate` for it after PEER_CHECK_S is left (TooSlow).
PEER_CHECK_S = 2.0


class BrokerError(Exception):
    def __init__(self, status: int | None, reason: str):
        super().__init__(f"{status or 'no answer'}: {reason}")
        self.status, self.reason = status, reason


class BrokerRejected(BrokerError):
    pass


class BrokerUnavailable(BrokerError):
    pass


class TooSlow(BrokerUnavailable):
    """A peer delivering under the broker's `min_rate`, or busy: left for the broker, not
    reported (it may be passing on a slow arrival, or flooded by someone else)."""


class BrokerClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 6,
        backoff: float = 0.2,
        max_backoff: float = 10.0,
        cancel: threading.Event | None = None,
    ):
        """`cancel`: once set, a failing call is not retried (a process told to stop while
        the broker is gone exits at once instead of backing off for a minute)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        self.url, self.token, self.timeout = url, token, timeout
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.cancel = cancel or threading.Event()
        self._peer_http: httpx.Client | None = None  # for weights from peers, made when needed

    def settings(self) -> dict:
        """What makes another client like this one, in this process or another (plain
        values): the url, the token it carries now, its timeout and retries."""
        return {
            "url": self.url,
            "token": self.token,
            "timeout": self.timeout,
            "retries": self.retries,
            "backoff": self.backoff,
            "max_backoff": self.max_backoff,
        }

    def clone(self) -> BrokerClient:
        """A new client with the same settings and its own connections (one per thread)."""
        return BrokerClient(**self.settings(), cancel=self.cancel)

    def close(self) -> None:
        self.http.close()
        if self._peer_http is not None:
            self._peer_http.close()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        last: BrokerError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                delay = random.uniform(0, min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))
                if self.cancel.wait(delay):
                    break
            # A streamed body is a factory, so that every attempt sends it from the start.
            args = kw | {"content": kw["content"]()} if callable(kw.get("content")) else kw
            try:
                r = self.http.request(method, path, **args)
            except httpx.TransportError as e:
                last = BrokerUnavailable(None, f"{type(e).__name__}: {e}")
                continue
            if r.status_code < 400 or r.status_code == 416:
                return r
            reason = _reason(r)
            if r.status_code == 429 and (wait := r.headers.get("retry-after", "")).isdigit():
                # A rate limit that says when: wait that long (not a refusal), then again.
                last = BrokerRejected(429, reason)
                if self.cancel.wait(min(float(wait), 60.0)):
                    break
                continue
            if r.status_code < 500:
                raise BrokerRejected(r.status_code, reason)
            last = BrokerUnavailable(r.status_code, reason)
        raise last

    def _post(self, path: str, body, reply):
        return reply.model_validate_json(
            self._request(
                "POST",
                path,
                content=body.model_dump_json(),
                headers={"Content-Type": "application/json"},
            ).content
        )

    # -- sampler role ---------------------------------------------------------------------------

    def join(self, info: SamplerInfo) -> RegisterReply:
        """Join the swarm with the enrolment token; from then on this client (and its clones)
        carries the sampler's own credential. Returns the sampler's id and the broker's terms
        (how often to beat, the largest push)."""
        reply = self._post("/v1/samplers", info, RegisterReply)
        self.use_token(reply.credential)
        return reply

    def register(self, info: SamplerInfo) -> str:
        """`join`, for the sampler's id alone."""
        return self.join(info).sampler_id

    def use_token(self, token: str) -> None:
        self.http.headers["Authorization"] = f"Bearer {token}"
        self.token = token

    def enrol(self, name: str) -> str:
        """The admin's (trainer token): an enrolment token of operator `name`'s own."""
        return self._post("/v1/operators", OperatorRequest(name=name), OperatorReply).token

    def revoke(self, sampler_id: str) -> int:
        """The admin's (trainer token): refuse this sampler from now on; returns how many of its
        leased jobs went back to the queue."""
        r = self._request("POST", f"/v1/samplers/{sampler_id}/revoke")
        return RevokeReply.model_validate_json(r.content).returned

    def heartbeat(
        self,
        sampler_id: str,
        version_held: int | None = None,
        fetch_s: float | None = None,
        sha256_held: str | None = None,
    ) -> int:
        body = HeartbeatRequest(
            version_held=version_held,
            sha256_held=sha256_held,
            fetch_s=fetch_s,
        )
        path = f"/v1/samplers/{sampler_id}/heartbeat"
        return self._post(path, body, HeartbeatReply).latest_version

    def leave(self, sampler_id: str) -> int:
        """Leave the swarm; the broker re-queues this sampler's leased jobs at once."""
        r = self._request("POST", f"/v1/samplers/{sampler_id}/leave")
        return LeaveReply.model_validate_json(r.content).returned

    def lease(
        self,
        sampler_id: str,
        n: int = 1,
        wait_s: float = 0.0,
        version_held: int | None = None,
        sha256_held: str | None = None,
    ) -> LeaseReply:
        """Up to `n` jobs; with `wait_s`, the broker holds the call until one is admitted.
        A lease is also a heartbeat: it may report the version held (and its weights'
        sha256). Its speed the broker measures itself."""
        body = LeaseRequest(
            sampler_id=sampler_id,
            n=n,
            wait_s=wait_s,
            version_held=version_held,
            sha256_held=sha256_held,
        )
        return self._post("/v1/jobs/lease", body, LeaseReply)

    def push(self, sampler_id: str, group: ScoredGroup) -> PushReply:
        return self._post(
            "/v1/rollouts", PushRequest(sampler_id=sampler_id, group=group), PushReply
        )

    def push_many(self, sampler_id: str, groups: list[ScoredGroup]) -> list[PushResult]:
        """Push several groups in one request (one broker transaction); one result each."""
        body = PushManyRequest(sampler_id=sampler_id, groups=groups)
        return self._post("/v1/rollouts/batch", body, PushManyReply).results

    def latest(self) -> WeightVersion | None:
        try:
            return WeightVersion.model_validate_json(
                self._request("GET", "/v1/weights/latest").content
            )
        except BrokerRejected as e:
            if e.status == 404:
                return None
            raise

    def describe(self, version: int) -> WeightVersion:
        """sha256, size and dtype of a stored version."""
        return WeightVersion.model_validate_json(
            self._request("GET", f"/v1/versions/{version}").content
        )

    def source(
        self, version: int, failed: str | None = None, took: Took | None = None
    ) -> WeightSource:
        """Where to fetch `version`: a peer (its url and the broker's ticket for it) or the
        broker itself (url None). `failed`: the peer named last time, which did not deliver;
        `took`: how long the last version took from the source named for it."""
        body = SourceRequest(failed=failed, took=took)
        return self._post(f"/v1/versions/{version}/source", body, WeightSource)

    def receive(self, info: WeightVersion, into: Partial, source: WeightSource | None = None):
        """Fill `into` with `info`'s bytes from `source` (a peer) or the broker, resuming with
        a Range request after a cut and starting over after wrong bytes (sha256); raises
        BrokerUnavailable if they cannot be had whole and right (a peer is given two tries:
        the broker is the fallback)."""
        peer = source is not None and source.url is not None
        for _ in range(2 if peer else self.retries + 1):
            if self._stream(info, into, source if peer else None):
                continue  # broke off: resume from what arrived
            if into.whole:
                return
            into.restart()  # wrong bytes: start over
        where = f"peer {source.url}" if peer else "the broker"
        raise BrokerUnavailable(
            None, f"could not download version {info.version} intact from {where}"
        )

    def fetch_delta(self, version: int) -> bytes:
        """`version` as a delta against its `delta_base` (transfer.apply_delta makes it whole;
        its sha256 is checked then)."""
        return self._request("GET", f"/v1/weights/{version}/delta").content

    def download(self, version: WeightVersion, dest: Path) -> Path:
        """Stream `version` to `dest`, resuming a partial `dest.part`, verified; `dest`
        appears only when the bytes are whole and right."""
        part = Partial(version.sha256, version.size_bytes, dest.with_name(dest.name + ".part"))
        try:
            self.receive(version, part)
        finally:
            part.close()
        part.path.replace(dest)
        return dest

    def fetch(self, version: WeightVersion) -> bytes:
        """`version`'s bytes, in memory, verified: for weights small enough to hold twice
        (no file written, then read back to hash and again to load)."""
        part = Partial(version.sha256, version.size_bytes)
        self.receive(version, part)
        return part.value()

    def _stream(self, info: WeightVersion, into: Partial, peer: WeightSource | None) -> bool:
        """Append `info`'s bytes from `into.have` on, from `peer` or the broker; True if the
        transfer broke off (after a backoff: call again to resume), False once the source
        sent the rest (or more than the version holds: wrong bytes)."""
        if peer is not None:
            return self._stream_peer(info, into, peer)
        headers = {"Range": f"bytes={into.have}-"} if into.have else {}
        try:
            with self.http.stream("GET", f"/v1/weights/{info.version}", headers=headers) as r:
                if r.status_code == 416:  # nothing after `have`: already whole
                    return False
                if r.status_code >= 400:
                    r.read()
                    raise (BrokerRejected if r.status_code < 500 else BrokerUnavailable)(
                        r.status_code, _reason(r)
                    )
                if r.status_code != 206:  # the source sent it all again
                    into.restart()
                for chunk in r.iter_bytes(CHUNK):
                    into.write(chunk)
                    if into.have > info.size_bytes:
                        break  # not this version
            return False
        except (httpx.TransportError, BrokerUnavailable):
            time.sleep(self.backoff)
            return True

    def _stream_peer(self, info: WeightVersion, into: Partial, peer: WeightSource) -> bool:
        """As `_stream`, from a peer, which is not trusted: its own client (it never sees this
        sampler's credential), the bytes taken raw (no decoding), an error's body unread, and
        a transfer slower than PEER_MIN_RATE on average after PEER_GRACE_S given up. Any
        failure raises BrokerUnavailable: the caller reports the peer and asks elsewhere;
        one under the broker's `min_rate` after PEER_CHECK_S, TooSlow: the broker, unreported."""
        headers = {"Authorization": f"Bearer {peer.ticket}", "Accept-Encoding": "identity"}
        if into.have:
            headers["Range"] = f"bytes={into.have}-"
        url = f"{peer.url}/v1/peer/weights/{info.sha256}"
        start, t0 = into.have, time.monotonic()
        try:
            with self._peers().stream("GET", url, headers=headers) as r:
                if r.status_code == 416:  # nothing after `have`: already whole
                    return False
                if r.status_code == 503:  # busy (or so it says): the broker, unreported
                    raise TooSlow(503, "the peer is busy")
                if r.status_code >= 400:
                    raise BrokerUnavailable(r.status_code, "the peer refused")
                if r.status_code != 206:
                    into.restart()
                    start = 0
                for chunk in r.iter_raw():  # as it comes: the rate is checked on each piece
                    into.write(chunk)
                    if into.have > info.size_bytes:
                        break  # not this version
                    took = time.monotonic() - t0
                    if took > PEER_GRACE_S and into.have - start < PEER_MIN_RATE * took:
                        raise BrokerUnavailable(None, f"under {PEER_MIN_RATE >> 10} KiB/s")
                    slow = peer.min_rate and into.have - start < peer.min_rate * took
                    if took > PEER_CHECK_S and slow and into.have < info.size_bytes:
                        rate = (into.have - start) / took / 1e6
                        raise TooSlow(None, f"{rate:.2f} MB/s, under {peer.min_rate / 1e6:.2f}")
            return False
        except (httpx.HTTPError, httpx.StreamError) as e:
            raise BrokerUnavailable(None, f"{type(e).__name__}: {e}") from None

    def _peers(self) -> httpx.Client:
        if self._peer_http is None:
            self._peer_http = httpx.Client(timeout=PEER_TIMEOUT_S)
        return self._peer_http

    def status(self, limit: int = 100) -> StatusReply:
        """The swarm at a glance: every sampler counted by state, the `limit` most relevant
        listed (alive first)."""
        r = self._request("GET", "/v1/status", params={"limit": limit})
        return StatusReply.model_validate_json(r.content)

    def run_info(self) -> RunInfo:
        """The run the broker serves: task, tokenizer fingerprint, protocol, batch shape."""
        return RunInfo.model_validate_json(self._request("GET", "/v1/run").content)

    # -- trainer role ---------------------------------------------------------------------------

    def hello(self, hello: TrainerHello) -> RunInfo:
        """Announce the trainer's tokenizer and task; 409 (naming both) unless the run's."""
        return self._post("/v1/trainer/hello", hello, RunInfo)

    def publish(self, version: int, path: Path) -> WeightVersion:
        """Upload a safetensors file (the trainer streams its own: `publish_stream`)."""

        def read():
            with path.open("rb") as f:
                while chunk := f.read(CHUNK):
                    yield chunk

        return self.publish_stream(version, _sha256(path), path.stat().st_size, read)

    def publish_stream(
        self, version: int, sha256: str, size: int, chunks: Callable[[], Iterable[bytes]]
    ) -> WeightVersion:
        """Upload `size` bytes hashing to `sha256`; `chunks()` yields them from the start
        (called again on a retry)."""
        r = self._request(
            "PUT",
            f"/v1/weights/{version}",
            content=chunks,  # a factory: every retry sends it from the start
            headers={"X-Sha256": sha256, "Content-Length": str(size)},
        )
        return WeightVersion.model_validate_json(r.content)

    def pull(self, n: int, step: int, wait_s: float = 0.0) -> PullReply:
        """Up to `n` groups for `step`; with `wait_s`, the broker holds the call until some are
        ready. Retries carry one request id, so a retry whose first answer was lost gets the
        same groups instead of leaving them leased to nobody."""
        body = PullRequest(n=n, step=step, request_id=uuid.uuid4().hex, wait_s=wait_s)
        return self._post("/v1/batches/pull", body, PullReply)

    def rewind(self, step: int, consumed: list[int]) -> RewindReply:
        """Resume: tell the broker where the trainer's checkpoint left off."""
        return self._post(
            "/v1/trainer/rewind", RewindRequest(step=step, consumed=consumed), RewindReply
        )

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """The step's numbers as the trainer logged them, for the broker's dashboard."""
        self._post(
            "/v1/trainer/metrics", TrainerMetrics(step=step, metrics=metrics), TrainerMetricsReply
        )

    def audit(self, report: AuditReport) -> dict[str, str]:
        """Report the trainer's log-prob check of consumed groups; returns the samplers it
        quarantined (id -> why)."""
        return self._post("/v1/trainer/audit", report, AuditReply).quarantined

    def ack(
        self,
        job_ids: list[int],
        step: int,
        train_s: float | None = None,
        tokens: int | None = None,
        idle_s: float | None = None,
    ) -> int:
        """The step's groups are consumed; `train_s`, `tokens` and `idle_s`, its compute
        seconds, completion tokens and seconds blocked on its groups, feed the broker's
        capacity figures (and cost-aware activation)."""
        body = AckRequest(job_ids=job_ids, step=step, train_s=train_s, tokens=tokens, idle_s=idle_s)
        return self._post("/v1/batches/ack", body, AckReply).consumed

    # -- auditor role (the trainer's token) -----------------------------------------------------

    def lease_audits(self, auditor: str, n: int, wait_s: float = 0.0) -> AuditLease:
        """Up to `n` consumed groups of one version that nobody has audited; with `wait_s`,
        the broker holds the call until some are due."""
        body = AuditLeaseRequest(auditor=auditor, n=n, wait_s=wait_s)
        return self._post("/v1/audits/lease", body, AuditLease)


def _reason(r: httpx.Response) -> str:
    try:
        detail = r.json().get("detail", r.text)
    except ValueError:
        return r.text[:500]
    return detail if isinstance(detail, str) else str(detail)[:500]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
