"""What each sampler's account says, in words, with the cure: read from a status reply (the
broker counts; this only reads), for `echorl status` and the trainer's stall message.

    for line in warnings(status):   # "box2: all 115 of its groups dropped stale: ..."
        print(line)
"""

from __future__ import annotations

import math

from echorl.protocol import SamplerStatus, StatusReply

ENOUGH = 8  # groups pushed before a share of them says anything


def warnings(st: StatusReply) -> list[str]:
    """A line for each sampler whose account shows waste, with what to do about it."""
    cap = st.capacity
    step_s = (cap.step_s or cap.train_s) if cap else None
    max_staleness = cap.max_staleness if cap else None
    lines = []
    for s in st.samplers:
        name = f"{s.name} ({s.id[:8]})"
        if s.pushed >= ENOUGH and s.stale >= s.pushed / 2:
            share = "all" if s.stale == s.pushed else f"{s.stale}"
            line = f"{name}: {share} of its {s.pushed} groups dropped stale"
            if s.fetch_s is not None and step_s:
                line += f": a version takes it {s.fetch_s:.2f} s against a {step_s:.2f} s step"
            cures = ["broker.sampler_dtype=bfloat16 (versions as deltas)", "sampler.serve_peers"]
            if st.mode == "async" and s.fetch_s and step_s:
                needed = math.ceil(s.fetch_s / step_s) + 1
                if max_staleness is None or needed > max_staleness:
                    cures.append(f"broker.max_staleness >= {needed}")
            elif st.mode == "sync":
                cures.append("broker.mode=async (its groups then count while fresh enough)")
            lines.append(f"{line}; try {', or '.join(cures)}")
        if s.pushed >= ENOUGH and s.refused >= s.pushed / 4:
            lines.append(
                f"{name}: {s.refused} of its {s.pushed} groups refused (its log says why: "
                "another tokenizer or task, a broken verifier, or it lies)"
            )
        if s.cancelled >= ENOUGH and s.cancelled >= s.pushed:
            lines.append(
                f"{name}: {s.cancelled} of its jobs taken back unfinished when the next "
                "version came (it is slower than a sync step): broker.lease_by_speed=true, "
                "or broker.mode=async"
            )
        if s.lapsed >= 2:
            lines.append(
                f"{name}: let {s.lapsed} leases lapse (stalled, killed, or holding jobs it does "
                "not work): each bars it a lease period"
            )
    return lines


def holding(st: StatusReply, now: float) -> list[str]:
    """The samplers holding jobs now (what the trainer waits for), longest silent first."""
    held = sorted((s for s in st.samplers if s.leased), key=lambda s: s.last_seen)
    return [f"{s.name} ({s.leased} jobs, heard {now - s.last_seen:.0f} s ago)" for s in held]


def share(s: SamplerStatus, st: StatusReply) -> float | None:
    """Its share of the groups the trainer consumed (of the samplers listed)."""
    total = sum(x.consumed for x in st.samplers)
    return s.consumed / total if total else None
