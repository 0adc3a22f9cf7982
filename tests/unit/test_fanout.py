"""Who fetches a weight version from whom (broker/fanout.py): a breadth-first tree of the
broker's fan-out, peers that fail shunned, and nothing but the broker at fan-out 0."""

import pytest

from echorl.broker.fanout import (
    JUDGE_AFTER,
    LEAVE_SHARE,
    MIN_RATE_RANGE,
    SLOW_VERSIONS,
    FanOut,
    Speeds,
)
from echorl.protocol import Took
from echorl.rollout.peers import ticket

SHA = "ab" * 32


def swarm(degree: int, n: int) -> tuple[FanOut, dict[str, str]]:
    fan = FanOut(degree)
    secrets = {f"s{i}": fan.join(f"s{i}", f"http://10.0.0.{i}:9000") for i in range(n)}
    return fan, secrets


def sources(fan: FanOut, askers: list[str], size: int = 0) -> dict[str, str]:
    """Each asker's source of v0 (`size` bytes): 'broker' or the peer's id."""
    by_url = {url: sid for sid, (url, _) in fan.peers.items()}
    got = {}
    for asker in askers:
        s = fan.source(0, SHA, asker, None, size)
        got[asker] = "broker" if s.url is None else by_url[s.url]
    return got


def test_the_tree_is_breadth_first_and_each_source_serves_at_most_the_fanout():
    fan, secrets = swarm(2, 7)
    got = sources(fan, [f"s{i}" for i in range(7)])
    assert got == {
        "s0": "broker", "s1": "broker",  # the broker serves two itself
        "s2": "s0", "s3": "s1", "s4": "s0", "s5": "s1",  # then its children two each
        "s6": "s2",
    }  # fmt: skip
    named = fan.source(0, SHA, "late", None)  # a sampler that serves nobody is a taker only
    assert named.url == "http://10.0.0.3:9000"  # depth 2, no taker yet
    assert named.ticket == ticket(secrets["s3"], SHA)  # what s3 checks, under its own secret


def test_a_failed_peer_is_shunned_for_the_version_then_for_good():
    fan = FanOut(2)
    p, q = "http://10.0.0.1:9000", "http://10.0.0.2:9000"
    fan.join("p", p)
    fan.join("q", q)

    def broker_serves_p_and_q(v):
        assert fan.source(v, SHA, "p", None).url is None  # the broker serves two itself
        assert fan.source(v, SHA, "q", None).url is None

    broker_serves_p_and_q(0)
    assert fan.source(0, SHA, "a", None).url == p
    assert fan.source(0, SHA, "a", None).url == p  # asked again: the same, no second place
    assert fan.source(0, SHA, "a", q).url == p  # a can report only what it was given
    assert fan.source(0, SHA, "a", p).url == q  # p failed a: shunned for v0
    broker_serves_p_and_q(1)
    assert fan.source(1, SHA, "b", None).url == p  # one sampler's word is not enough ...
    assert fan.source(1, SHA, "b", p).url == q
    broker_serves_p_and_q(2)
    assert fan.source(2, SHA, "c", None).url == q  # ... two samplers': never again


def test_an_old_version_comes_from_the_broker_and_an_auditor_is_no_broker():
    fan = FanOut(1)
    fan.join("p", "http://10.0.0.1:9000")
    assert fan.source(5, SHA, "p", None).url is None
    assert fan.source(5, SHA, "@trainer", None).url == "http://10.0.0.1:9000"
    fan.source(7, SHA, "x", None)  # v7 is out: samplers keep v7 and v6 at most
    assert fan.source(5, SHA, "y", None).url is None


def test_fanout_zero_is_the_broker_alone_and_a_sampler_that_left_is_not_named():
    fan, _ = swarm(0, 2)
    assert sources(fan, ["s0", "s1"]) == {"s0": "broker", "s1": "broker"}
    fan, _ = swarm(1, 2)
    fan.source(0, SHA, "s0", None)
    fan.forget("s0")
    assert fan.source(0, SHA, "s1", None).url is None


