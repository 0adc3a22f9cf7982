"""Cost-aware activation (broker/activation.py): which priced samplers the broker parks,
when it wakes them, and what it never lets a sampler's word do."""

from echorl.broker.activation import Activation, cheapest_cover
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


def test_an_idle_async_trainer_wakes_one_more_whatever_the_speeds_say():
    act = Activation(margin=0.2, hold_s=60)
    act.decide(swarm(), NEED, now=0.0)
    _, woken = act.decide(swarm(), NEED, busy=0.5, now=20.0)  # after hold_s / 4
    assert woken == {"dear"}  # the cheapest per token/s of the parked
    assert act.decide(swarm(), NEED, busy=0.5, now=21.0) == (set(), set())  # one per quarter


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


def test_a_busy_async_trainer_parks_what_the_idle_leases_show_to_spare_or_probes():
    """Measured speeds that just cover the need (each sampler fetches every version for a
    few jobs, so looks slow): a busy trainer has room all the same. With no idle time seen
    yet, PROBE_SHARE of the working speed goes (at least one, the dearest per token/s);
    then the samplers' idle time in empty leases, which the broker sees, sizes the rest."""
    act = Activation(margin=0.2, hold_s=10)
    tight = [sampler(n, 300.0, cost=c) for n, c in (("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0))]
    assert act.decide(tight, NEED, busy=0.99, now=0.0) == ({"d"}, set())  # a probe
    for name in "abcd":
        act.waited(name, 5.0)  # a, b, c idle half of the 10 s to come; d's wait is parked
    # Idle 0.5: (1 - 0.5) x 1.2 = 0.6 of a, b, c cover the need: c (a third) goes, not b.
    assert act.decide(tight, NEED, busy=0.99, now=10.0) == ({"c"}, set())
    assert act.decide(tight, NEED, busy=0.99, now=15.0) == (set(), set())  # within the hold
    # The speeds say short (600 < 1100) but only a departure or an idle trainer heeds them;
    # in the band between BUSY_FLOOR and BUSY_PARK nothing moves; under the floor the
    # cheapest parked wakes (PROBE_SHARE of the working speed, at least one).
    assert act.decide(tight, NEED, busy=0.94, now=40.0) == (set(), set())
    assert act.decide(tight, NEED, busy=0.9, now=41.0) == (set(), {"c"})
    # A departure: the speeds are heeded at once, busy or not.
    assert act.decide(tight[:3], NEED, busy=0.99, now=42.0) == (set(), {"d"})
    sync = Activation(margin=0.2, hold_s=10)  # no busy figure (sync): the speeds alone
    sync.decide(tight, NEED, busy=None, now=0.0)
    sync.waited("a", 10.0)
    assert sync.decide(tight, NEED, busy=None, now=10.0) == (set(), set())
