"""Benchmark: what each attack on trust (issue 32) costs a run now, against real broker
processes over real HTTP, beside what it cost before standing (the issue's measurements).

    python bench/trust.py [--only launder hoard turns peers cut claims]

Rows:
- launder: completions no generation emits (`[eos] + answer + [eos]`, an eos inside)
  pushed by a sampler: how many the broker stored (before: stored and scored 1; 17% of a
  run's consumed groups were one such sampler's).
- hoard sync / async: a run's step rate (2 honest samplers, B = 4, the 1m tiny model) while
  fresh identities each deliver one junk group and then lease and never push, against the
  same run's rate before the attack (the tests' bound: >= 80%).
- turns: seconds from a proven sampler's push to the trainer's pull of its group, 16 fresh
  identities' verifier-hanging groups pushed before it (bound: < 10 s).
- peers: two sybils each report an honest peer failed once: the share of the next 11
  versions it is named in; sybils' download reports of 86,400 s and 1e-6 s: the `min_rate`
  peers are named with (bounded by MIN_RATE_RANGE, from proven samplers' lines only).
- cut: a hostile peer high in the tree sends half a version and cuts: the worst fetch of the
  honest samplers below it (from the cut), against a fresh sampler's fetch of the version,
  and whether the honest relay is named at the next version.
- claims: a sampler telling the broker its speed (1e9 tokens/s): refused, as the wire has no
  such field; speeds are what the broker measures.

Prints a table; writes bench/results/trust.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The attacks are the tests' own (one copy): each test asserts the bound, this prints the number.
from echorl.broker.fanout import MIN_RATE_RANGE  # noqa: E402
from tests.integration import conftest as io  # noqa: E402
from tests.integration.test_hostile import CODEC, EOS, hoard_run, right_answer  # noqa: E402
from tests.integration.test_peers import cut_high, peer_swarm, sybil_reports  # noqa: E402
from tests.integration.test_trust import proven_group_delay  # noqa: E402

ATTACKS = ("launder", "hoard", "turns", "peers", "cut", "claims")


def launder(tmp: Path) -> list[dict]:
    proc, url = io.start_broker(tmp / "b", io.free_port())
    try:
        io.publish(url, 0, b"w")
        sid = io.register(url, "launderer")
        (job,) = io.lease(url, sid).json()["jobs"]
        answer = CODEC.encode(right_answer(job))
        forms = [[EOS, *answer, EOS], [*answer, EOS, *CODEC.encode("9"), EOS]]
        stored = 0
        for ids in forms:
            c = {"token_ids": ids, "logprobs": [-0.01] * len(ids), "finished": True}
            body = io.group(job) | {"completions": [io.group(job)["completions"][0], c]}
            r = httpx.post(
                f"{url}/v1/rollouts", json={"sampler_id": sid, "group": body}, headers=io.as_(sid)
            )
            stored += r.status_code == 200
    finally:
        io.stop_broker(proc)
    return [
        row(
            "launder",
            "completions with an eos before their end, stored",
            "2 of 2 (scored 1; 17% of a run's groups)",
            f"{stored} of {len(forms)} (422)",
            stored == 0,
            stored=stored,
            pushed=len(forms),
        )
    ]


def hoard(tmp: Path) -> list[dict]:
    rows = []
    for mode, before in (("sync", "9-17%"), ("async", "27%")):
        got = hoard_run(tmp / mode, mode, junk_first=True)
        share = got["attacked"] / got["honest"]
        rows.append(
            row(
                f"hoard {mode}",
                f"step rate under {got['identities']} sybils (1 junk group each, then "
                "hoarding) / honest rate",
                before,
                f"{share:.0%} ({got['attacked']:.2f} / {got['honest']:.2f} steps/s)",
                share >= 0.8,
                **got,
                share=share,
            )
        )
    return rows


def turns(tmp: Path) -> list[dict]:
    took = proven_group_delay(tmp, 16)
    return [
        row(
            "turns",
            "a proven group's push -> pull, behind 16 sybils' stuck groups",
            "40 s",
            f"{took:.1f} s",
            took < 10,
            seconds=took,
        )
    ]


def peers(tmp: Path) -> list[dict]:
    got = sybil_reports(tmp)
    named, versions, rates = got["named"], got["versions"], got["rates"]
    low, high = MIN_RATE_RANGE
    in_range = bool(rates) and all(low <= r <= high for r in rates)
    return [
        row(
            "peers: reports",
            "an honest peer two sybils reported failed: named in the next 11 versions",
            "0 of 11",
            f"{named} of {len(versions)}",
            named >= 0.8 * len(versions),
            named=named,
            versions=len(versions),
        ),
        row(
            "peers: min_rate",
            "min_rate after sybils' 86,400 s and 1e-6 s downloads (B/s)",
            "6 and 2.5e10",
            f"{min(rates):.3g} .. {max(rates):.3g}" if rates else "none",
            in_range,
            min_rate=[min(rates), max(rates)] if rates else None,
            range=list(MIN_RATE_RANGE),
        ),
    ]


def cut(tmp: Path) -> list[dict]:
    swarm = peer_swarm(tmp, 2)
    try:
        got = cut_high(next(swarm))
    finally:
        swarm.close()
    worst, control = max(got["recover_s"].values()), got["control_s"]
    return [
        row(
            "cut",
            "a peer high in the tree cuts halfway: the worst honest fetch below it after "
            "the cut, against a fresh sampler's fetch",
            "10.4-10.8 s against 0.45 s; the relays never named again that version",
            f"{worst:.2f} s against {control:.2f} s; named at v1: {', '.join(got['named at v1'])}",
            worst <= 2 * max(control, 0.05) and got["named at v1"][0] == "p",
            recover_s=got["recover_s"],
            control_s=control,
            named=got["named at v1"],
        )
    ]


def claims(tmp: Path) -> list[dict]:
    proc, url = io.start_broker(tmp / "b", io.free_port())
    try:
        io.publish(url, 0, b"w")
        sid = io.register(url, "boaster")
        r = httpx.post(
            f"{url}/v1/samplers/{sid}/heartbeat", json={"tokens_per_s": 1e9}, headers=io.as_(sid)
        )
        speed = httpx.get(f"{url}/v1/status", headers=io.as_(io.TRAINER)).json()["samplers"][0][
            "tokens_per_s"
        ]
    finally:
        io.stop_broker(proc)
    return [
        row(
            "claims",
            "a sampler's claim of 1e9 tokens/s: answer, and the speed the broker holds",
            "believed (the advice kept it alone)",
            f"{r.status_code}, {speed}",
            r.status_code == 422 and speed is None,
            status=r.status_code,
            speed=speed,
        )
    ]


def row(attack, measured, before, now, within, **numbers) -> dict:
    return {
        "attack": attack,
        "measured": measured,
        "before": before,
        "now": now,
        "within_bound": within,
        **numbers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "trust.json"))
    args = ap.parse_args()
    console, rows = Console(width=150), []
    t0 = time.monotonic()
    for name in args.only:
        console.log(f"attack: {name}")
        with tempfile.TemporaryDirectory() as tmp:
            rows += globals()[name](Path(tmp))
    table = Table(title="Trust: what each attack costs a run (2 cores; before = the issue's)")
    for col in ("attack", "measured", "before", "now", "within bound"):
        table.add_column(col)
    for r in rows:
        ok = "[green]yes[/]" if r["within_bound"] else "[red]NO[/]"
        table.add_row(r["attack"], r["measured"], r["before"], r["now"], ok)
    console.print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "wall_s": time.monotonic() - t0}, indent=1))
    console.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
