"""Cost-aware activation (ECHO-2): with priced samplers, only the cheapest set whose speed
covers what the trainer takes is handed jobs; the rest are parked.

The trainer takes `needed` tokens/s (a step's completion tokens over its compute time,
`capacity.Pace`). Samplers that cannot be priced against the others (no `cost_per_hour`,
not yet proven, not yet measured: a newcomer must work to be measured) are never parked.
Of the proven priced ones the broker keeps the cheapest per token/s whose speeds cover
`needed` x (1 + margin) and parks the rest: they stay registered and heartbeat, their
leases come back empty with `parked` set (they fetch no version meanwhile, leaving the
broker's uplink to the working samplers), and cost nothing while parked.

Speeds are the broker's own measures of delivered groups, over the leases a sampler began
holding the version it generated with (`BrokerStore._measure`: a lease that began with a
download timed the link too: a sampler that fetched each version for a few jobs looked
several times slower than it generates); only proven samplers' count (a fresh identity's
one fast group must not park the swarm). What fetches cost the working samplers depends on
how many fetch at once (the broker's uplink): measured with everyone active it would
forbid the parking that lowers it, so the trainer's fed share checks it instead.

Hysteresis: a shortfall by the speeds (a sampler left, or measures slower) wakes the
cheapest parked at once; parking waits `hold_s` after the last change and needs a SAVING
of the active cost. An async trainer fed under BUSY_FLOOR of its last steps (blocked on
groups the rest, as its acks tell) while samplers are parked is the check on the speeds:
they promised more than the trainer got, so they are believed a PROBE_SHARE less (`trust`:
the cover grows, and stays grown) and that share of the working speed is woken, at most
once a hold; nothing parks while the trainer waits.
"""

from __future__ import annotations

import threading
import time

from echorl.broker.capacity import TRUSTED
from echorl.protocol import SamplerStatus

SAVING = 0.05  # parking happens only when it cuts the active cost per hour by this share
BUSY_FLOOR = 0.92  # an async trainer blocked on groups more than the rest of its steps is short
PROBE_SHARE = 0.1  # of the working speed woken, and of trust lost, when the trainer is short
MIN_TRUST = 0.5  # the speeds are never believed less than this share


class Activation:
    def __init__(self, margin: float, hold_s: float, enabled: bool = True):
        self.margin, self.hold_s, self.enabled = margin, hold_s, enabled
        self.parked: set[str] = set()
        self.trust = 1.0  # the share of the measured speeds believed (an idle trainer lowers it)
        self.changed = -float("inf")  # monotonic time of the last change
        self.changed_at = 0.0  # ... its wall-clock time: the trainer's fed share counts after it
        self.reason = ""  # why the last change was made, for the broker's log
        # The fastest working (not parked) proven sampler's speed, while any is parked: the
        # yardstick of leases by speed (a parked H100 shrank every RTX 3090's lease to a
        # fifth, and short leases fetched every version)
        self.fastest: float | None = None
        self.lock = threading.Lock()

    def is_parked(self, sampler_id: str) -> bool:
        return sampler_id in self.parked  # a set read: no lock needed for one lookup

    def decide(
        self,
        samplers: list[SamplerStatus],
        needed: float | None,
        busy: float | None = None,
        now: float | None = None,
    ) -> tuple[set[str], set[str]]:
        """Park or wake from the samplers as they are, the trainer's `needed` tokens/s and
        (async) the share of its recent steps it was not blocked on groups (`busy`); returns
        (parked now, woken)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            moved = self._decide(samplers, needed, busy, now)
            working = [
                _speed(s)
                for s in samplers
                if s.state == "alive" and s.standing in TRUSTED and s.id not in self.parked
            ]
            self.fastest = max(working, default=None) if self.parked else None
            return moved

    def _decide(
        self,
        samplers: list[SamplerStatus],
        needed: float | None,
        busy: float | None,
        now: float,
    ) -> tuple[set[str], set[str]]:
        self.reason = ""
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
        want = needed * (1 + self.margin)
        held = now - self.changed >= self.hold_s  # the last change has had its hold
        hungry = busy is not None and busy < BUSY_FLOOR  # an async trainer short of groups
        if self.trust * active < needed * (1 + self.margin / 2):  # short: wake at once
            back = self._wake(by_cost, want / self.trust - active)
            self.reason = (
                f"short: {active:.0f} tokens/s active, believed {self.trust:.0%} of it, "
                f"{needed:.0f} needed"
            )
        elif hungry and self.parked and held:
            # The speeds over-promise: believe them less, and wake that share.
            self.trust = max(MIN_TRUST, self.trust * (1 - PROBE_SHARE))
            back = self._wake(by_cost, PROBE_SHARE * active)
            self.reason = (
                f"the trainer fed {busy:.0%} of its steps: speeds believed {self.trust:.0%}"
            )
        else:
            back = set()
        if back:
            self.changed, self.changed_at = now, time.time()
            return set(), woken | back
        if not held or hungry:  # none parks while the trainer waits
            return set(), woken
        keep = cheapest_cover(by_cost, want / self.trust - free)
        cost = sum(s.cost_per_hour for s in priced if s.id not in self.parked)
        kept_cost = sum(s.cost_per_hour for s in keep)
        if kept_cost > cost * (1 - SAVING):
            return set(), woken
        new = {s.id for s in priced} - {s.id for s in keep}
        parked, woke = new - self.parked, self.parked - new
        self.reason = (
            f"{sum(_speed(s) for s in keep) + free:.0f} tokens/s cover {needed:.0f} "
            f"x {1 + self.margin:g} / {self.trust:.2f} for {kept_cost:.2f}/h"
        )
        self.parked, self.changed, self.changed_at = new, now, time.time()
        return parked, woken | woke

    def _wake(self, by_cost: list[SamplerStatus], rate: float) -> set[str]:
        """The cheapest parked per token/s whose speeds add up to `rate` (at least one)."""
        back, got = set(), 0.0
        for s in by_cost:
            if got >= rate:
                break
            if s.id in self.parked:
                back.add(s.id)
                got += _speed(s)
        self.parked -= back
        return back


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
