"""Who fetches a weight version from whom (broker/fanout.py): a breadth-first tree of the
broker's fan-out, peers that fail shunned, and nothing but the broker at fan-out 0."""

from echorl.broker.fanout import FanOut
from echorl.rollout.peers import ticket

SHA = "ab" * 32


def swarm(degree: int, n: int) -> tuple[FanOut, dict[str, str]]:
    fan = FanOut(degree)
    secrets = {f"s{i}": fan.join(f"s{i}", f"http://10.0.0.{i}:9000") for i in range(n)}
    return fan, secrets


def sources(fan: FanOut, askers: list[str]) -> dict[str, str]:
    """Each asker's source: 'broker' or the peer's id."""
    by_url = {url: sid for sid, (url, _) in fan.peers.items()}
    got = {}
    for asker in askers:
        s = fan.source(0, SHA, asker, None)
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
