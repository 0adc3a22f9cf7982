"""A flow-level model of the swarm's network, for the emulator.

Every node (the broker, each sampler) has a downlink and an uplink. A transfer crosses its
source's uplink and its taker's downlink, and each link's rate is shared max-min fairly
among the transfers crossing it, recomputed whenever one starts or ends (progressive
filling). A transfer's first byte comes a round trip and a half after it is asked for (the
request, TCP's handshake); a lossy path is capped at TCP's throughput under loss (Mathis et
al. 1997: 1.22 MSS / (RTT sqrt(p))). A sampler passing on a version it is still receiving
cannot pass it on faster than it arrives.

Time is emulated: `speedup` emulated seconds pass per real second (the broker the emulated
samplers talk to is real, and runs in real time).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from dataclasses import dataclass, field

MSS = 1460  # bytes per TCP segment
MATHIS = 1.22


@dataclass(eq=False)
class Node:
    """A machine's link: rates in bytes per second, `rtt` its round trip to the broker (and
    half of it, about, to any other node), `loss` the share of packets it loses."""

    name: str
    down: float
    up: float
    rtt: float = 0.0
    loss: float = 0.0


@dataclass(eq=False)
class Flow:
    source: Node
    taker: Node
    size: float
    left: float
    cap: float
    after: Flow | None = None  # the flow the source is receiving this version by, if any
    grain: float = 0.0  # bytes: the taker passes on what arrives in pieces of this size
    rate: float = 0.0
    done: asyncio.Future = field(default=None)  # type: ignore[assignment]


def path_cap(a: Node, b: Node) -> float:
    """TCP's rate on the path from `a` to `b` under their losses (inf without loss)."""
    loss = a.loss + b.loss
    rtt = max(a.rtt + b.rtt, 1e-3)
    return math.inf if loss <= 0 else MATHIS * MSS / (rtt * math.sqrt(loss))


def share(flows: list[Flow]) -> None:
    """Max-min fair rates for `flows` (each `rate` set): progressive filling over the links
    (each node's up and down) and each flow's own cap. A link's fair share only grows as the
    flows it limits least are fixed, so a heap of shares, refreshed lazily, finds each next
    bottleneck."""
    users: dict[tuple[int, str], list[Flow]] = {}
    residual: dict[tuple[int, str], float] = {}
    for f in flows:
        f.rate = -1.0
        for key, cap in (
            ((id(f.source), "up"), f.source.up),
            ((id(f.taker), "down"), f.taker.down),
        ):
            users.setdefault(key, []).append(f)
            residual[key] = cap
    count = {k: len(v) for k, v in users.items()}
    heap = [(residual[k] / count[k], 0, k) for k in users]
    heap += [(f.cap, 1, i) for i, f in enumerate(flows) if math.isfinite(f.cap)]
    heapq.heapify(heap)
    left = len(flows)

    def fix(f: Flow, rate: float) -> None:
        nonlocal left
        f.rate, left = max(rate, 0.0), left - 1
        for key in ((id(f.source), "up"), (id(f.taker), "down")):
            residual[key] -= f.rate
            count[key] -= 1
            if count[key] > 0:
                heapq.heappush(heap, (max(residual[key], 0.0) / count[key], 0, key))

    while heap and left:
        level, kind, key = heapq.heappop(heap)
        if kind == 1:
            if flows[key].rate < 0:
                fix(flows[key], level)
            continue
        if count[key] == 0 or abs(max(residual[key], 0.0) / count[key] - level) > 1e-9 * (
            1 + level
        ):
            continue  # stale: a fresher entry of this link is in the heap
        for f in users[key]:
            if f.rate < 0:
                fix(f, level)


