"""The dashboard: a read-only page the broker serves at /ui, live over server-sent events.

    http://BROKER:8000/ui?token=TOKEN    # the admin (trainer) token or broker.viewer_token

The token is exchanged once for an HttpOnly cookie scoped to /ui; every part of the page
(its assets too) needs one or the other. What it shows comes from one snapshot, made at
most once a `SNAPSHOT_S` for all viewers together, on a thread of its own: however many
pages are open, the broker does the same bounded work (the status call's, and the trainer's
recent steps kept in memory as they are acknowledged). Samplers and the trainer never wait
on it. Every asset is in the package (`broker/ui/`): no CDN at run time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import Counter, OrderedDict, deque
from importlib import resources

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)

from echorl.protocol import NotFound, ProtocolError, TooMany, Unauthorized, WeightVersion

COOKIE = "echorl_ui"
SNAPSHOT_S = 1.0  # a snapshot is this fresh at most
PUSH_S = 2.0  # each open page gets one this often
MAX_VIEWERS = 32
STEPS_KEPT = 2000  # the trainer's recent steps the training view draws
VERSIONS_SHOWN = 20  # the versions view's timeline
MAX_ARRIVALS = 4096  # samplers timed per version
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}

ui = APIRouter(include_in_schema=False)


class Board:
    """What the dashboard shows, kept by the broker as it happens (the steps the trainer
    acknowledged, the versions published), and the one shared snapshot."""

    def __init__(self) -> None:
        self.steps: deque[dict] = deque(maxlen=STEPS_KEPT)
        # The last VERSIONS_SHOWN versions: published when, how big (full, and as a delta),
        # and each sampler's arrival: {sampler: (seconds after publish, fetch and load s)}.
        self.versions: OrderedDict[int, dict] = OrderedDict()
        self.viewers = 0
        self.lock = threading.Lock()
        self.made_at, self.made = 0.0, b""

    def load(self, store, weights) -> None:
        """The trainer's last `STEPS_KEPT` steps from the store, and the versions still
        stored (published when their file was written): a restarted broker, or one started
        on a finished run's data dir (`echorl dashboard`), draws them too."""
        by_step: dict[int, list] = {}
        for step, version, rewards in store.consumed_tail(STEPS_KEPT):
            by_step.setdefault(step, []).append((version, "", rewards))
        for step in sorted(by_step):
            self.stepped(step, by_step[step], when=None)
        for version in weights.versions()[-VERSIONS_SHOWN:]:
            with contextlib.suppress(ProtocolError, OSError):  # forgotten as we looked
                self.publish(weights.describe(version), weights.file(version).stat().st_mtime)

    def stepped(
        self, step: int, origins: list[tuple[int, str, str]], when: float | None = 0.0
    ) -> None:
        """The trainer acknowledged step `step`'s groups: (version, operator, rewards JSON)."""
        rewards = [r for _, _, js in origins for r in json.loads(js or "[]")]
        versions = [v for v, _, _ in origins]
        self.steps.append(
            {
                "step": step,
                "time": time.time() if when is not None else None,
                "reward": sum(rewards) / len(rewards) if rewards else None,
                "staleness": sum(step - v for v in versions) / len(versions),
                "staleness_max": max(step - v for v in versions),
                "staleness_counts": dict(Counter(step - v for v in versions)),
                "groups": len(origins),
            }
        )

    def rewind(self, step: int) -> None:
        """A resumed trainer forgot what it trained after `step`: so does the board."""
        kept = [s for s in self.steps if s["step"] < step]
        self.steps.clear()
        self.steps.extend(kept)
        for version in [v for v in self.versions if v > step]:
            del self.versions[version]

    def publish(self, described: WeightVersion, when: float) -> None:
        """Version `described` was published at `when`."""
        self.versions[described.version] = {
            "version": described.version,
            "published": when,
            "bytes": described.size_bytes,
            "delta_bytes": described.delta_bytes,
            "arrived": {},
        }
        while len(self.versions) > VERSIONS_SHOWN:
            self.versions.popitem(last=False)

    def arrived(self, version: int | None, sampler_id: str, when: float, fetch_s: float) -> None:
        """Sampler `sampler_id` says at `when` that it loaded `version` in `fetch_s`."""
        v = self.versions.get(version)
        if v is not None and len(v["arrived"]) < MAX_ARRIVALS:
            v["arrived"].setdefault(sampler_id, (round(when - v["published"], 3), fetch_s))

    def snapshot(self, make) -> bytes:
        """The shared snapshot (`make()` builds one), at most `SNAPSHOT_S` old."""
        with self.lock:
            if time.monotonic() - self.made_at >= SNAPSHOT_S:
                self.made, self.made_at = make(), time.monotonic()
            return self.made


def viewer(request: Request) -> str:
    """The caller may look: the admin's or the viewer's token, from the cookie or a bearer
    header; Unauthorized otherwise."""
    token = request.cookies.get(COOKIE)
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    token = token or (bearer if scheme.lower() == "bearer" else None)
    caller = request.app.state.broker.auth.identify(token)
    if caller.role not in ("trainer", "viewer"):
        raise Unauthorized("the dashboard needs the admin token or broker.viewer_token")
    return caller.role


VIEWER = Depends(viewer)


