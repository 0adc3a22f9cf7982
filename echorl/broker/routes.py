"""The broker's routes, on one APIRouter over the shared `BrokerState`.

    enrolment: POST /v1/samplers (register: returns the sampler's own credential)
    sampler:   POST /v1/samplers/{id}/heartbeat, /v1/samplers/{id}/leave,
               POST /v1/jobs/lease, /v1/rollouts, /v1/rollouts/batch,
               GET /v1/weights/latest, /v1/versions/{v}, /v1/weights/{v} (download)
    trainer:   POST /v1/trainer/hello, /v1/batches/pull, /v1/batches/ack, /v1/trainer/rewind,
               PUT /v1/weights/{v} (publish), GET /v1/status, POST /v1/samplers/{id}/revoke
    auditor:   POST /v1/audits/lease, /v1/trainer/audit; the weights (the trainer's token)
    anyone with a token: GET /v1/run;   no token: /healthz, /metrics

Routes validate, authorise and delegate: state to `BrokerStore`, bytes to `WeightStore`,
rewards to the task's verifier. Errors are raised from the `ProtocolError` tree and
answered, with their status and reason, by one handler in `app.py`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TypeVar

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from echorl.broker.auth import ANYONE, ENROL, SAMPLER, TRAINER, Caller, new_credential
from echorl.broker.intake import Parsed
from echorl.broker.state import BrokerState
from echorl.protocol import (
    MAX_ID,
    AckReply,
    AckRequest,
    Arrival,
    AuditLease,
    AuditLeaseRequest,
    AuditReply,
    AuditReport,
    BadRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseReply,
    LeaseRequest,
    LeaveReply,
    LostRequest,
    NotFound,
    OperatorReply,
    OperatorRequest,
    ProtocolError,
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
    SourceRequest,
    StatusReply,
    TrainerHello,
    TrainerMetrics,
    TrainerMetricsReply,
    WeightSource,
    WeightVersion,
)

log = logging.getLogger("echorl.broker")
M = TypeVar("M", bound=BaseModel)


def body_schema(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that parses its body itself."""
    schema = {"schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}
    return {"requestBody": {"required": True, "content": {"application/json": schema}}}


router = APIRouter()
SamplerId = PathParam(max_length=64)
Version = PathParam(ge=0, le=MAX_ID)


async def state(request: Request) -> BrokerState:  # async: no hop to a thread
    return request.app.state.broker


State = Depends(state)


@router.get("/healthz")
async def healthz() -> dict:  # async: answered on the loop, never queued for a thread
    """Liveness: answered on the event loop, never queued behind work."""
    return {"ok": True}


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(st: BrokerState = State) -> str:
    """Prometheus metrics (text format)."""
    counts = st.store.sampler_counts()
    for state in ("alive", "lost", "left", "revoked", "quarantined"):
        st.metrics.samplers.labels(state).set(counts.get(state, 0))
    return generate_latest(st.metrics.registry).decode()


@router.get("/v1/run", dependencies=[ANYONE])
def run_info(st: BrokerState = State) -> RunInfo:
    """The run a sampler joins: task, tokenizer fingerprint, mode, group size, latest version."""
    return st.run_info()


# -- samplers ---------------------------------------------------------------------------------


@router.post("/v1/samplers")
async def register(
    info: SamplerInfo, request: Request, caller: Caller = ENROL, st: BrokerState = State
) -> RegisterReply:
    """A sampler joins (with its enrolment token): its id and secret, and the run's settings."""
    st.check_peer("sampler", info.tokenizer, info.task)
    address = request.client.host if request.client else ""
    if info.peer_url:
        st.check_peer_url(info.peer_url, address)
    st.may_register(caller.operator, address)
    credential, secret = new_credential()
    sampler_id = await st.write(
        st.store.register,
        info,
        time.time(),
        secret,
        st.cfg.broker.max_samplers,
        caller.operator,
        address,
    )
    st.auth.admit(sampler_id, secret)
    st.standing.joined(sampler_id, caller.operator)
    log.info(
        "sampler %s registered: %s (%s)%s",
        sampler_id,
        info.name,
        info.hardware,
        f" for operator {caller.operator}" if caller.operator else "",
    )
    b = st.cfg.broker
    return RegisterReply(
        sampler_id=sampler_id,
        credential=credential,
        heartbeat_s=min(b.sampler_timeout, b.lease_silence_s) / 3,
        max_body_bytes=b.max_body_bytes,
        peer_secret=st.fanout.join(sampler_id, info.peer_url) if info.peer_url else None,
    )


# The samplers' routes are async and write through the writer's samplers lane: however many
# calls a swarm makes, they never take the server's threads from the trainer's routes.


@router.post("/v1/samplers/{sampler_id}/heartbeat")
async def heartbeat(
    body: HeartbeatRequest,
    sampler_id: str = SamplerId,
    caller: Caller = SAMPLER,
    st: BrokerState = State,
) -> HeartbeatReply:
    """A sampler is alive; the reply says the latest version (and where to fetch it)."""
    caller.acts_as(sampler_id)
    now = time.time()
    held, foreign = body.version_held, st.foreign(body)
    await st.write(st.store.heartbeat, sampler_id, now, held, foreign)
    if not foreign:
        st.pace.told(sampler_id, body.fetch_s)  # its own account's
        if body.fetch_s is not None:  # told once, as it has loaded the version
            st.board.arrived(held, sampler_id, now, body.fetch_s)
    if not foreign and st.standing.trusted(sampler_id):  # one unproven word moves nothing
        st.pace.fetched(body.version_held, body.fetch_s, sampler_id)
        if body.fetch_s is not None:
            st.metrics.dissemination.observe(body.fetch_s)
    return HeartbeatReply(latest_version=st.store.latest_version())


@router.post("/v1/samplers/{sampler_id}/leave")
async def leave(
    sampler_id: str = SamplerId, caller: Caller = SAMPLER, st: BrokerState = State
) -> LeaveReply:
    """A sampler leaves: its leases go back to the queue at once."""
    caller.acts_as(sampler_id)
    returned = await st.write(st.store.leave, sampler_id)
    st.auth.forget(sampler_id)
    st.fanout.forget(sampler_id)
    if returned:
        st.jobs_bell.ring()
    return LeaveReply(returned=returned)


@router.post("/v1/operators", dependencies=[TRAINER])
def enrol(body: OperatorRequest, st: BrokerState = State) -> OperatorReply:
    """The admin's: an enrolment token of `name`'s own (shown once). What the audit finds of
    its samplers, and what their hoarding costs, stays with it across identities."""
    token, secret = new_credential()
    st.store.add_operator(body.name, secret, time.time())
    st.auth.operators[secret] = body.name
    log.info("operator %s enrolled", body.name)
    return OperatorReply(name=body.name, token=token)


@router.post("/v1/samplers/lost", dependencies=[TRAINER])
def lost(body: LostRequest, st: BrokerState = State) -> RevokeReply:
    """The admin's (a supervisor that saw its child die): the alive samplers of this name are
    lost now, their leases returned at once, not a lease_silence_s later."""
    returned = st.store.lost_by_name(body.name, time.time())
    if returned:
        st.jobs_bell.ring()
    log.warning(
        "sampler %s died (its supervisor says); %d leased jobs returned", body.name, returned
    )
    return RevokeReply(returned=returned)


@router.post("/v1/samplers/{sampler_id}/revoke", dependencies=[TRAINER])
def revoke(sampler_id: str = SamplerId, st: BrokerState = State) -> RevokeReply:
    """The admin's: this sampler's credential is refused from now on, its leases returned."""
    returned = st.store.revoke(sampler_id)
    st.auth.forget(sampler_id, revoked=True)
    st.fanout.forget(sampler_id)
    st.jobs_bell.ring()
    log.warning("sampler %s revoked; %d leased jobs returned", sampler_id, returned)
    return RevokeReply(returned=returned)


@router.post("/v1/jobs/lease")
async def lease(
    body: LeaseRequest, caller: Caller = SAMPLER, st: BrokerState = State
) -> LeaseReply:
    """Jobs (prompts to answer G times) for a sampler, within the protocol's budget and its standing."""
    caller.acts_as(body.sampler_id)
    b, g = st.cfg.broker, st.cfg.train.group_size
    max_held = b.max_leased_per_sampler or st.cfg.train.batch_prompts
    foreign = st.foreign(body)

    def attempt():
        now = time.time()
        st.store.heartbeat(body.sampler_id, now, body.version_held, foreign)
        if st.activation.is_parked(body.sampler_id):  # until woken (a ring) or the wait ends
            return []
        return st.store.lease(
            body.sampler_id,
            body.n,
            g,
            now,
            b.lease_seconds,
            admit=st.admission,
            max_held=max_held,
            probation=st.probation,
            by_speed=b.lease_by_speed,
            fastest=st.activation.fastest,
        )

    jobs = await st.jobs_bell.poll(body.wait_s, attempt, st.writer.samplers)
    # Read after the lease: at least the version its admission budget was computed with.
    version = st.store.latest_version()
    parked = not jobs and st.activation.is_parked(body.sampler_id)
    return LeaseReply(
        jobs=jobs, latest_version=version, latest=st.stored_version(version), parked=parked
    )


async def arrivals(request: Request, st: BrokerState, many: bool) -> Parsed:
    """The push's groups, parsed in a parser process (`broker/intake.py`: a big body never
    holds up the event loop); invalid: 422 with the reasons, as for every other route."""
    parsed = await st.parser.parse(await request.body(), many)
    if isinstance(parsed, list):
        raise RequestValidationError(parsed)
    return parsed


@router.post("/v1/rollouts", openapi_extra=body_schema(PushRequest))
async def push(request: Request, caller: Caller = SAMPLER, st: BrokerState = State) -> PushReply:
    """Stored durably and answered at once; the verifier pool scores it later."""
    sampler_id, (group,) = await arrivals(request, st, many=False)
    caller.acts_as(sampler_id)
    now = time.time()
    try:
        seed = await st.write(st.store.push, sampler_id, group, now)
    except ProtocolError:
        await st.write(st.store.refused_push, sampler_id)  # the push wrote nothing: counted apart
        raise
    if seed is not None:
        st.verify_later(seed, now, group, st.standing.turn(sampler_id))
    return PushReply(stored=seed is not None)


@router.post("/v1/rollouts/batch", openapi_extra=body_schema(PushManyRequest))
async def push_many(
    request: Request, caller: Caller = SAMPLER, st: BrokerState = State
) -> PushManyReply:
    """Many groups, one transaction; each is accepted or refused on its own."""
    sampler_id, groups = await arrivals(request, st, many=True)
    caller.acts_as(sampler_id)
    now = time.time()
    sized = [g for g in groups if isinstance(g, Arrival)]
    results = {
        job_id: PushResult(job_id=job_id, stored=False, refused=why)
        for job_id, why in (g for g in groups if not isinstance(g, Arrival))
    }
    if len(sized) < len(groups):  # refused before the store: counted apart
        await st.write(st.store.refused_push, sampler_id, len(groups) - len(sized))
    outcome = await st.write(st.store.push_many, sampler_id, sized, now)
    for group, ok in zip(sized, outcome):
        if isinstance(ok, int):
            st.verify_later(ok, now, group, st.standing.turn(sampler_id))
        refused = ok if isinstance(ok, str) else None
        results[group.job_id] = PushResult(
            job_id=group.job_id, stored=isinstance(ok, int), refused=refused
        )
    order = [g.job_id if isinstance(g, Arrival) else g[0] for g in groups]
    return PushManyReply(results=[results[job_id] for job_id in order])


# -- trainer ----------------------------------------------------------------------------------


@router.post("/v1/trainer/hello", dependencies=[TRAINER])
def hello(body: TrainerHello, st: BrokerState = State) -> RunInfo:
    """The trainer's check at start: its tokenizer, task and batch shape are the run's."""
    st.check_peer("trainer", body.tokenizer, body.task)
    t = st.cfg.train
    if (body.batch_prompts, body.group_size) != (t.batch_prompts, t.group_size):
        raise ProtocolError(
            f"the trainer's batch is {body.batch_prompts}x{body.group_size}, the broker's "
            f"{t.batch_prompts}x{t.group_size} (train.batch_prompts x train.group_size): "
            "give trainer and broker one config"
        )
    return st.run_info()


@router.post("/v1/batches/pull", dependencies=[TRAINER], response_model=PullReply)
async def pull(body: PullRequest, st: BrokerState = State) -> Response:
    """The trainer's batch: up to n scored groups within the staleness bound (a long poll)."""
    b, batch = st.cfg.broker, st.cfg.train.batch_prompts
    if body.n > batch:
        raise ProtocolError(
            f"pull of {body.n} groups, but this broker admits batches of "
            f"train.batch_prompts = {batch}: give trainer and broker one config"
        )
    window = (
        {"version": body.step} if b.mode == "sync" else {"min_version": body.step - b.max_staleness}
    )
    n_dropped, t0 = 0, time.monotonic()

    def attempt():
        nonlocal n_dropped
        groups, n = st.store.pull(
            body.n,
            time.time(),
            b.trainer_lease_seconds,
            request_id=body.request_id,
            raw=True,
            **window,
        )
        n_dropped += n
        return groups

    groups = await st.groups_bell.poll(body.wait_s, attempt, st.writer.trainer)
    st.metrics.dropped.inc(n_dropped)
    st.metrics.trainer_wait.observe(time.monotonic() - t0)
    # The groups as stored (validated when pushed): a PullReply, written without re-encoding.
    reply = (
        f'{{"groups":[{",".join(groups)}],"dropped_stale":{n_dropped},'
        f'"auditors":{st.auditors_alive()},"wasted_tokens":{st.store.wasted_tokens},'
        f'"flat_refilled":{st.store.flat_refilled},'
        f'"verifier_failures":{sum(st.verifier.failures.values())},'
        f'"verifier_error":{json.dumps(st.verifier.first_error)}}}'
    )
    return Response(reply, media_type="application/json")


@router.post("/v1/batches/ack", dependencies=[TRAINER])
async def ack(body: AckRequest, st: BrokerState = State) -> AckReply:
    """The trainer consumed these groups at this step: they are never served again."""
    consumed = await st.for_trainer(st.store.ack, body.job_ids, body.step)
    if consumed:
        origins = await st.for_trainer(st.store.origins, body.job_ids)
        for version, operator, _ in origins:
            st.metrics.staleness.observe(body.step - version)
            st.metrics.consumed.labels(operator).inc()
        st.board.stepped(body.step, origins)
    if consumed and body.train_s is not None and body.tokens is not None:
        st.pace.step(body.train_s, body.tokens, time.time(), body.idle_s)
    if consumed:
        st.audits_bell.ring()
    return AckReply(consumed=consumed)


@router.post("/v1/trainer/metrics", dependencies=[TRAINER])
async def trainer_metrics(body: TrainerMetrics, st: BrokerState = State) -> TrainerMetricsReply:
    """The trainer's numbers of a step, as it logged them (the dashboard's training view)."""
    await st.for_trainer(st.store.trainer_logged, body.step, body.metrics)
    return TrainerMetricsReply(step=body.step)


@router.post("/v1/trainer/audit", dependencies=[TRAINER])
def audit(body: AuditReport, st: BrokerState = State) -> AuditReply:
    """The log-prob check of consumed groups, by the trainer or an auditor; may quarantine
    their samplers."""
    return AuditReply(quarantined=st.audit(body.groups, body.step))


@router.post("/v1/audits/lease", dependencies=[TRAINER], response_model=AuditLease)
async def lease_audits(body: AuditLeaseRequest, st: BrokerState = State) -> Response:
    """An auditor's long poll: consumed groups of one version, to check under its weights."""
    st.auditors[body.auditor] = time.time()
    version = None

    def attempt():
        nonlocal version
        version, groups = st.lease_audits(body.n)
        return groups

    groups = await st.audits_bell.poll(body.wait_s, attempt, st.writer.samplers)
    st.auditors[body.auditor] = time.time()
    reply = (
        f'{{"version":{"null" if version is None else version},"groups":[{",".join(groups)}],'
        f'"latest_version":{st.store.latest_version()}}}'
    )
    return Response(reply, media_type="application/json")


@router.post("/v1/trainer/rewind", dependencies=[TRAINER])
def rewind(body: RewindRequest, st: BrokerState = State) -> RewindReply:
    """A resumed trainer forgets the versions and groups after its checkpoint."""
    keep = body.step if st.weights.has(body.step) else body.step - 1
    reply = RewindReply(**st.store.rewind(body.step, set(body.consumed), keep))
    st.weights.forget_after(reply.latest_version)
    st.board.rewind(body.step)
    st.metrics.latest.set(reply.latest_version)
    st.jobs_bell.ring()
    st.groups_bell.ring()
    log.warning("trainer resumed at step %d: %s", body.step, reply)
    return reply


@router.put("/v1/weights/{version}", dependencies=[TRAINER])
async def publish(
    request: Request, version: int = Version, st: BrokerState = State
) -> WeightVersion:
    """The trainer uploads version v's weights (safetensors, streamed; sha256 checked)."""
    sha256 = request.headers.get("x-sha256", "")
    if len(sha256) != 64:
        raise BadRequest("header X-Sha256 with the upload's hex sha256 is required")
    latest = st.store.latest_version()
    if version == latest and st.weights.is_stored_upload(version, sha256):
        return st.weights.describe(version)  # a retry whose first answer was lost: stored
    if version != latest + 1:
        raise ProtocolError(f"version {version} is not the next one (latest is {latest})")
    try:
        await st.weights.receive(version, sha256, request.stream())
    except ClientDisconnect:  # the trainer died mid-upload: nothing was stored
        log.warning("the upload of version %d broke off; nothing stored", version)
        raise BadRequest(f"the upload of version {version} broke off; nothing stored") from None
    cancelled, dropped = st.store.set_latest_version(
        version, cancel_older=st.cfg.broker.mode == "sync"
    )
    if cancelled or dropped:  # sync: work for the old version can never be consumed now
        st.metrics.cancelled.inc(cancelled)
        st.metrics.dropped.inc(dropped)
        log.info("version %d: %d jobs cancelled, %d groups dropped", version, cancelled, dropped)
    st.metrics.latest.set(version)
    st.jobs_bell.ring()  # a new version admits more jobs
    st.audits_bell.ring()  # and makes an older one final
    st.retain_weights(version)
    described = st.weights.describe(version)
    st.board.publish(described, time.time())
    return described


# -- weights, for samplers --------------------------------------------------------------------


@router.get("/v1/weights/latest", dependencies=[SAMPLER])
def latest_weights(st: BrokerState = State) -> WeightVersion:
    """The latest version's metadata (number, sha256, size, LoRA)."""
    version = st.store.latest_version()
    if version < 0:
        raise NotFound("no version published yet")
    return st.weights.describe(version)


@router.get("/v1/versions/{version}", dependencies=[SAMPLER])
def describe(version: int = Version, st: BrokerState = State) -> WeightVersion:
    """One version's metadata."""
    return st.weights.describe(version)


@router.post("/v1/versions/{version}/source")
def source(
    body: SourceRequest, version: int = Version, caller: Caller = SAMPLER, st: BrokerState = State
) -> WeightSource:
    """Where this sampler fetches `version`: the broker or a peer (broker/fanout.py)."""
    info = st.weights.describe(version)  # 404 for a version not stored
    asker = caller.sampler_id or "@trainer"  # an auditor: the trainer's token
    return st.fanout.source(version, info.sha256, asker, body.failed, info.size_bytes, body.took)


class WeightsResponse(FileResponse):
    chunk_size = 1 << 20  # weights are large: fewer, bigger writes than the default 64 KiB


@router.get("/v1/weights/{version}/delta", dependencies=[SAMPLER])
def download_delta(version: int = Version, st: BrokerState = State) -> FileResponse:
    """`version` as a delta against its `delta_base` (404 where it has none)."""
    return FileResponse(st.weights.delta_file(version), media_type="application/octet-stream")


@router.get("/v1/weights/{version}", dependencies=[SAMPLER])
def download(version: int = Version, st: BrokerState = State) -> FileResponse:
    """A version's weights (safetensors; HTTP ranges resume a cut download)."""
    info = st.weights.describe(version)
    return WeightsResponse(
        st.weights.file(version),
        media_type="application/octet-stream",
        headers={"X-Sha256": info.sha256},
    )


@router.get("/v1/status", dependencies=[TRAINER])
def status(limit: int = Query(100, ge=0, le=100_000), st: BrokerState = State) -> StatusReply:
    """The swarm at a glance: samplers counted by state and the `limit` most relevant listed
    (alive first), versions, jobs, the buffer, the verifiers."""
    return st.status_reply(limit)
