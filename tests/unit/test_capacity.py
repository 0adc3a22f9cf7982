"""The broker's provisioning figures (broker/capacity.py) from what it measured."""

import pytest

from echorl.broker.capacity import Pace, capacity, describe
from echorl.protocol import SamplerStatus


def sampler(name, tokens_per_s, cost=None, state="alive", standing="proven"):
    return SamplerStatus(
        id=name, name=name, hardware="", backend="hf", max_batch=64, last_seen=0.0,
        version_held=0, tokens_per_s=tokens_per_s, state=state, cost_per_hour=cost,
        standing=standing,
    )  # fmt: skip


def paced(train_s=1.0, tokens=1000, fetches=(0.5, 1.5)):
    pace = Pace()
    pace.step(train_s, tokens, now=10.0)
    pace.step(train_s, tokens, now=12.0)  # a step every 2 s
    for version, seconds in enumerate(fetches):
        for who, told in zip("abc", (seconds, seconds / 2, 1e6)):  # the median's, not a liar's
            pace.fetched(version, told, who)
    return pace


def test_nothing_before_the_trainer_has_reported_a_step():
    assert capacity(Pace(), [sampler("a", 100.0)], 1) is None


def test_a_sampler_claiming_next_to_no_speed_breaks_nothing():
    c = capacity(paced(), [sampler("a", 5e-324, cost=1.0)], max_staleness=1)
    assert c.staleness_to_overlap is None and c.keep == ["a"]


def test_the_needed_rate_the_spread_and_the_staleness_that_hides_them():
    swarm = [sampler("a", 400.0), sampler("b", 100.0), sampler("gone", 1e6, state="lost")]
    c = capacity(paced(), swarm, max_staleness=1)
    assert c.needed_tokens_per_s == pytest.approx(1000.0)  # a step's tokens per train_s
    assert c.swarm_tokens_per_s == pytest.approx(500.0)  # the alive samplers only
    assert c.trainer_busy == pytest.approx(0.5)  # 1 s of compute in 2 s steps
    assert c.dissemination_s == pytest.approx(1.0)  # the median fetch, averaged: (0.5 + 1.5) / 2
    # 1 s to spread + 2 s to generate a step's tokens = 3 train steps: staleness 2 hides it.
    assert c.staleness_to_overlap == 2
    assert c.keep == [] and c.keep_cost_per_hour is None  # nobody told a cost


def test_the_cheapest_samplers_that_cover_the_need_are_named():
    swarm = [
        sampler("dear", 2000.0, cost=10.0),  # 0.005 per token/s
        sampler("cheap", 600.0, cost=0.6),  # 0.001
        sampler("middling", 600.0, cost=1.2),  # 0.002
        sampler("unpriced", 5000.0),
    ]
    c = capacity(paced(), swarm, max_staleness=0)
    assert c.keep == ["cheap", "middling"]  # 1200 tokens/s >= 1000 needed, for 1.8/h
    assert c.keep_cost_per_hour == pytest.approx(1.8)
    assert any("cheap, middling" in line for line in describe(c))
    short = capacity(paced(tokens=10_000), swarm, max_staleness=0)  # 10000 tokens/s needed
    assert short.keep == ["cheap", "middling", "dear"]
    assert any("short of it" in line for line in describe(short))


def test_a_liars_claims_and_repeated_reports_move_no_figure():
    """A fresh identity claiming 1e9 tokens/s at 0/h was the one sampler the advice kept;
    one sampler's six reports of 1e6 s per version set the median dissemination. Only
    proven samplers count, and each once per version."""
    honest = [sampler("cheap", 600.0, cost=0.6), sampler("middling", 600.0, cost=1.2)]
    before = capacity(paced(), honest, max_staleness=0)
    liar = sampler("liar", 1e9, cost=0.0, standing="newcomer: 0 of 128 tokens audited")
    after = capacity(paced(), [*honest, liar], max_staleness=0)
    assert after == before and after.keep == ["cheap", "middling"]
    pace = paced()
    for _ in range(6):
        pace.fetched(0, 1e6, "c")  # the same sampler again and again
        pace.fetched(1, 1e6, "c")
    assert pace.dissemination_s() == pytest.approx(1.0)  # (0.5 + 1.5) / 2, as before


def test_the_trainer_s_blocked_time_is_kept_beside_its_step_time():
    """What activation reads as an async trainer short of groups: the seconds each step
    blocked on them (`AckRequest.idle_s`), not compute over step time (the trainer's own
    bookkeeping made a fed trainer look 8% short)."""
    import pydantic

    from echorl.broker.capacity import FED_STEPS
    from echorl.protocol import AckRequest

    pace = Pace()
    assert pace.fed() is None
    # The first step's wait is the swarm's start (before, it weighed on the figure for
    # steps and woke every sampler activation had parked).
    for k, idle in enumerate((50.0, 0.0, 4.0, 4.0)):
        pace.step(5.0, 1000, now=10.0 * k, idle_s=idle)
    assert pace.fed() == pytest.approx(1 - 8.0 / 30.0)
    pace.step(5.0, 1000, now=40.0)  # a trainer that tells none leaves the figure as it was
    assert pace.fed() == pytest.approx(1 - 8.0 / 30.0)
    for k in range(FED_STEPS):  # the last FED_STEPS steps count
        pace.step(5.0, 1000, now=50.0 + 10.0 * k, idle_s=1.0)
    assert pace.fed() == pytest.approx(0.9)
    # Since a change of who works, only the steps acked after it (two at least): one old
    # hungry episode, counted again each hold, cut the trust once a hold.
    pace.step(5.0, 1000, now=130.0, idle_s=0.0)
    assert pace.fed(since=125.0) is None
    pace.step(5.0, 1000, now=140.0, idle_s=0.0)
    assert pace.fed(since=125.0) == 1.0
    with pytest.raises(pydantic.ValidationError, match="idle_s"):
        AckRequest(job_ids=[1], step=0, idle_s=-1.0)
