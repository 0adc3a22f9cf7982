"""Who fetches a weight version from whom (broker/fanout.py): a breadth-first tree of the
broker's fan-out, peers that fail shunned, and nothing but the broker at fan-out 0."""

import pytest

from echorl.broker.fanout import SLOW_VERSIONS, FanOut
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


def test_a_peer_that_passes_versions_on_slowly_is_a_leaf_for_a_while():
    """p's uplink is slow: its two takers each got v0 at a twentieth of p's own rate, so
    from their next asks p is named to nobody for SLOW_VERSIONS versions, then tried again.
    A taker of p's taker, as slow as its parent, does not blame it."""
    fan = FanOut(2)
    for sid in ("p", "q", "a", "b", "c", "d", "e"):
        fan.join(sid, f"http://{sid}.peer:9000")
    size = 10 << 20
    got = sources(fan, ["p", "q", "a", "b", "c", "d", "e"], size)
    assert got == {"p": "broker", "q": "broker", "a": "p", "b": "q", "c": "p", "d": "q", "e": "a"}

    def ask(v, sid, seconds):
        return fan.source(v, SHA, sid, None, size, Took(version=v - 1, seconds=seconds))

    assert ask(1, "p", 1.0).url is None  # p got v0 from the broker at 10 MiB/s
    ask(1, "q", 1.0)
    ask(1, "a", 20.0)  # 0.5 MiB/s from p, to each of two takers: 1 of p's 10
    assert fan.slow == {"p": (0, SLOW_VERSIONS)}
    ask(1, "e", 20.0)  # as slow as a, its source, which passed on all it got: not to blame
    ask(1, "b", 1.2)  # q's takers: fine
    assert fan.slow == {"p": (0, SLOW_VERSIONS)}
    for v in range(1, SLOW_VERSIONS):
        named = {fan.source(v, SHA, s, None, size).url for s in "pqabcde"}
        assert "http://p.peer:9000" not in named, v  # a leaf: it serves nobody
    v = SLOW_VERSIONS
    named = {fan.source(v, SHA, s, None, size).url for s in "pqabcde"}
    assert "http://p.peer:9000" in named  # tried again once the while is over
    fan.source(v + 1, SHA, "p", None, size, Took(version=v, seconds=1.0, served=1.0))
    assert fan.slow == {"p": (v, 2 * SLOW_VERSIONS)}  # slow again: a leaf twice as long


def test_reports_about_sources_never_named_are_ignored():
    fan = FanOut(1)
    fan.join("p", "http://p.peer:9000")
    fan.join("a", "http://a.peer:9000")
    fan.source(0, SHA, "p", None, 100)
    fan.source(1, SHA, "a", None, 100, Took(version=0, seconds=1e4))  # a fetched no v0 here
    fan.source(1, SHA, "p", None, 100, Took(version=7, seconds=1e4))  # nor p a v7
    assert fan.slow == {} and set(fan.rate) == set()


def test_a_peer_that_says_it_passed_a_version_on_slowly_serves_nobody_next():
    """Its own word comes with its own ask, before it takes a place in the next tree."""
    fan = FanOut(1)
    for sid in ("p", "a", "b"):
        fan.join(sid, f"http://{sid}.peer:9000")
    sources(fan, ["p", "a"], 1000)  # the broker serves p, p serves a
    fan.source(1, SHA, "p", None, 1000, Took(version=0, seconds=1.0, served=100.0))
    assert fan.slow == {"p": (0, SLOW_VERSIONS)}  # it passed on 100 B/s of the 1000 B/s it got
    assert fan.source(1, SHA, "b", None, 1000).url is None  # not p: the broker, p being full
    fan.source(2, SHA, "a", None, 1000, Took(version=0, seconds=1.0, served=None))
    assert fan.slow == {"p": (0, SLOW_VERSIONS)}  # a served nobody: no word on itself


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


def test_a_peer_is_named_with_half_the_rate_samplers_got_their_last_versions_at():
    fan = FanOut(1)
    for sid in ("p", "a", "b"):
        fan.join(sid, f"http://{sid}.peer:9000")
    sources(fan, ["p", "a", "b"], 1000)  # broker -> p -> a -> b
    assert fan.source(0, SHA, "b", None).min_rate is None  # nothing measured yet
    for sid, seconds in (("p", 1.0), ("a", 2.0), ("b", 4.0)):
        fan.source(1, SHA, sid, None, 1000, Took(version=0, seconds=seconds))
    assert fan.rate == {"p": 1000.0, "a": 500.0, "b": 250.0}
    named = fan.source(1, SHA, "c", None, 1000)  # a newcomer, under a peer
    assert named.url is not None and named.min_rate == 0.5 * 500.0  # half the median
