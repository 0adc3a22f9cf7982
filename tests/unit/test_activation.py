"""Cost-aware activation (broker/activation.py): which priced samplers the broker parks,
when it wakes them, and what it never lets a sampler's word do."""

import pytest

from echorl.broker.activation import MIN_TRUST, Activation, cheapest_cover
from tests.unit.test_capacity import sampler

NEED = 1000.0  # tokens/s the trainer takes


def swarm():
    return [
        sampler("cheap", 600.0, cost=0.6),  # 0.001 per token/s
        sampler("middling", 600.0, cost=1.2),  # 0.002
        sampler("dear", 2000.0, cost=10.0),  # 0.005
        sampler("dearer", 600.0, cost=6.0),  # 0.01
    ]


def test_the_cheapest_cover_with_headroom_works_and_the_rest_are_parked():
    act = Activation(margin=0.2, hold_s=60)
    parked, woken = act.decide(swarm(), NEED, now=0.0)
    # 1200 tokens/s from cheap + middling covers 1000 x 1.2 for 1.8/h: dear and dearer wait.
    assert parked == {"dear", "dearer"} and woken == set()
    assert act.is_parked("dear") and not act.is_parked("cheap")
    # Leases by speed measure against the fastest working sampler, not a parked one (a
    # parked H100 shrank each working RTX 3090's lease to a fifth): none parked, none given.
    assert act.fastest == 600.0
    act.decide(swarm(), None, now=1.0)
    assert act.fastest is None


def test_the_cover_drops_a_sampler_it_does_not_need():
    """By cost per token/s the dear 2,000 tokens/s comes third; then the middling one is
    not needed any more (cheap + dear cover it), and it costs more than nothing."""
    by_cost = sorted(swarm(), key=lambda s: s.cost_per_hour / s.tokens_per_s)
    kept = cheapest_cover(by_cost, 2500.0)
    assert [s.name for s in kept] == ["cheap", "dear"]  # 2600 tokens/s for 10.6/h, not 11.8


def test_a_departure_wakes_the_cheapest_parked_at_once_and_parking_waits_its_hold():
    act = Activation(margin=0.2, hold_s=60)
    act.decide(swarm(), NEED, now=0.0)
    gone = [s for s in swarm() if s.name != "middling"]  # 600 tokens/s left active
    parked, woken = act.decide(gone, NEED, now=1.0)  # at once, whatever the hold
    assert woken == {"dear"} and parked == set() and act.parked == {"dearer"}
    # Back: cheaper than dear again, but no parking within the hold of the last change.
    assert act.decide(swarm(), NEED, now=30.0) == (set(), set())
    parked, woken = act.decide(swarm(), NEED, now=61.0)
    assert parked == {"dear"} and act.parked == {"dear", "dearer"}


def test_a_small_saving_moves_nobody():
    act = Activation(margin=0.2, hold_s=0)
    act.decide(swarm(), NEED, now=0.0)
    wobbly = swarm()
    wobbly[1] = sampler("middling", 590.0, cost=1.2)  # its measure wobbles: still needed
    assert act.decide(wobbly, NEED, now=1.0) == (set(), set())


def test_an_idle_async_trainer_wakes_more_and_believes_the_speeds_less():
    """Parked by the speeds, yet the trainer idles: the speeds over-promised. A hold after
    the last change, PROBE_SHARE of the working speed wakes (the cheapest parked per
    token/s) and the speeds are believed that much less from then on, so the next cover
    keeps what was woken instead of parking it again (before: 21 changes in 40 steps)."""
    act = Activation(margin=0.2, hold_s=60)
    act.decide(swarm(), NEED, now=0.0)
    assert act.decide(swarm(), NEED, busy=0.5, now=30.0) == (set(), set())  # within the hold
    _, woken = act.decide(swarm(), NEED, busy=0.5, now=61.0)
    assert woken == {"dear"} and act.trust == pytest.approx(0.9)
    assert act.decide(swarm(), NEED, busy=0.5, now=62.0) == (set(), set())  # one a hold
    # A hold on, the trainer busy: the cover of 1,200 / 0.9 tokens/s keeps dear, which alone
    # covers it (2,000 tokens/s for 10/h, against 11.8/h for cheap, middling and dear).
    assert act.decide(swarm(), NEED, busy=0.97, now=122.0) == ({"cheap", "middling"}, set())
    moves = [act.decide(swarm(), NEED, busy=0.5, now=200.0 + 61 * k) for k in range(30)]
    # Idle ever after: all woken, one a hold, none parked again; the trust stays above its floor.
    assert act.parked == set() and sum(bool(p) for p, _ in moves) == 0
    assert sum(bool(w) for _, w in moves) == 3 and MIN_TRUST <= act.trust < 0.9


def test_a_busy_trainer_on_speeds_that_cover_it_moves_nobody_after_the_first_cover():
    act = Activation(margin=0.2, hold_s=10)
    assert act.decide(swarm(), NEED, busy=0.99, now=0.0) == ({"dear", "dearer"}, set())
    for k in range(1, 100):  # the trainer's busy share wanders above the floor
        busy = (0.93, 0.97, 0.99, 1.0)[k % 4]
        assert act.decide(swarm(), NEED, busy=busy, now=5.0 * k) == (set(), set())


def test_unproven_unpriced_or_unmeasured_samplers_are_never_parked_and_newcomers_count_for_nothing():
    act = Activation(margin=0.2, hold_s=0)
    # A fresh identity "delivering" 1e9 tokens/s must not park the honest swarm.
    sybil = sampler("sybil", 1e9, cost=0.0, standing="newcomer: 0 of 1000 tokens")
    unpriced = sampler("own-gpu", 300.0)
    unmeasured = sampler("new", None, cost=0.1)
    parked, _ = act.decide([*swarm(), sybil, unpriced, unmeasured], NEED, now=0.0)
    assert not parked & {"sybil", "own-gpu", "new"}
    # own-gpu's proven 300 tokens/s counts: cheap's 600 + 300 covers 900 of 1200; + middling.
    assert parked == {"dear", "dearer"}


def test_without_a_need_or_when_off_nobody_is_parked():
    act = Activation(margin=0.2, hold_s=0)
    act.decide(swarm(), NEED, now=0.0)
    assert act.decide(swarm(), None, now=1.0) == (set(), {"dear", "dearer"})
    off = Activation(margin=0.2, hold_s=0, enabled=False)
    assert off.decide(swarm(), NEED, now=0.0) == (set(), set())