@ui.get("/ui")
def page(request: Request, token: str | None = Query(None, max_length=256)) -> Response:
    if token is not None:  # the token once, for a cookie: it leaves the address bar
        role = request.app.state.broker.auth.identify(token).role  # 401 if nobody's
        if role not in ("trainer", "viewer"):
            raise Unauthorized("the dashboard needs the admin token or broker.viewer_token")
        reply = RedirectResponse("/ui", status_code=303)
        reply.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/ui")
        return reply
    try:
        viewer(request)
    except Unauthorized:
        return HTMLResponse(
            "<!doctype html><title>echorl</title><p>Open <code>/ui?token=TOKEN</code> with the "
            "run's admin token or its <code>broker.viewer_token</code>.</p>",
            status_code=401,
        )
    return HTMLResponse(_asset("index.html"))


@ui.get("/ui/static/{name}", dependencies=[VIEWER])
def asset(name: str) -> Response:
    if name not in ASSETS:
        raise NotFound(f"no asset {name!r}")
    return Response(_asset(name), media_type=ASSETS[name])


@ui.get("/ui/events", dependencies=[VIEWER])
async def events(request: Request) -> StreamingResponse:
    """The snapshot, every `PUSH_S`, as server-sent events, while the page is open."""
    st = request.app.state.broker
    board: Board = st.board
    if board.viewers >= MAX_VIEWERS:
        raise TooMany(f"{MAX_VIEWERS} dashboards are open already")

    async def stream():  # counted while it runs: a page gone before its first byte never was
        board.viewers += 1
        try:
            while not await request.is_disconnected():
                made = await asyncio.to_thread(board.snapshot, lambda: make_snapshot(st))
                yield b"data: " + made + b"\n\n"
                await asyncio.sleep(PUSH_S)
        finally:
            board.viewers -= 1

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
    )


@ui.get("/ui/api/snapshot", dependencies=[VIEWER])
async def snapshot(request: Request) -> Response:
    """The snapshot once (the page's first paint; also what a test reads)."""
    st = request.app.state.broker
    made = await asyncio.to_thread(st.board.snapshot, lambda: make_snapshot(st))
    return Response(made, media_type="application/json")


@ui.get("/ui/api/sampler/{sampler_id}", dependencies=[VIEWER])
def sampler_groups(request: Request, sampler_id: str) -> JSONResponse:
    """A sampler's 30 most recent groups (what became of each)."""
    rows = request.app.state.broker.store.recent_groups(sampler_id, 30)
    return JSONResponse(rows)


@ui.get("/ui/api/group/{job_id}", dependencies=[VIEWER])
def group(request: Request, job_id: int) -> JSONResponse:
    """One group, drilled into: the prompt, each completion's tokens with the sampler's
    behaviour log-probs and, for the groups the trainer sent them (one a step), its own;
    the broker's rewards, the versions of its turns."""
    st = request.app.state.broker
    row = st.store.group_detail(job_id)
    if row is None:
        raise NotFound(f"no stored group for job {job_id}")
    body = json.loads(row["body"])
    trainer = json.loads(row["trainer_logprobs"] or "null") or [None] * len(body["completions"])
    completions = []
    for c, mine in zip(body["completions"], trainer):
        tokens = [st.codec.decode([t]) for t in c["token_ids"]]
        completions.append(
            {
                "text": st.codec.decode(c["token_ids"]),
                "tokens": tokens,
                "logprobs": c["logprobs"],
                "trainer_logprobs": mine,
                "turns": c.get("turns"),
            }
        )
    return JSONResponse(
        {
            "job_id": job_id,
            "prompt": row["prompt"],
            "version": body["version"],
            "sampler": row["sampler_id"],
            "state": row["state"],
            "consumed_step": row["consumed_step"],
            "rewards": json.loads(row["rewards"]) if row["rewards"] else None,
            "claimed": json.loads(row["claimed"]),
            "completions": completions,
        }
    )


def make_snapshot(st) -> bytes:
    """Everything the page draws, as JSON: the status (samplers with their accounts),
    what the accounts say, the trainer's recent steps, the versions."""
    from echorl.accounts import holding, warnings
    from echorl.broker.capacity import describe

    status = st.status_reply(200)
    return json.dumps(
        {
            "time": time.time(),
            "status": status.model_dump(mode="json"),
            "warnings": warnings(status),
            "holding": holding(status, time.time()),
            "steps": list(st.board.steps)[-500:],
            "versions": versions_shown(st),
            "trainer": [trained(r) for r in st.store.trainer_metrics(500)],
            "capacity": describe(status.capacity) if status.capacity else [],
            "viewers": st.board.viewers,
        }
    ).encode()


TRAINER_SHOWN = ("reward/mean", "trainer/step_s", "trainer/wall_s", "trainer/idle_s")
TRAINER_SHOWN += ("verifier/errors", "rollout/staleness_mean")


def trained(record: dict) -> dict:
    """What the training view draws of a trainer's metrics record: a few of its numbers,
    and every held-out evaluation's."""
    return {
        k: v for k, v in record.items() if k == "step" or k in TRAINER_SHOWN or k[:5] == "eval/"
    }


def versions_shown(st) -> list[dict]:
    """The recent versions, newest first, each with its arrivals and its fan-out tree: the
    source the broker named to each sampler ("@broker" or a peer's id)."""
    named = st.fanout.tree()
    return [
        v | {"arrived": dict(v["arrived"]), "from": named.get(v["version"], {})}
        for v in reversed(list(st.board.versions.values()))
    ]


def _asset(name: str) -> bytes:
    return resources.files("echorl.broker").joinpath("ui", name).read_bytes()