def took(v, seconds, served=None):
    return Took(version=v, seconds=seconds, served=served)


def test_two_takers_find_a_peer_slow_none_blames_a_slow_arrival_or_its_own_line():
    sp = Speeds()
    for sid in ("p", "q", "a", "c", "e"):  # v0 from the broker at 100 B/s: their best
        sp.told(sid, took(0, 1.0), 100, None, 2, [])
    sp.told("f", took(0, 10.0), 100, None, 2, [])  # f's own line: 10 B/s at best
    sp.told("p", took(1, 1.0), 100, None, 2, [])
    sp.told("a", took(1, 10.0), 100, "p", 2, ["e"])  # 10 B/s from p, which could give 50 each
    assert sp.blamers == {"p": {"a"}} and sp.slow == {}  # one taker's word is not enough
    sp.told("a", took(1, 10.0), 100, "p", 2, ["e"])  # nor twice the same report
    assert sp.blamers == {"p": {"a"}}
    sp.told("e", took(1, 10.0), 100, "a", 1, [])  # as slow as a got it: a is not to blame
    sp.told("q", took(1, 1.0), 100, None, 2, [])
    sp.told("f", took(1, 10.0), 100, "q", 1, [])  # its own slow line: q is not to blame
    assert set(sp.blamers) == {"p"}
    sp.told("c", took(1, 10.0), 100, "p", 2, [])  # the second taker: p is slow
    assert sp.slow == {"p": (1, SLOW_VERSIONS)} and "p" not in sp.blamers
    assert [v for v in range(2, 10) if sp.is_slow("p", v)] == list(range(2, 2 + SLOW_VERSIONS))


def test_a_takers_report_waits_for_its_sources_own():
    sp = Speeds()
    for sid in ("r", "g", "h"):
        sp.told(sid, took(0, 1.0), 100, None, 2, [])
    sp.told("g", took(1, 10.0), 100, "r", 2, [])  # before r's own report of v1
    sp.told("h", took(1, 10.0), 100, "r", 2, [])
    assert sp.slow == {} and (1, "r") in sp.pending
    sp.told("r", took(1, 1.0), 100, None, 2, ["g", "h"])  # r got v1 at 100 B/s: judged now
    assert sp.slow == {"r": (1, SLOW_VERSIONS)} and not sp.pending


def test_a_peers_own_word_counts_against_what_its_takers_can_take():
    sp = Speeds()
    sp.told("line", took(0, 10.0), 100, None, 2, [])  # 10 B/s at best
    sp.told("p", took(0, 1.0, served=10.0), 100, None, 2, ["line"])  # as fast as line takes
    assert sp.slow == {}
    sp.told("p", took(1, 1.0, served=10.0), 100, None, 2, ["fresh"])  # fresh could take 100
    assert sp.slow == {"p": (1, SLOW_VERSIONS)}
    sp.told("p", took(1 + SLOW_VERSIONS, 1.0, served=1.0), 100, None, 2, ["fresh"])
    assert sp.slow == {"p": (1 + SLOW_VERSIONS, 2 * SLOW_VERSIONS)}  # again: twice as long


def test_absurd_reports_are_clamped_and_the_peer_is_still_named():
    fan = FanOut(1)
    for sid in ("p", "a", "b"):
        fan.join(sid, f"http://{sid}.peer:9000")
    sources(fan, ["p", "a"], 1 << 30)
    for sid in ("p", "a"):  # 1 GiB in a microsecond, and served at 1e12
        fan.source(1, SHA, sid, None, 1 << 30, took(0, 1e-6, served=1e12))
    named = fan.source(1, SHA, "b", None, 1 << 30)
    assert named.url is not None and named.min_rate == MIN_RATE_RANGE[1]  # not 2.5e10 B/s


