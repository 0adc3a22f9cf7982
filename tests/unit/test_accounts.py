"""What `echorl status` says of each sampler's account: the waste named, with the cure."""

from echorl.accounts import holding, warnings
from echorl.protocol import Capacity, SamplerStatus, StatusReply


def sampler(name, **account) -> SamplerStatus:
    base = dict(
        id=f"{name}-0123456789",
        name=name,
        hardware="cpu",
        backend="hf",
        max_batch=16,
        last_seen=100.0,
        version_held=3,
        tokens_per_s=1000.0,
        state="alive",
    )
    return SamplerStatus(**(base | account))


def status(mode, *samplers, step_s=0.3, max_staleness=1) -> StatusReply:
    cap = Capacity(
        train_s=0.25,
        step_s=step_s,
        trainer_busy=0.8,
        step_tokens=1000,
        needed_tokens_per_s=4000,
        swarm_tokens_per_s=3000,
        dissemination_s=0.2,
        staleness_to_overlap=1,
        max_staleness=max_staleness,
    )
    return StatusReply(
        mode=mode,
        latest_version=9,
        samplers=list(samplers),
        jobs={},
        rollouts={},
        ready_by_version={},
        capacity=cap,
    )


def test_a_slow_link_sampler_whose_groups_all_go_stale_is_named_with_the_cure():
    fast = sampler("box1", pushed=1280, consumed=1280, fetch_s=0.2)
    slow = sampler("box2", pushed=115, stale=115, fetch_s=1.45)
    said = warnings(status("async", fast, slow))
    assert said == [
        "box2 (box2-012): all of its 115 groups dropped stale: a version takes it 1.45 s "
        "against a 0.30 s step; try broker.sampler_dtype=bfloat16 (versions as deltas), or "
        "sampler.serve_peers, or broker.max_staleness >= 6"
    ]
    assert (
        "box2" in warnings(status("sync", slow))[0]
        and "broker.mode=async" in warnings(status("sync", slow))[0]
    )


def test_refusals_cancellations_and_lapses_are_named_and_healthy_samplers_are_not():
    st = status(
        "sync",
        sampler("ok", pushed=100, consumed=98, stale=2),
        sampler("liar", pushed=40, refused=30),
        sampler("slowpoke", pushed=10, cancelled=12),
        sampler("flaky", pushed=50, consumed=50, lapsed=3, leased=4, last_seen=90.0),
    )
    said = "\n".join(warnings(st))
    assert "ok (" not in said
    assert "liar (liar-012): 30 of its 40 groups refused" in said
    assert "slowpoke (slowpoke): 12 of its jobs taken back unfinished" in said
    assert "flaky (flaky-01): let 3 leases lapse" in said
    assert holding(st, now=100.0) == ["flaky (4 jobs, heard 10 s ago)"]


def test_status_marks_a_parked_sampler():
    """broker.activation = cheapest: `echorl status` shows who is parked, not just alive."""
    from rich.console import Console

    from echorl.cli import _status_view

    st = status("async", sampler("cheap", cost_per_hour=0.3), sampler("dear", parked=True))
    console = Console(width=200, record=True)
    for part in _status_view(st):
        console.print(part)
    text = console.export_text()
    rows = {line.split()[3]: line for line in text.splitlines() if "-0123456789" in line}
    assert "alive (parked)" in rows["dear"] and "parked" not in rows["cheap"]
