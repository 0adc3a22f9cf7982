"""The broker's HTTP service (FastAPI): versioned routes under /v1, bearer-token roles.

    echorl broker --data-dir runs/broker --port 8000 --insecure-no-auth

Routes (role): register, heartbeat, lease, push, download weights (sampler);
publish weights, pull, ack (trainer); status, healthz, metrics (anyone with a
token). The app validates, authorises, re-scores rollouts with its own copy of
the task verifier and delegates state to `BrokerStore`; `ProtocolError` becomes
409 with its reason, a malformed body 422, an oversized one 413.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import safetensors
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from echorl.broker.scoring import score_group
from echorl.broker.store import Admission, BrokerStore
from echorl.config import RunConfig
from echorl.models.tokenizer import byte_tokenizer
from echorl.protocol import (
    MAX_ID,
    AckRequest,
    HeartbeatRequest,
    LeaseReply,
    LeaseRequest,
    ProtocolError,
    PulledGroup,
    PullReply,
    PullRequest,
    PushManyReply,
    PushManyRequest,
    PushReply,
    PushRequest,
    PushResult,
    RegisterReply,
    RewindReply,
    RewindRequest,
    RolloutGroup,
    SamplerInfo,
    WeightVersion,
)
from echorl.tasks import get_task

log = logging.getLogger("echorl.broker")
T = TypeVar("T")


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

    async def poll(self, wait_s: float, attempt: Callable[[], T]) -> T:
        """Run `attempt` (blocking, on a worker thread) until it returns something non-empty,
        trying again after each ring; after `wait_s` without a ring, the last result stands."""
        deadline = time.monotonic() + wait_s
        while True:
            rung = self.event  # taken before the attempt: a ring during it is not missed
            result = await asyncio.to_thread(attempt)
            left = deadline - time.monotonic()
            if result or left <= 0:
                return result
            try:
                await asyncio.wait_for(rung.wait(), left)
            except TimeoutError:
                return result


def _tokens(cfg: RunConfig) -> dict[str, str]:
    """role -> token, from config or environment; never logged."""
    tokens = {
        "trainer": cfg.broker.trainer_token or os.environ.get("ECHORL_TRAINER_TOKEN"),
        "sampler": cfg.broker.sampler_token or os.environ.get("ECHORL_SAMPLER_TOKEN"),
    }
    if not cfg.broker.insecure_no_auth and not all(tokens.values()):
        raise ValueError(
            "broker.trainer_token and broker.sampler_token are required "
            "(or set ECHORL_TRAINER_TOKEN / ECHORL_SAMPLER_TOKEN, or --insecure-no-auth)"
        )
    return {k: v for k, v in tokens.items() if v}


def create_app(cfg: RunConfig) -> FastAPI:
    b = cfg.broker
    data = Path(b.data_dir)
    (data / "weights").mkdir(parents=True, exist_ok=True)
    task = get_task(cfg.task.name)
    tokenizer = byte_tokenizer()
    store = BrokerStore(
        data / "broker.sqlite",
        task.name,
        task.problem,
        run_seed=cfg.task.seed,
        vocab_size=tokenizer.get_vocab_size(),
        synchronous=b.synchronous,
        max_attempts=b.max_attempts,
    )
    tokens = _tokens(cfg)
    registry = CollectorRegistry()
    pushed = Counter("broker_groups_pushed", "groups accepted", registry=registry)
    dropped = Counter(
        "broker_groups_dropped_stale", "groups dropped as too stale", registry=registry
    )
    latest = Gauge("broker_latest_version", "newest published policy version", registry=registry)
    latest.set(store.latest_version())
    # Long polls: samplers wait for admitted jobs (a new version, a returned lease), the
    # trainer for ready groups (a push, an expired pull).
    jobs_bell, groups_bell = Bell(), Bell()

    async def expiry_loop():
        while True:
            await asyncio.sleep(1.0)
            returned, _ = store.expire(time.time(), b.sampler_timeout)
            if returned:
                jobs_bell.ring()
            groups_bell.ring()  # pulls whose trainer lease ran out may be ready again

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        jobs_bell.loop = groups_bell.loop = asyncio.get_running_loop()
        reaper = asyncio.create_task(expiry_loop())
        yield
        reaper.cancel()
        store.close()

    app = FastAPI(title="echorl broker", version="1", lifespan=lifespan)
    app.state.store = store
    bearer = HTTPBearer(auto_error=False)

    def role(*allowed: str):
        def check(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
            if b.insecure_no_auth:
                return "trainer"
            if cred is None:
                raise HTTPException(
                    401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"}
                )
            who = next(
                (
                    r
                    for r, t in tokens.items()
                    if hmac.compare_digest(cred.credentials.encode(), t.encode())
                ),
                None,
            )
            if who is None:
                raise HTTPException(401, "unknown token", headers={"WWW-Authenticate": "Bearer"})
            if who not in allowed and who != "trainer":  # the trainer role is also the admin
                raise HTTPException(403, f"the {who} role may not call this route")
            return who

        return Depends(check)

    sampler, trainer = role("sampler"), role("trainer")

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        limit = (
            b.max_weights_bytes if request.url.path.startswith("/v1/weights/") else b.max_body_bytes
        )
        if size is not None and (not size.isdigit() or int(size) > limit):
            return JSONResponse(
                {"detail": f"body of {size} bytes exceeds the limit of {limit}"}, 413
            )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        # Reasons only, never the input echoed back: it may hold NaN (not JSON) or be huge.
        reasons = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        return JSONResponse({"detail": "; ".join(reasons)[:2000]}, status_code=422)

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError):
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        return generate_latest(registry).decode()

    @app.post("/v1/samplers", dependencies=[sampler])
    def register(info: SamplerInfo) -> RegisterReply:
        return RegisterReply(sampler_id=store.register(info, time.time()))

    @app.post("/v1/samplers/{sampler_id}/heartbeat", dependencies=[sampler])
    def heartbeat(body: HeartbeatRequest, sampler_id: str = PathParam(max_length=64)) -> dict:
        store.heartbeat(sampler_id, time.time(), body.version_held, body.tokens_per_s)
        return {"latest_version": store.latest_version()}

    @app.post("/v1/samplers/{sampler_id}/leave", dependencies=[sampler])
    def leave(sampler_id: str = PathParam(max_length=64)) -> dict:
        returned = store.leave(sampler_id)
        if returned:
            jobs_bell.ring()
        return {"returned": returned}

    # Sync is admission with max_staleness 0 and every job pinned to the latest version.
    admit = Admission(
        batch=cfg.train.batch_prompts,
        max_staleness=b.max_staleness if b.mode == "async" else 0,
        pin_version=b.mode == "sync",
    )

    @app.post("/v1/jobs/lease", dependencies=[sampler])
    async def lease(body: LeaseRequest) -> LeaseReply:
        def attempt():
            now = time.time()
            store.heartbeat(body.sampler_id, now, body.version_held, body.tokens_per_s)
            return store.lease(
                body.sampler_id, body.n, cfg.train.group_size, now, b.lease_seconds, admit=admit
            )

        jobs = await jobs_bell.poll(body.wait_s, attempt)
        # Read after the lease: at least the version its admission budget was computed with.
        version = store.latest_version()
        return LeaseReply(jobs=jobs, latest_version=version, latest=_describe(version))

    def _describe(version: int) -> WeightVersion | None:
        try:
            return describe(version) if version >= 0 else None
        except HTTPException:  # forgotten by a rewind just now: the sampler asks again
            return None

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def rescore(group: RolloutGroup) -> list[float]:
        """The broker's own rewards for a group: the sampler's claims are never trusted."""
        seed = store.job_seed(group.job_id)
        return score_group(task, seed, group.completions, encode, decode, cfg.task.format_reward)

    @app.post("/v1/rollouts", dependencies=[sampler])
    def push(body: PushRequest) -> PushReply:
        rewards = rescore(body.group)
        stored = store.push(body.sampler_id, body.group, rewards, time.time())
        if stored:
            pushed.inc()
            groups_bell.ring()
        return PushReply(stored=stored, rewards=rewards)

    @app.post("/v1/rollouts/batch", dependencies=[sampler])
    def push_many(body: PushManyRequest) -> PushManyReply:
        """Many groups, one transaction; each is accepted or refused on its own."""
        scored, results = [], {}
        for group in body.groups:
            try:
                scored.append((group, rescore(group)))
            except ProtocolError as e:  # an unknown job
                results[group.job_id] = PushResult(
                    job_id=group.job_id, stored=False, refused=str(e)
                )
        outcome = store.push_many(body.sampler_id, scored, time.time())
        for (group, rewards), ok in zip(scored, outcome):
            refused = ok if isinstance(ok, str) else None
            results[group.job_id] = PushResult(
                job_id=group.job_id,
                stored=ok is True,
                rewards=None if refused else rewards,
                refused=refused,
            )
        n_stored = sum(r.stored for r in results.values())
        pushed.inc(n_stored)
        if n_stored:
            groups_bell.ring()
        return PushManyReply(results=[results[g.job_id] for g in body.groups])

    @app.post("/v1/batches/pull", dependencies=[trainer])
    async def pull(body: PullRequest) -> PullReply:
        if body.n > cfg.train.batch_prompts:
            raise ProtocolError(
                f"pull of {body.n} groups, but this broker admits batches of "
                f"train.batch_prompts = {cfg.train.batch_prompts}: give trainer and broker one config"
            )
        window = (
            {"version": body.step}
            if b.mode == "sync"
            else {"min_version": body.step - b.max_staleness}
        )
        n_dropped = 0

        def attempt():
            nonlocal n_dropped
            groups, n = store.pull(
                body.n, time.time(), b.trainer_lease_seconds, request_id=body.request_id, **window
            )
            n_dropped += n
            return groups

        groups = await groups_bell.poll(body.wait_s, attempt)
        dropped.inc(n_dropped)
        return PullReply(
            groups=[
                PulledGroup(
                    group=g.group, rewards=g.rewards, sampler_id=g.sampler_id, prompt=g.prompt
                )
                for g in groups
            ],
            dropped_stale=n_dropped,
        )

    @app.post("/v1/batches/ack", dependencies=[trainer])
    def ack(body: AckRequest) -> dict:
        return {"consumed": store.ack(body.job_ids, body.step)}

    @app.post("/v1/trainer/rewind", dependencies=[trainer])
    def rewind(body: RewindRequest) -> RewindReply:
        has_step = (data / "weights" / f"v{body.step}.safetensors").is_file()
        reply = store.rewind(
            body.step, set(body.consumed), body.step if has_step else body.step - 1
        )
        for path in (data / "weights").glob("v*.safetensors"):
            if int(path.stem[1:]) > reply["latest_version"]:
                _forget(path)
        latest.set(reply["latest_version"])
        jobs_bell.ring()
        groups_bell.ring()
        log.warning("trainer resumed at step %d: %s", body.step, reply)
        return RewindReply(**reply)

    @app.put("/v1/weights/{version}", dependencies=[trainer])
    async def publish(request: Request, version: int = PathParam(ge=0, le=MAX_ID)) -> WeightVersion:
        expected = request.headers.get("x-sha256", "")
        if len(expected) != 64:
            raise HTTPException(400, "header X-Sha256 with the upload's hex sha256 is required")
        source_sha = data / "weights" / f"v{version}.upload.sha256"
        if version == store.latest_version() and _read(source_sha) == expected:
            return describe(version)  # a retry whose first answer was lost: already stored
        if version != store.latest_version() + 1:
            raise ProtocolError(
                f"version {version} is not the next one (latest is {store.latest_version()})"
            )
        tmp = data / "weights" / f".upload-{version}"
        digest, size = hashlib.sha256(), 0
        with tmp.open("wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > b.max_weights_bytes:
                    tmp.unlink()
                    raise HTTPException(413, f"weights exceed {b.max_weights_bytes} bytes")
                digest.update(chunk)
                f.write(chunk)
            f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())  # the other routes go on meanwhile
        if digest.hexdigest() != expected:
            tmp.unlink()
            raise HTTPException(400, f"sha256 mismatch: body hashes to {digest.hexdigest()}")
        final = data / "weights" / f"v{version}.safetensors"
        served = expected
        if b.sampler_dtype != "float32":
            try:
                served = await asyncio.to_thread(_cast_safetensors, tmp, final, b.sampler_dtype)
            except (safetensors.SafetensorError, ValueError, OSError) as e:
                raise HTTPException(
                    400, f"cannot cast the upload to {b.sampler_dtype}: {e}"
                ) from None
            finally:
                tmp.unlink(missing_ok=True)
        else:
            tmp.replace(final)
        (data / "weights" / f"v{version}.sha256").write_text(served)
        source_sha.write_text(expected)
        store.set_latest_version(version)
        latest.set(version)
        jobs_bell.ring()  # a new version admits more jobs
        _retain(data / "weights", version, b.keep_versions, store.referenced_versions())
        return WeightVersion(
            version=version, sha256=served, size_bytes=final.stat().st_size, dtype=b.sampler_dtype
        )

    def stored(version: int) -> Path:
        path = data / "weights" / f"v{version}.safetensors"
        if not path.is_file():
            raise HTTPException(
                404, f"version {version} is not stored (kept: the last {b.keep_versions})"
            )
        return path

    @app.get("/v1/weights/latest", dependencies=[sampler])
    def latest_weights() -> WeightVersion:
        v = store.latest_version()
        if v < 0:
            raise HTTPException(404, "no version published yet")
        return describe(v)

    @app.get("/v1/versions/{v}", dependencies=[sampler])
    def describe(v: int = PathParam(ge=0, le=MAX_ID)) -> WeightVersion:
        path = stored(v)
        return WeightVersion(
            version=v,
            sha256=(path.with_suffix(".sha256")).read_text(),
            size_bytes=path.stat().st_size,
            dtype=b.sampler_dtype,
        )

    @app.get("/v1/weights/{version}", dependencies=[sampler])
    def download(version: int = PathParam(ge=0, le=MAX_ID)) -> FileResponse:
        path = stored(version)
        return WeightsResponse(
            path,
            media_type="application/octet-stream",
            headers={"X-Sha256": path.with_suffix(".sha256").read_text()},
        )

    @app.get("/v1/status", dependencies=[sampler])
    def status() -> dict:
        rows = store.samplers()
        return {
            "mode": b.mode,
            "latest_version": store.latest_version(),
            "samplers": rows,
            **store.counts(),
        }

    return app


class WeightsResponse(FileResponse):
    chunk_size = 1 << 20  # weights are large: fewer, bigger writes than the default 64 KiB


def _cast_safetensors(src: Path, dst: Path, dtype: str) -> str:
    """Write `src` with every floating tensor cast to `dtype` to `dst`; returns dst's sha256."""
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    tensors = {k: (t.to(target) if t.is_floating_point() else t) for k, t in load_file(src).items()}
    save_file(tensors, dst, metadata={"format": "pt"})
    h = hashlib.sha256(dst.read_bytes())
    return h.hexdigest()


def _retain(folder: Path, newest: int, keep: int, referenced: set[int]) -> None:
    """Delete weight files older than the last `keep` versions, except those still referenced."""
    for path in folder.glob("v*.safetensors"):
        v = int(path.stem[1:])
        if v <= newest - keep and v not in referenced:
            _forget(path)


def _forget(path: Path) -> None:
    """Delete a version's weights and its digests."""
    path.unlink(missing_ok=True)
    path.with_suffix(".sha256").unlink(missing_ok=True)
    path.with_suffix(".upload.sha256").unlink(missing_ok=True)


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None
