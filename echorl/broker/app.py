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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from echorl.broker.routes import router
from echorl.broker.state import BrokerState, SetupError, build_state
from echorl.config import RunConfig
from echorl.protocol import ProtocolError, Unauthorized

__all__ = ["SetupError", "create_app"]


def create_app(cfg: RunConfig) -> FastAPI:
    """The broker for `cfg`; raises SetupError (one line) when it cannot serve the run."""
    st = build_state(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        st.jobs_bell.loop = st.groups_bell.loop = asyncio.get_running_loop()
        reaper = asyncio.create_task(expire_forever(st))
        yield
        reaper.cancel()
        st.verifier.close()
        st.store.close()

    app = FastAPI(title="echorl broker", version="1", lifespan=lifespan)
    app.state.broker = st
    app.middleware("http")(limit_body)
    app.add_exception_handler(ProtocolError, protocol_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.include_router(router)
    return app


async def expire_forever(st: BrokerState) -> None:
    """Once a second: lost samplers' and expired leases go back to the queue, and pulled
    groups whose trainer lease ran out are ready again (each wakes its long polls)."""
    while True:
        await asyncio.sleep(1.0)
        b = st.cfg.broker
        returned, _ = st.store.expire(time.time(), b.sampler_timeout, b.lease_seconds)
        if returned:
            st.jobs_bell.ring()
        st.groups_bell.ring()


async def limit_body(request: Request, call_next):
    b = request.app.state.broker.cfg.broker
    size = request.headers.get("content-length")
    limit = b.max_weights_bytes if request.url.path.startswith("/v1/weights/") else b.max_body_bytes
    if size is not None and (not size.isdigit() or int(size) > limit):
        return JSONResponse({"detail": f"body of {size} bytes exceeds the limit of {limit}"}, 413)
    return await call_next(request)


async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
    return JSONResponse({"detail": str(exc)}, status_code=exc.status, headers=headers)


async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    # Reasons only, never the input echoed back: it may hold NaN (not JSON) or be huge.
    reasons = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return JSONResponse({"detail": "; ".join(reasons)[:2000]}, status_code=422)
