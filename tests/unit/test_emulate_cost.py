"""The emulated swarm's cost accounting: a sampler costs its price for the time it was
registered and not parked, within the window asked about."""

import pytest

from echorl.emulate.swarm import EmuSampler


def sampler(joined=0.0, gone=None, parked=(), price=3600.0) -> EmuSampler:
    s = object.__new__(EmuSampler)  # the accounting alone: no swarm, no broker
    s.joined, s.gone, s.price, s.parked = joined, gone, price, [list(p) for p in parked]
    return s


def test_parked_time_costs_nothing_and_only_the_window_counts():
    s = sampler(parked=[(100.0, 200.0), (300.0, None)])  # parked twice, the second still
    assert s.active_s(0.0, 400.0) == pytest.approx(400 - 100 - 100)
    # A window after the first parking: that parking is not charged against it.
    assert s.active_s(250.0, 400.0) == pytest.approx(50.0)
    assert s.cost(250.0, 400.0) == pytest.approx(50.0)  # 3,600 an hour = 1 a second
    assert s.parked_s(0.0, 150.0) == pytest.approx(50.0)


def test_a_sampler_costs_only_while_registered():
    s = sampler(joined=50.0, gone=120.0)
    assert s.active_s(0.0, 400.0) == pytest.approx(70.0)
    assert sampler(joined=10.0, gone=10.0).cost(0.0, 100.0) == 0.0  # never ran
    assert sampler(price=None).cost(0.0, 100.0) == 0.0  # unpriced
