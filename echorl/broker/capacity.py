"""How well the swarm is provisioned, from what the broker measures (ECHO-2's overlap rule).

The trainer's time per step (`train_s`, its compute alone) sets the pace a swarm can at best
keep: to never make it wait, the samplers must together generate a step's completion tokens
in `train_s` (the *needed* tokens/s), and a new version must reach them before the data made
with it is too stale to use. With a staleness bound S, generation and the version's spread
hide behind training when

    dissemination_s + step_tokens / swarm_tokens_per_s <= (S + 1) x train_s

so the smallest S that keeps the trainer busy is the left side in steps, minus one (sync,
S = 0, never overlaps: each step waits for both). Samplers that tell their
`cost_per_hour` are then ranked by cost per token/s, and the cheapest set that covers the
needed rate is named: the ones to keep; the rest could be let go.

Kept in memory (it is a view of the last minutes, not a record): the trainer reports each
step's compute time and tokens with its ack; a sampler reports how long each version it
loads took (download and load) with a heartbeat the moment it is loaded.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict, deque

from echorl.protocol import Capacity, SamplerStatus

EMA = 0.2  # weight of the newest step in the trainer's averages
TRUSTED = ("proven", "trusted (no probation)")  # standings whose numbers count
OWN_KEPT = 10_000  # samplers whose own fetch times are kept (the most recent)
VERSIONS_KEPT = 16  # versions whose spread is tracked
FED_STEPS = 8  # the trainer's steps over which its fed share is taken (`Pace.fed`) ...
FED_MIN_STEPS = 2  # ... and the fewest it is taken over


class Pace:
    """The trainer's recent steps (exponential averages), and how long each recent version
    took to reach the samplers that fetched it."""

    def __init__(self) -> None:
        self.train_s: float | None = None
        self.step_tokens: float | None = None
        self.step_s: float | None = None  # wall time between acks
        # (acked at, wall time since the ack before, of it blocked on groups): the last steps
        self.recent: deque[tuple[float, float, float]] = deque(maxlen=FED_STEPS)
        self.last_ack: float | None = None
        self.fetch_s: dict[int, dict[str, float]] = {}  # version -> sampler -> fetch and load
        # Each sampler's own recent fetches (any sampler's: only its own account shows them).
        self.own: OrderedDict[str, deque[float]] = OrderedDict()
        self.lock = threading.Lock()

    def step(self, train_s: float, tokens: int, now: float, idle_s: float | None = None) -> None:
        with self.lock:
            self.train_s = _ema(self.train_s, train_s)
            if idle_s is not None and self.last_ack is not None:  # the first waited for the start
                self.recent.append((now, now - self.last_ack, idle_s))
            self.step_tokens = _ema(self.step_tokens, tokens)
            if self.last_ack is not None:
                self.step_s = _ema(self.step_s, now - self.last_ack)
            self.last_ack = now

    def fed(self, since: float = 0.0) -> float | None:
        """The share of its last FED_STEPS steps' wall time the trainer was not blocked on
        groups, of those acked after `since` (a change of who works: steps before it say
        nothing of it, and counted again a hold later they cut the trust once a hold on one
        old episode); None with fewer than FED_MIN_STEPS of them, or no idle_s told."""
        with self.lock:
            steps = [(w, i) for at, w, i in self.recent if at > since]
            wall = sum(w for w, _ in steps)
            if len(steps) < FED_MIN_STEPS or not wall:
                return None
            return max(0.0, 1.0 - sum(i for _, i in steps) / wall)

    def fetched(self, version: int | None, seconds: float | None, who: str = "") -> None:
        """Sampler `who` loaded `version` in `seconds` (download and load): its last word
        on a version counts, once (six reports of one sampler weighed six before)."""
        if version is None or seconds is None:
            return
        with self.lock:
            self.fetch_s.setdefault(version, {})[who] = seconds
            for old in [v for v in self.fetch_s if v <= version - VERSIONS_KEPT]:
                del self.fetch_s[old]

    def told(self, who: str, seconds: float | None) -> None:
        """Sampler `who` (trusted or not) loaded a version in `seconds`: for its own account."""
        if seconds is None:
            return
        with self.lock:
            self.own.setdefault(who, deque(maxlen=8)).append(seconds)
            self.own.move_to_end(who)
            if len(self.own) > OWN_KEPT:
                self.own.popitem(last=False)

    def fetch_of(self, who: str) -> float | None:
        """Sampler `who`'s fetch and load of a version, the median of its recent ones."""
        with self.lock:
            told = list(self.own.get(who, ()))
        return statistics.median(told) if told else None

    def dissemination_s(self) -> float | None:
        """A version's way to a sampler: the median sampler's fetch and load (one sampler's
        word cannot move it), averaged over the recent versions."""
        with self.lock:
            spans = [statistics.median(told.values()) for told in self.fetch_s.values()]
        return sum(spans) / len(spans) if spans else None


