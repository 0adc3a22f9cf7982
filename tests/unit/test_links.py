"""The emulator's flow-level link model: transfer times from link rates, max-min sharing,
relays that pass on no faster than they receive, TCP's cap under loss."""

import asyncio
import math

import pytest

from echorl.emulate.links import Network, Node, path_cap, share

MB = 1e6
SPEEDUP = 20.0  # emulated seconds per real second (scheduling jitter stays ~1% of a transfer)


def run(coro):
    return asyncio.run(coro)


def test_one_transfer_takes_its_size_over_the_slower_link_plus_the_handshake():
    async def main():
        net = Network(SPEEDUP)
        broker, home = Node("broker", 1e9, 1e9), Node("home", 10 * MB, 1 * MB, rtt=0.1)
        t0 = net.now()
        await net.transfer(broker, home, 100 * MB)
        return net.now() - t0

    took = run(main())
    assert took == pytest.approx(10.0 + 1.5 * 0.1, rel=0.05)


def test_links_are_shared_max_min_fairly():
    """Two takers share the broker's 10 MB/s uplink; the one behind a 2 MB/s downlink gets 2,
    the other the remaining 8 (not 5 each)."""
    broker = Node("broker", 1e9, 10 * MB)
    fast, slow = Node("fast", 100 * MB, MB), Node("slow", 2 * MB, MB)
    from echorl.emulate.links import Flow

    flows = [Flow(broker, fast, 1, 1, math.inf), Flow(broker, slow, 1, 1, math.inf)]
    share(flows)
    assert [f.rate for f in flows] == [pytest.approx(8 * MB), pytest.approx(2 * MB)]

    async def main():
        net = Network(SPEEDUP)
        t0 = net.now()
        a = asyncio.create_task(net.transfer(broker, fast, 80 * MB))
        b = asyncio.create_task(net.transfer(broker, slow, 20 * MB))
        await asyncio.gather(a, b)
        return net.now() - t0

    assert run(main()) == pytest.approx(10.0, rel=0.05)  # both end together at 8 and 2 MB/s


def test_a_relay_passes_on_no_faster_than_it_receives():
    """Broker -> A at 10 MB/s; A -> B starts a moment later on a 100 MB/s path: B is done just
    after A, not ten times sooner."""

    async def main():
        net = Network(SPEEDUP)
        broker = Node("broker", 1e9, 10 * MB)
        a, b = Node("a", 1e9, 1e9), Node("b", 1e9, 1e9)
        t0 = net.now()
        first = asyncio.create_task(net.transfer(broker, a, 100 * MB))
        await net.sleep(1.0)
        flow_a = next(f for f in net.flows if f.taker is a)
        second = asyncio.create_task(net.transfer(a, b, 100 * MB, after=flow_a))
        await first
        t_a = net.now() - t0
        await second
        return t_a, net.now() - t0

    t_a, t_b = run(main())
    assert t_a == pytest.approx(10.0, rel=0.05) and t_a <= t_b <= t_a + 0.5


def test_loss_caps_a_long_path_at_tcps_rate():
    far = Node("far", 1e9, 1e9, rtt=0.2, loss=0.01)
    assert path_cap(Node("b", 1e9, 1e9), far) == pytest.approx(1.22 * 1460 / (0.2 * 0.1))
    assert path_cap(Node("b", 1e9, 1e9), Node("c", 1e9, 1e9)) == math.inf


def test_a_source_that_is_gone_fails_its_transfers():
    async def main():
        net = Network(SPEEDUP)
        peer, taker = Node("peer", 1e9, MB), Node("taker", 1e9, 1e9)
        task = asyncio.create_task(net.transfer(peer, taker, 100 * MB))
        await net.sleep(2.0)
        net.cut(peer, ConnectionError("peer gone"))
        with pytest.raises(ConnectionError):
            await task
        return net.flows

    assert run(main()) == []


def chain(net: Network, nodes: list[Node], size: float, grain: float) -> list:
    """Flows down `nodes` (the first the source), each taker passing on what arrives in
    pieces of `grain`, all asked for at once (before any has started)."""
    flows, after = [], None
    for a, b in zip(nodes, nodes[1:]):
        flows.append(net.open(a, b, size, after, grain))
        after = flows[-1]
    return flows


def test_a_chain_of_relays_finishes_a_piece_behind_its_head_not_a_piece_per_hop():
    """Broker -> 1 -> ... -> 8 at 10 MB/s, the first relay taking the broker's bytes in 1 MB
    pieces, the others as read (250 KB here): the last is done one piece (0.1 s) and six
    reads (0.025 s each) after the first, each taker advancing as far as its relay got in the
    same instant (advanced upstream first: in list order, each hop lagged a whole event).
    Slower emulated time here: each event's timer is ~1 real ms late."""

    async def main():
        net = Network(5.0)
        nodes = [Node(f"n{i}", 10 * MB, 10 * MB) for i in range(9)]
        flows = chain(net, nodes, 20 * MB, 250e3)
        flows[0].grain = 1 * MB
        t0, ends = net.now(), {}

        async def move(flow):
            await net.finish(await net.start(flow))
            ends[flow.taker.name] = net.now() - t0

        await asyncio.gather(*(move(f) for f in reversed(flows)))
        return ends

    ends = run(main())
    assert ends["n1"] == pytest.approx(2.0, rel=0.05)
    assert ends["n8"] == pytest.approx(2.0 + 0.1 + 6 * 0.025, abs=0.06)


def test_a_taker_named_before_its_relay_has_started_waits_for_it():
    """The relay's own arrival is asked for and not yet under way (its handshake, its ask):
    its taker gets nothing meanwhile, then follows it."""

    async def main():
        net = Network(SPEEDUP)
        broker = Node("broker", 1e9, 10 * MB, rtt=0.5)
        relay, taker = Node("relay", 1e9, 1e9, rtt=0.5), Node("taker", 1e9, 1e9)
        arrival = net.open(None, relay, 10 * MB)
        t0 = net.now()
        follow = asyncio.create_task(net.transfer(relay, taker, 10 * MB, after=arrival))
        await net.sleep(2.0)
        assert net.arrived(next(f for f in net.flows if f.taker is taker)) == 0.0
        arrival.source = broker
        await net.finish(await net.start(arrival))  # 1.5 s of handshake, then 1 s
        await follow
        return net.now() - t0

    assert run(main()) == pytest.approx(2.0 + 1.5 + 1.0, rel=0.05)


def test_a_relay_giving_up_its_arrival_fails_the_takers_it_was_feeding():
    async def main():
        net = Network(SPEEDUP)
        broker, relay = Node("broker", 1e9, MB), Node("relay", 1e9, 1e9)
        taker = Node("taker", 1e9, 1e9)
        arrival = await net.start(net.open(broker, relay, 100 * MB))
        fed = asyncio.create_task(net.transfer(relay, taker, 100 * MB, after=arrival))
        await net.sleep(1.0)
        net.drop(arrival, ConnectionError("the relay left its source"))
        with pytest.raises(ConnectionError):
            await fed
        return net.flows

    assert run(main()) == []
