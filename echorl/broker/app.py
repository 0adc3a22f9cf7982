"""The broker's HTTP service (FastAPI): versioned routes under /v1, bearer-token roles.

    echorl broker -c run.toml --data-dir runs/broker --port 8000

`create_app` checks the run (task, tokenizer, first job; `SetupError` says what
is wrong), then wires the routes (`routes.py`) over the shared state
(`state.py`), the body-size limit, the long polls' reaper, and one handler that
answers every error of the `ProtocolError` tree with its status and reason:

    ProtocolError 409 (a state conflict)   NotFound 404       Unprocessable 422
    TooLarge 413      BadRequest 400        Unauthorized 401   Forbidden 403

A malformed body is 422 with the reasons (never the input echoed back).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from echorl.broker.dashboard import ui
from echorl.broker.routes import router
from echorl.broker.state import BrokerState, SetupError, build_state
from echorl.config import RunConfig
from echorl.protocol import ProtocolError, TooMany, Unauthorized

__all__ = ["SetupError", "create_app"]


def create_app(cfg: RunConfig, read_only: bool = False) -> FastAPI:
    """The broker for `cfg`; raises SetupError (one line) when it cannot serve the run.
    `read_only`: a finished run's broker, to look at (`echorl dashboard`): its store opened
    read-only, nothing expired, every call but a GET refused (405)."""
    st = build_state(cfg, read_only)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        st.jobs_bell.loop = st.groups_bell.loop = st.audits_bell.loop = loop
        reaper = None if read_only else asyncio.create_task(expire_forever(st))
        yield
        if reaper is not None:
            reaper.cancel()
        st.parser.close()
        st.verifier.close()  # its last verdicts go through the writer
        st.writer.close()
        st.store.close()

    app = FastAPI(title="echorl broker", version="1", lifespan=lifespan)
    app.state.broker = st
    app.state.read_only = read_only
    app.add_middleware(Gate)
    app.add_exception_handler(ProtocolError, protocol_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.include_router(router)
    app.include_router(ui)
    return app


ACTIVATE_EVERY = 2  # seconds between cost-aware activation's looks (broker.activation)


async def expire_forever(st: BrokerState) -> None:
    """Once a second: lost samplers' and expired leases go back to the queue, and pulled
    groups whose trainer lease ran out are ready again, and auditors' leases that ran out
    can be taken again (each wakes its long polls); every ACTIVATE_EVERY s, priced samplers
    are parked or woken (`broker.activation`)."""
    tick = 0
    while True:
        await asyncio.sleep(1.0)
        b = st.cfg.broker
        expire = st.store.expire
        returned, _ = await st.write(
            expire, time.time(), b.sampler_timeout, b.lease_seconds, b.lease_silence_s
        )
        if returned:
            st.jobs_bell.ring()
        for sampler_id in await st.write(st.store.prune, time.time(), b.sampler_retention_s):
            st.auth.forget(sampler_id)
            st.standing.forget(sampler_id)
        st.groups_bell.ring()
        st.audits_bell.ring()
        if b.activation == "cheapest" and (tick := tick + 1) % ACTIVATE_EVERY == 0:
            await asyncio.to_thread(st.activate)


PUSHES = ("/v1/rollouts", "/v1/rollouts/batch")


class Gate:
    """Before any route reads a byte of the body: every /v1 call carries a token somebody
    holds (401 otherwise), a sampler calls no more often than `broker.sampler_calls_per_s`
    (429), and no body exceeds the limit (413), whether it announces its length or streams
    it chunked (counted as it arrives). A push's bytes are held against the sampler's and
    everyone's bound (`Intake`: 429 beyond, the body unread), the push is read whole, then
    waits for one of `broker.push_slots`: however many samplers push at once, only so many
    are in progress, so the event loop stays quick for the trainer and the leases (and a
    push on a slow link holds no slot while it uploads)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = scope["app"].state.broker
        if scope["app"].state.read_only and scope["method"] not in ("GET", "HEAD"):
            why = "this broker shows a finished run (echorl dashboard): it changes nothing"
            return await JSONResponse({"detail": why}, 405)(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        b = st.cfg.broker
        limit = b.max_weights_bytes if path.startswith("/v1/weights/") else b.max_body_bytes
        size = headers.get(b"content-length", b"").decode("latin-1")
        if size and (not size.isdigit() or int(size) > limit):
            return await too_large(f"body of {size} bytes exceeds", limit)(scope, receive, send)
        who = "trainer"
        if path.startswith("/v1/"):
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            try:
                caller = st.auth.identify(token if scheme.lower() == "bearer" and token else None)
            except Unauthorized as e:
                reply = JSONResponse({"detail": str(e)}, 401, {"WWW-Authenticate": "Bearer"})
                return await reply(scope, receive, send)
            if caller.sampler_id is not None:
                who = caller.sampler_id
                if wait := st.calls.take(who, time.monotonic()):
                    why = f"sampler {who} calls more often than broker.sampler_calls_per_s"
                    return await too_many(why, wait)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, f"body exceeds the limit of {limit} bytes")
            return message

        if path not in PUSHES:
            return await self.app(scope, counted, send)
        # A body that says its length holds all of it before a byte is read; a chunked one,
        # each chunk as it arrives.
        held = int(size) if size else 0
        if not st.intake.take(who, held):
            return await too_many(BUSY, 1.0)(scope, receive, send)
        read = []
        try:
            while not read or read[-1].get("more_body", False):
                read.append(await counted())
                if read[-1]["type"] != "http.request":  # the client went away
                    break
                if not size:
                    chunk = len(read[-1].get("body", b""))
                    if not st.intake.take(who, chunk):
                        return await too_many(BUSY, 1.0)(scope, receive, send)
                    held += chunk

            async def replay():
                return read.pop(0) if read else await receive()

            async with st.push_slots:
                await self.app(scope, replay, send)
        except HTTPException:
            return await too_large("body exceeds", limit)(scope, receive, send)
        finally:
            read.clear()
            st.intake.give(who, held)


BUSY = (
    "push bodies in flight exceed what this sampler or the broker may hold "
    "(broker.push_bytes_per_sampler, broker.push_bytes_in_flight); try again"
)


def too_many(why: str, retry_after: float) -> JSONResponse:
    return JSONResponse({"detail": why}, 429, {"Retry-After": str(max(1, round(retry_after)))})


def too_large(what: str, limit: int) -> JSONResponse:
    return JSONResponse({"detail": f"{what} the limit of {limit} bytes"}, 413)


async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
    if isinstance(exc, TooMany) and exc.retry_after is not None:
        headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
    return JSONResponse({"detail": str(exc)}, status_code=exc.status, headers=headers)


async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    # Reasons only, never the input echoed back: it may hold NaN (not JSON) or be huge.
    reasons = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return JSONResponse({"detail": "; ".join(reasons)[:2000]}, status_code=422)