def capacity(pace: Pace, samplers: list[SamplerStatus], max_staleness: int) -> Capacity | None:
    """The figures, once the trainer has reported a step; None before. Only proven samplers'
    numbers count (`broker/standing.py`): a fresh identity's claim of 1e9 tokens/s at 0/h
    made the advice keep it alone."""
    if pace.train_s is None or pace.step_tokens is None:
        return None
    alive = [s for s in samplers if s.state == "alive" and s.standing in TRUSTED]
    speeds = {s.id: s.tokens_per_s or 0.0 for s in alive}
    swarm = sum(speeds.values())
    needed = pace.step_tokens / max(pace.train_s, 1e-9)
    spread = pace.dissemination_s()
    overlap = None
    if swarm > 1e-6 and spread is not None:
        steps = (spread + pace.step_tokens / swarm) / max(pace.train_s, 1e-9)
        if math.isfinite(steps) and steps < 1e9:  # figures from samplers: never a 500
            overlap = max(0, math.ceil(steps - 1e-9) - 1)
    # The cheapest set whose speed covers the need: by cost per token/s, those that tell.
    priced = sorted(
        (s for s in alive if s.cost_per_hour is not None and speeds[s.id] > 0),
        key=lambda s: s.cost_per_hour / speeds[s.id],
    )
    keep, rate, cost = [], 0.0, 0.0
    for s in priced:
        if rate >= needed:
            break
        keep.append(s.name)
        rate, cost = rate + speeds[s.id], cost + s.cost_per_hour
    return Capacity(
        train_s=pace.train_s,
        step_s=pace.step_s,
        trainer_busy=None if not pace.step_s else min(1.0, pace.train_s / pace.step_s),
        step_tokens=pace.step_tokens,
        needed_tokens_per_s=needed,
        swarm_tokens_per_s=swarm,
        dissemination_s=spread,
        staleness_to_overlap=overlap,
        max_staleness=max_staleness,
        keep=keep if priced else [],
        keep_cost_per_hour=cost if priced else None,
        keep_tokens_per_s=rate if priced else None,
    )


def describe(c: Capacity) -> list[str]:
    """The figures in words: `echorl status` and the run summary print them."""
    busy = f" ({c.trainer_busy:.0%} of recent steps)" if c.trainer_busy is not None else ""
    share = c.swarm_tokens_per_s / max(c.needed_tokens_per_s, 1e-9)
    lines = [
        f"capacity: the trainer computes {c.train_s:.2f} s a step{busy} on "
        f"{c.step_tokens:.0f} completion tokens: it could take {c.needed_tokens_per_s:.0f} "
        f"tokens/s; the swarm makes {c.swarm_tokens_per_s:.0f} ({share:.0%})",
    ]
    if c.dissemination_s is not None:
        lines.append(
            f"capacity: a new version takes {c.dissemination_s:.2f} s to reach a sampler "
            "(download and load, the median sampler)"
        )
    if c.staleness_to_overlap is not None:
        lines.append(
            f"capacity: generation and weight spread hide behind training from max_staleness "
            f"{c.staleness_to_overlap} (this run's: {c.max_staleness})"
        )
    if c.keep:
        lines.append(
            f"capacity: cheapest samplers that cover it: {', '.join(c.keep)} "
            f"({c.keep_tokens_per_s:.0f} tokens/s for {c.keep_cost_per_hour:.2f}/h; the rest "
            "could go)"
            if c.keep_tokens_per_s >= c.needed_tokens_per_s
            else f"capacity: every priced sampler together ({c.keep_tokens_per_s:.0f} tokens/s, "
            f"{c.keep_cost_per_hour:.2f}/h) is short of it: add samplers"
        )
    return lines


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