def test_a_slow_peer_is_named_to_nobody_for_a_while_then_tried_again():
    fan = FanOut(2)
    for sid in ("p", "q", "a", "b"):
        fan.join(sid, f"http://{sid}.peer:9000")
    got = sources(fan, ["p", "q", "a", "b"], 100)
    assert got == {"p": "broker", "q": "broker", "a": "p", "b": "q"}
    fan.source(1, SHA, "p", None, 100, took(0, 1.0, served=5.0))  # passed v0 on at 5 B/s
    fan.source(1, SHA, "q", None, 100, took(0, 1.0))
    assert fan.speeds.slow == {"p": (0, SLOW_VERSIONS)}
    for v in range(1, 1 + SLOW_VERSIONS):
        named = {fan.source(v, SHA, s, None, 100).url for s in "pqab"}
        assert "http://p.peer:9000" not in named, v  # a leaf: it serves nobody
    v = 1 + SLOW_VERSIONS
    named = {fan.source(v, SHA, s, None, 100).url for s in "pqab"}
    assert "http://p.peer:9000" in named  # tried again once the while is over
    ms = fan.source(v, SHA, "late", None, 100).min_rate
    # a quarter of the median (p's and q's 100 B/s), clamped: no peer is left below 64 kB/s
    assert ms == max(LEAVE_SHARE * 100.0, MIN_RATE_RANGE[0])


def test_reports_about_sources_never_named_are_ignored():
    fan = FanOut(1)
    fan.join("p", "http://p.peer:9000")
    fan.join("a", "http://a.peer:9000")
    fan.source(0, SHA, "p", None, 100)
    fan.source(1, SHA, "a", None, 100, Took(version=0, seconds=1e4))  # a fetched no v0 here
    fan.source(1, SHA, "p", None, 100, Took(version=7, seconds=1e4))  # nor p a v7
    assert fan.speeds.slow == {} and fan.speeds.heard == {}


def test_a_shelf_times_its_peers_reads_while_any_is_reading():
    from echorl.rollout.peers import Shelf
    from echorl.transfer import Partial

    shelf = Shelf()
    assert shelf.served_rate(SHA) is None
    shelf.served(SHA, 0.0, 1.0, 100)  # not on the shelf: not counted
    shelf.put(Partial(SHA, 100))
    shelf.served(SHA, 0.0, 1.0, 100)
    shelf.served(SHA, 0.5, 1.0, 50)  # alongside the first
    shelf.served(SHA, 9.0, 10.0, 100)  # much later: the idle 8 s do not count
    assert shelf.served_rate(SHA) == pytest.approx(250 / 2.0)


def test_only_the_brokers_rates_measure_a_line():
    """Below a slow peer every rate is slow: a taker that only ever got versions there has
    no known line, so its slow source cannot hide behind it, and the median line (what
    min_rate is a quarter of) is the broker-fed samplers'."""
    sp = Speeds()
    sp.told("top", took(0, 1.0), 100, None, 1, [])
    sp.told("below", took(0, 20.0), 100, "top", 1, [])
    assert sp.best == {"top": 100.0} and sp.min_rate() == max(LEAVE_SHARE * 100, MIN_RATE_RANGE[0])
    sp.told("top", took(1, 1.0, served=5.0), 100, None, 1, ["below"])  # 5 of its 100 B/s
    assert sp.slow == {"top": (1, SLOW_VERSIONS)}


