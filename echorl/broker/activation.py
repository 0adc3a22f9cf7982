"""Cost-aware activation (ECHO-2): with priced samplers, only the cheapest set whose speed
covers what the trainer takes is handed jobs; the rest are parked.

The trainer takes `needed` tokens/s (a step's completion tokens over its compute time,
`capacity.Pace`). Samplers that cannot be priced against the others (no `cost_per_hour`,
not yet proven, not yet measured: a newcomer must work to be measured) are never parked.
Of the proven priced ones the broker keeps the cheapest per token/s whose speeds cover
`needed` x (1 + margin) and parks the rest: they stay registered and heartbeat, their
leases come back empty with `parked` set (they keep the latest version meanwhile, so a
wake costs no download), and cost nothing while parked.

Speeds are the broker's own measures of delivered groups, and only proven samplers' count
(a fresh identity's one fast group must not park the swarm). They count a version's fetch
in a sampler's time, so with everyone active (each fetching every version for a few jobs)
they undercount the surplus. In async the trainer's busy share (compute over the time
between its steps) is the check:

- busy over BUSY_PARK with no surplus in the speeds: the dearest per token/s are parked,
  as many as the working samplers' idle share (time in leases that came back empty, which
  the broker sees itself) says are spare, else PROBE_SHARE of the working speed;
- busy under BUSY_FLOOR: PROBE_SHARE of it is woken, the cheapest first;
- in between, nothing moves.

Hysteresis: a shortfall by the speeds (in sync; in async once a sampler is gone or the
trainer is short) wakes the cheapest parked at once; parking waits `hold_s` after the last
change and, by the speeds, needs a SAVING of the active cost.
"""

from __future__ import annotations

import threading
import time

from echorl.broker.capacity import TRUSTED
from echorl.protocol import SamplerStatus

SAVING = 0.05  # parking happens only when it cuts the active cost per hour by this share
BUSY_FLOOR = 0.92  # an async trainer busy less than this share of its steps is short
BUSY_PARK = 0.96  # ... busy more than this, it has samplers to spare
PROBE_SHARE = 0.1  # of the working speed parked (or woken) a step when only busy tells


