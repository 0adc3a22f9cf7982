"""The heartbeat thread outlives what a beat can meet on the way: a rate limit (429) on a
busy or saturated link is one missed beat, not the last one (before, the thread returned at
the first refusal of any kind, and the broker then lost a sampler that was working)."""

import time
from types import SimpleNamespace

from echorl.client import BrokerClient
from echorl.sampler.loop import Heartbeat
from tests.integration.conftest import (
    CREDENTIALS,
    free_port,
    query,
    register,
    start_broker,
    stop_broker,
)


def test_beats_go_on_through_rate_limits_and_stop_when_the_sampler_is_gone(tmp_path):
    proc, url = start_broker(tmp_path / "b", free_port(), "-o", "broker.sampler_calls_per_s=2")
    try:
        sid = register(url, "busy")
        client = BrokerClient(url, CREDENTIALS[sid])
        sampler = SimpleNamespace(version=None, sha256=None, name="busy")
        with Heartbeat(client, sid, 0.05, sampler) as beat:  # 20 beats/s against 2 calls/s
            # The rate limit answers 429 to most beats; one sampler's beats still get through.
            time.sleep(4.0)
            assert beat.thread.is_alive()
            (seen,) = query(tmp_path / "b", "SELECT last_seen FROM samplers WHERE id = ?", sid)
            assert time.time() - seen[0] < 2.0
            client.leave(sid)  # gone: its next admitted beat is refused for good
            beat.thread.join(timeout=10)
            assert not beat.thread.is_alive()
    finally:
        stop_broker(proc)