def test_untrusted_words_drop_no_peer_and_move_no_line_and_a_silent_peer_is_judged():
    """Two sybils each reporting an honest peer failed once made it never named again; a
    sybil's 86,400 s download set the median line (min_rate 6 B/s); a peer that never
    reported its own download was never judged, its takers' reports waiting for it. Now
    only trusted samplers' failure reports drop a peer for good and only their rates
    measure lines, and a taker's report is judged JUDGE_AFTER versions on without its
    source's."""
    size = 10_000_000
    trusted = {"p", "q", "a", "b"}
    fan = FanOut(1, trusted=lambda s: s in trusted)
    for sid in ("p", "q", "a", "b", "sybil1", "sybil2"):
        fan.join(sid, f"http://{sid}.peer:9000")
    for v, sybil in ((0, "sybil1"), (1, "sybil2")):
        fan.source(v, SHA, "p", None, size)  # the broker's
        assert fan.source(v, SHA, sybil, None, size).url == "http://p.peer:9000"
        fan.source(v, SHA, sybil, "http://p.peer:9000", size)  # "p failed me"
    assert fan.reporters == {}  # two untrusted words: p is not dropped
    fan.source(2, SHA, "p", None, size)
    assert fan.source(2, SHA, "a", None, size).url == "http://p.peer:9000"  # named again
    sp = Speeds(trusted=lambda s: s in trusted)
    sp.told("p", took(0, 1.0), size, None, 1, [])
    sp.told("sybil1", took(0, 86_400.0), size, None, 1, [])
    assert sp.best == {"p": size / 1.0}
    assert sp.min_rate() == LEAVE_SHARE * size  # the sybil's line is not a line
    # a peer q that never reports: its takers' word is judged JUDGE_AFTER versions later
    sp.told("a", took(0, 1.0), size, None, 1, [])
    sp.told("b", took(0, 1.0), size, None, 1, [])
    for taker in ("a", "b"):  # both got v1 from q at 80 kB/s
        sp.told(taker, took(1, size / 80e3), size, "q", 2, [])
    assert "q" not in sp.slow  # waiting for q's own report
    sp.told("p", took(1 + JUDGE_AFTER, 1.0), size, None, 1, [])  # versions go on
    assert sp.slow.get("q", (None,))[0] == 1  # a leaf now, from its takers' word


@pytest.mark.parametrize("first", ["relay", "takers"])
def test_a_failure_downstream_of_a_cutting_peer_is_charged_to_it(first):
    """A hostile peer h high in the tree cuts its taker p halfway; p starts again, which
    cuts p's own takers a and b, and they report p. Before, p (honest) was shunned for the
    version and, with two reporters, for good. Now the failure is h's whichever report
    comes first: p is named again (this version and the next), h is dropped for good."""
    fan = FanOut(1, trusted=lambda s: s != "h")
    for sid in ("h", "p", "a", "b", "c"):
        fan.join(sid, f"http://{sid}.peer:9000")
    fan.source(0, SHA, "h", None)  # the broker's one
    assert fan.source(0, SHA, "p", None).url == "http://h.peer:9000"
    assert fan.source(0, SHA, "a", None).url == "http://p.peer:9000"
    assert fan.source(0, SHA, "b", None).url == "http://a.peer:9000"
    fan.source(0, SHA, "c", None)
    if first == "relay":  # p's report of h reaches the broker before its takers' of p
        fan.source(0, SHA, "p", "http://h.peer:9000")
        fan.source(0, SHA, "a", "http://p.peer:9000")
    else:
        fan.source(0, SHA, "a", "http://p.peer:9000")
        fan.source(0, SHA, "p", "http://h.peer:9000")
    assert fan.reporters == {"h": {"p", "a"}}  # the cut is h's: two trusted samplers' word
    assert "p" not in fan.shunned[0] and "h" in fan.shunned[0]
    for v in (1, 2):
        fan.source(v, SHA, "p", None)
        assert fan.source(v, SHA, "a", None).url == "http://p.peer:9000"  # named again
        fan.source(v, SHA, "h", None)
        assert fan.source(v, SHA, "c", None).url != "http://h.peer:9000"  # never again