class Activation:
    def __init__(self, margin: float, hold_s: float, enabled: bool = True):
        self.margin, self.hold_s, self.enabled = margin, hold_s, enabled
        self.parked: set[str] = set()
        self.working: set[str] = set()  # the alive samplers not parked, at the last look
        self.idle_s = 0.0  # seconds working samplers waited in leases that came back empty
        self.looked = -float("inf")  # when `decide` last ran
        self.changed = -float("inf")  # monotonic time of the last change
        self.lock = threading.Lock()

    def is_parked(self, sampler_id: str) -> bool:
        return sampler_id in self.parked  # a set read: no lock needed for one lookup

    def waited(self, sampler_id: str, seconds: float) -> None:
        """A working sampler's lease waited `seconds` and came back empty: time to spare."""
        if sampler_id not in self.parked:
            with self.lock:
                self.idle_s += seconds

    def decide(
        self,
        samplers: list[SamplerStatus],
        needed: float | None,
        busy: float | None = None,
        now: float | None = None,
    ) -> tuple[set[str], set[str]]:
        """Park or wake from the samplers as they are, the trainer's `needed` tokens/s and
        (async) the share of its recent steps it was busy; returns (parked now, woken)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            idle_share = 0.0  # of the working samplers' time since the last look
            span = (now - self.looked) * len(self.working)
            if span > 0 and self.looked > -float("inf"):
                idle_share = min(1.0, self.idle_s / span)
            self.idle_s, self.looked = 0.0, now
            alive = [s for s in samplers if s.state == "alive"]
            ids = {s.id for s in alive}
            woken = self.parked - ids  # gone: nothing to park
            self.parked &= ids
            if not self.enabled or not needed:
                woken |= self.parked
                self.parked = set()
                return set(), woken
            priced = [s for s in alive if _priced(s)]
            free = sum(_speed(s) for s in alive if not _priced(s) and s.standing in TRUSTED)
            by_cost = sorted(priced, key=lambda s: s.cost_per_hour / _speed(s))
            active = free + sum(_speed(s) for s in priced if s.id not in self.parked)
            idle = busy is not None and busy < BUSY_FLOOR and now - self.changed >= self.hold_s / 4
            if idle and self.parked:  # too few working: PROBE_SHARE more, whatever speeds say
                target = PROBE_SHARE * sum(_speed(s) for s in by_cost if s.id not in self.parked)
                back, got = set(), 0.0
                for s in by_cost:  # the cheapest per token/s first
                    if s.id in self.parked and (not back or got < target):
                        back.add(s.id)
                        got += _speed(s)
                self.parked -= back
                self.working |= back
                self.changed = now
                return set(), woken | back
            departed = bool(self.working - ids)
            self.working = {s.id for s in alive if s.id not in self.parked}
            # A busy async trainer outranks the speeds (they undercount), unless one left.
            heed = busy is None or busy < BUSY_FLOOR or departed
            if heed and active < needed * (1 + self.margin / 2):  # short: wake at once
                for s in by_cost:
                    if active >= needed * (1 + self.margin):
                        break
                    if s.id in self.parked:
                        self.parked.discard(s.id)
                        woken.add(s.id)
                        active += _speed(s)
                if woken:
                    self.changed = now
                    self.working |= woken
                return set(), woken
            if now - self.changed < self.hold_s:
                return set(), woken
            keep = cheapest_cover(by_cost, needed * (1 + self.margin) - free)
            cost = sum(s.cost_per_hour for s in priced if s.id not in self.parked)
            kept_cost = sum(s.cost_per_hour for s in keep)
            if kept_cost > cost * (1 - SAVING):
                # The speeds see no surplus, but they undercount it (a sampler that fetches
                # each version for a few jobs looks slow; with fewer active, each makes
                # more tokens a version): a trainer busy over BUSY_PARK has room to spare,
                # so one more goes, the dearest per token/s, while it stays so.
                working = [s for s in by_cost if s.id not in self.parked]
                if busy is None or busy < BUSY_PARK or len(working) < 2:
                    return set(), woken
                # Idle a share i of their time, the working samplers make 1 / (1 - i) of
                # what is taken: keeping (1 - i)(1 + margin) of them covers it with headroom.
                spare = 1 - (1 - idle_share) * (1 + self.margin)
                if spare <= 0:  # none idle: the surplus goes into fetches; probe it
                    spare = PROBE_SHARE
                total, parked = sum(_speed(s) for s in working), set()
                for s in reversed(working[1:]):  # the dearest per token/s first
                    if parked and _speed(s) > spare * total:
                        break
                    parked.add(s.id)
                    spare -= _speed(s) / total
                self.parked |= parked
                self.working -= parked
                self.changed = now
                return parked, woken
            new = {s.id for s in priced} - {s.id for s in keep}
            parked, woke = new - self.parked, self.parked - new
            self.parked, self.changed = new, now
            self.working = ids - new
            return parked, woken | woke


def cheapest_cover(by_cost: list[SamplerStatus], rate: float) -> list[SamplerStatus]:
    """Samplers (sorted by cost per token/s) whose speeds together reach `rate`: the cheapest
    per token/s first, then any whose speed the rest still covers without, dearest first."""
    keep, got = [], 0.0
    for s in by_cost:
        if got >= rate:
            break
        keep.append(s)
        got += _speed(s)
    for s in sorted(keep, key=lambda s: -s.cost_per_hour):
        if got - _speed(s) >= rate:
            keep.remove(s)
            got -= _speed(s)
    return keep


def _priced(s: SamplerStatus) -> bool:
    """Whether the policy may park `s`: it tells its price, is proven, and has a speed."""
    return s.cost_per_hour is not None and s.standing in TRUSTED and _speed(s) > 0


def _speed(s: SamplerStatus) -> float:
    return s.tokens_per_s or 0.0
