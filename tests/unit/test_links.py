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