class Network:
    """The emulated transfers in flight, their rates, and when each ends."""

    def __init__(self, speedup: float = 1.0):
        self.speedup = speedup
        self.flows: list[Flow] = []
        self.at = 0.0  # emulated time of the last update
        self.timer: asyncio.TimerHandle | None = None
        self.moved = 0.0  # bytes moved in all

    def now(self) -> float:
        """Emulated seconds (the event loop's clock, sped up)."""
        return asyncio.get_running_loop().time() * self.speedup

    async def sleep(self, emulated_s: float) -> None:
        await asyncio.sleep(max(0.0, emulated_s) / self.speedup)

    async def transfer(self, source: Node, taker: Node, size: float, after: Flow | None = None):
        """Move `size` bytes from `source` to `taker`; returns once they have arrived.
        `after`: the flow by which `source` is itself receiving them (it passes on no faster
        than they arrive). Cancelled, the transfer leaves the network."""
        return await self.finish(await self.start(self.open(source, taker, size, after)))

    def open(
        self,
        source: Node | None,
        taker: Node,
        size: float,
        after: Flow | None = None,
        grain: float = 0.0,
    ) -> Flow:
        """A transfer asked for, not yet started: its taker's own takers may follow it
        already (they get nothing until it starts). `grain`: the taker makes what arrives
        available to them in pieces of this size."""
        flow = Flow(source, taker, size, size, math.inf, after, grain)
        flow.done = asyncio.get_running_loop().create_future()
        return flow

    async def start(self, flow: Flow) -> Flow:
        """`transfer`'s first half: `flow` (its source set by now) once its first byte is on
        the way."""
        await self.sleep(1.5 * (flow.source.rtt + flow.taker.rtt))  # the ask and handshake
        if flow.done.done():  # failed while it was asked for (its source is gone)
            return flow
        self._advance()
        self.flows.append(flow)
        self._replan()
        return flow

    async def finish(self, flow: Flow) -> Flow:
        """`transfer`'s second half: until the flow's last byte has arrived."""
        try:
            await flow.done
        finally:
            if not flow.done.done():  # cancelled
                self.drop(flow, ConnectionError("the relay gave the transfer up"))
        return flow

    def arrived(self, flow: Flow) -> float:
        """Bytes of `flow` that have arrived so far."""
        self._advance()
        return flow.size - flow.left

    def drop(self, flow: Flow, why: Exception) -> None:
        """The taker of `flow` gives it up: the flow leaves, and its taker's own takers of
        those bytes fail with `why` (a relay that starts again cuts those it was feeding)."""
        self._advance()
        if flow in self.flows:
            self.flows.remove(flow)
        if not flow.done.done():
            flow.done.set_exception(why)
            flow.done.exception()  # retrieved: nobody may wait on it
        for f in [f for f in self.flows if f.after is flow]:
            self.flows.remove(f)
            if not f.done.done():
                f.done.set_exception(why)
        self._replan()

    def cut(self, node: Node, why: Exception) -> None:
        """`node` is gone (crashed, left): the transfers it was sending fail with `why`."""
        self._advance()
        for f in [f for f in self.flows if f.source is node]:
            self.flows.remove(f)
            if not f.done.done():
                f.done.set_exception(why)
        self._replan()

    def _advance(self) -> None:
        now = self.now()
        dt, self.at = now - self.at, now
        for f in self._upstream_first():  # a taker may go as far as its relay has got
            floor = self._behind(f)
            step = max(0.0, min(f.left - floor, f.rate * dt))
            f.left -= step
            self.moved += step

    def _upstream_first(self) -> list[Flow]:
        """The flows, every relay's arrival before the flows it feeds."""
        depth: dict[int, int] = {}
        live = {id(f) for f in self.flows}
        for f in self.flows:
            chain, g = [], f
            while g is not None and id(g) in live and id(g) not in depth:
                chain.append(g)
                g = g.after
            d = depth.get(id(g), -1) if g is not None else -1
            for g in reversed(chain):
                d += 1
                depth[id(g)] = d
        return sorted(self.flows, key=lambda f: depth[id(f)])

    def _behind(self, f: Flow) -> float:
        """What `f`'s source has still to pass on of the bytes (0 once it holds them all):
        what it has yet to receive, and the piece it is receiving."""
        if f.after is None or f.after.done.done():
            return 0.0
        if f.after not in self.flows:  # asked for, not yet started: nothing to pass on
            return f.size
        return min(f.size, f.after.left + f.after.grain)

    def _replan(self) -> None:
        """Rates for the flows now (twice: a relay's takers that caught up with what it has
        received go at its pace), and a timer for the next flow to end or catch up."""
        for f in self.flows:
            f.cap = path_cap(f.source, f.taker)
        share(self.flows)
        caught = [f for f in self.flows if self._behind(f) > 0 and f.left <= self._behind(f) + 1.0]
        if caught:
            for f in caught:
                f.cap = min(f.cap, f.after.rate)
            share(self.flows)
        if self.timer is not None:
            self.timer.cancel()
        soonest = min((self._next(f) for f in self.flows), default=math.inf)
        if math.isfinite(soonest):
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(max(soonest, 0.0) / self.speedup, self._tick)

    def _next(self, f: Flow) -> float:
        """Emulated seconds until `f` ends, or catches up with its relay's arrival."""
        behind = self._behind(f)
        if behind > 0:
            gap = f.left - behind
            faster = f.rate - f.after.rate
            return gap / faster if gap > 1.0 and faster > 0 else math.inf
        return f.left / f.rate if f.rate > 0 else math.inf

    def _tick(self) -> None:
        self.timer = None
        self._advance()
        for f in list(self.flows):
            if f.left <= max(1.0, 1e-9 * f.size) and self._behind(f) == 0.0:
                f.left = 0.0
                self.flows.remove(f)
                if not f.done.done():
                    f.done.set_result(f)
        self._replan()
