"""A long, lossy path (`bench/relay.py`: a user-space TCP relay SIMULATING delay and loss,
which this kernel's tc cannot put on a link): every byte arrives, a round trip takes two
delays, lost segments hold the stream; and a sampler that reaches the broker only through
it (100 ms round trips, 0.5% of segments lost) downloads every version, verified, and
delivers on-policy groups in a sync run beside a sampler on loopback."""

import os
import socket
import threading
import time

import pytest

from bench.relay import Relay
from echorl.models import save_tiny_model
from tests.integration.conftest import (
    free_port,
    query,
    start_broker,
    start_sampler,
    start_trainer,
    stop_broker,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def echo():
    """A TCP echo server on loopback; its address."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    def answer(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()
    srv.close()


def through(port, blob):
    """Send `blob` through the relay on `port` to the echo server; what came back."""
    got = bytearray()
    with socket.create_connection(("127.0.0.1", port)) as s:
        reader = threading.Thread(target=lambda: got.extend(iter_recv(s)))
        reader.start()
        s.sendall(blob)
        s.shutdown(socket.SHUT_WR)
        reader.join(60)
    return bytes(got)


def iter_recv(s):
    while data := s.recv(1 << 16):
        yield from data


def test_every_byte_arrives_in_order_late_by_the_delay_and_the_losses(echo):
    with (
        Relay(echo, delay_s=0.04) as relay,
        socket.create_connection(("127.0.0.1", relay.port)) as s,
    ):
        t0 = time.monotonic()
        s.sendall(b"x")
        assert s.recv(1) == b"x"
        assert time.monotonic() - t0 >= 2 * 0.04  # there and back
    blob = os.urandom(1 << 20)
    with Relay(echo, delay_s=0.005, loss=0.02, resend_s=0.01, seed=1) as relay:
        assert through(relay.port, blob) == blob
    counts = relay.counts
    segments = 2 * -(-len(blob) // 1448)  # both ways
    assert counts.bytes == 2 * len(blob) and counts.connections == 1
    assert 0.01 * segments < counts.lost_segments < 0.03 * segments
    assert counts.held_s == pytest.approx(counts.lost_segments * 0.01)
    with pytest.raises(ValueError, match="loss"):
        Relay(echo, loss=1.0)


@pytest.mark.long  # ~40 s: a sync run of 4 steps, one sampler behind the relay
def test_a_sampler_behind_a_long_lossy_path_delivers_on_policy(tmp_path):
    model = save_tiny_model(tmp_path / "v0", "1m", seed=0)
    run = ["-o", "task.name=add", "-o", "train.batch_prompts=4", "-o", "train.group_size=4"]
    run += ["-o", "train.drop_flat_groups=false", "-o", "broker.mode=sync"]
    data = tmp_path / "b"
    # Each holds at most half a step's jobs, so the near one cannot take every step's work.
    broker, url = start_broker(data, free_port(), *run, "-o", "broker.max_leased_per_sampler=2")
    port = int(url.rsplit(":", 1)[1])
    procs = []
    try:
        with Relay(("127.0.0.1", port), delay_s=0.05, loss=0.005) as relay:
            far = f"http://127.0.0.1:{relay.port}"
            procs = [
                start_sampler(far, model, "far", "--jobs-per-lease", "2", *run),
                start_sampler(url, model, "near", "--jobs-per-lease", "2", *run),
            ]
            trainer = start_trainer(url, model, tmp_path / "t", "-o", "train.steps=4", *run)
            out = trainer.communicate(timeout=300)[0]
            assert trainer.returncode == 0, out
    finally:
        for proc in procs:
            proc.terminate()
        logs = [proc.communicate(timeout=60)[0] for proc in procs]
        stop_broker(broker)
    assert relay.counts.connections >= 1 and relay.counts.lost_segments > 0, relay.counts
    rows = query(
        data,
        "SELECT consumed_step, version, name FROM rollouts JOIN samplers ON sampler_id = id "
        "WHERE rollouts.state = 'consumed'",
    )
    assert sorted(step for step, *_ in rows) == [s for s in range(4) for _ in range(4)]
    assert all(step == version for step, version, _ in rows)  # on-policy, through the relay too
    far_steps = {step for step, _, name in rows if name == "far"}
    assert len(far_steps) >= 2, (rows, logs[0][-2000:])  # it kept up with several versions