def test_an_untrusted_relay_cannot_pass_its_failures_upstream():
    """A sybil that cuts its takers and then says its own source cut it: its takers' word
    still counts against it (an excuse is a trusted sampler's, once a version)."""
    fan = FanOut(1, trusted=lambda s: not s.startswith("sybil"))
    for sid in ("p", "sybil", "a"):
        fan.join(sid, f"http://{sid}.peer:9000")
    fan.source(0, SHA, "p", None)
    assert fan.source(0, SHA, "sybil", None).url == "http://p.peer:9000"
    assert fan.source(0, SHA, "a", None).url == "http://sybil.peer:9000"
    fan.source(0, SHA, "a", "http://sybil.peer:9000")
    fan.source(0, SHA, "sybil", "http://p.peer:9000")
    assert fan.reporters == {"sybil": {"a"}} and "sybil" in fan.shunned[0]


def test_a_failure_passed_down_a_chain_of_relays_is_charged_to_where_it_began():
    """broker -> h -> p -> a -> b at fan-out 1: h cuts p, p's restart cuts a, a's cuts b.
    Every report lands on h, none on the honest relays p and a."""
    fan = FanOut(1, trusted=lambda s: s != "h")
    for sid in ("h", "p", "a", "b"):
        fan.join(sid, f"http://{sid}.peer:9000")
    chain = ["h", "p", "a", "b"]
    for asker in chain:
        fan.source(0, SHA, asker, None)
    for source, asker in reversed(list(zip(chain, chain[1:]))):  # the takers' reports first
        fan.source(0, SHA, asker, f"http://{source}.peer:9000")
    assert fan.reporters == {"h": {"p", "a", "b"}}
    assert fan.shunned[0] == {"h"}


def test_min_rate_is_a_share_of_the_takers_own_line_and_known_from_the_start():
    """A datacentre's line set every taker's min_rate: a cable taker (12.5 MB/s at best)
    left every peer, however fast, for the broker. And with no sampler trusted yet (every
    one at a swarm's start) there was no min_rate at all: takers waited out a cable relay's
    whole download. Now a taker's own line sets its min_rate, and while none is trusted the
    median of every sampler's line stands in (clamped: a liar moves it only so far)."""
    sp = Speeds(trusted=lambda s: False)
    assert sp.min_rate("anyone") is None  # nothing told yet
    sp.told("dc", took(0, 1.0), 1_250_000_000, None, 1, [])  # 1.25 GB/s
    sp.told("cable", took(0, 100.0), 1_250_000_000, None, 1, [])  # 12.5 MB/s
    sp.told("fiber", took(0, 10.0), 1_250_000_000, None, 1, [])  # 125 MB/s
    assert sp.best == {}  # nobody trusted: no line judges a peer
    assert sp.min_rate("cable") == pytest.approx(LEAVE_SHARE * 12.5e6)
    assert sp.min_rate("dc") == pytest.approx(LEAVE_SHARE * 1.25e9)
    assert sp.min_rate("new") == pytest.approx(LEAVE_SHARE * 125e6)  # the median line
    sp.trusted = lambda s: s == "cable"  # once one is trusted, the trusted lines' median
    sp.told("cable", took(1, 100.0), 1_250_000_000, None, 1, [])
    assert sp.min_rate("new") == pytest.approx(LEAVE_SHARE * 12.5e6)
    sp.trusted = lambda s: True  # a report from before it was trusted is no line
    sp.told("dc", took(1, 2.0), 1_250_000_000, None, 1, [])
    assert sp.best == {"cable": 12.5e6, "dc": 625e6}
    fan = FanOut(1, trusted=lambda s: s == "p")
    for sid in ("p", "cable"):
        fan.join(sid, f"http://{sid}.peer:9000")
    assert fan.source(0, SHA, "cable", None, 100).url is None  # the broker's
    fan.source(0, SHA, "p", None, 100)
    fan.source(1, SHA, "p", None, 100)
    named = fan.source(1, SHA, "cable", None, 100, took(0, 10.0))  # its own line: 10 B/s
    assert named.url == "http://p.peer:9000" and named.min_rate == MIN_RATE_RANGE[0]
