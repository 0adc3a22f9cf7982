"""A version in transit (echorl/transfer.py), a sampler's peer server passing it on while it
arrives (echorl/rollout/peers.py), and peers that misbehave (echorl/client.py)."""

import contextlib
import hashlib
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import echorl.client as client_module
from echorl.client import BrokerClient, BrokerUnavailable
from echorl.protocol import WeightSource, WeightVersion
from echorl.rollout.peers import PeerServer, Shelf, ticket
from echorl.transfer import Partial

BLOB = os.urandom(3 << 20)
SHA = hashlib.sha256(BLOB).hexdigest()


def test_whole_only_with_every_byte_and_the_right_ones(tmp_path):
    for path in (None, tmp_path / "v.part"):
        part = Partial(SHA, len(BLOB), path)
        part.write(BLOB[:100])
        assert not part.whole
        part.write(b"x" * (len(BLOB) - 100))
        assert not part.whole  # the right size, the wrong bytes
        part.restart()
        part.write(BLOB)
        assert part.whole and part.value() == BLOB
        part.close()


def test_a_file_left_by_a_cut_is_resumed_from_its_end(tmp_path):
    (tmp_path / "v.part").write_bytes(BLOB[:12345])
    part = Partial(SHA, len(BLOB), tmp_path / "v.part")
    assert part.have == 12345
    part.write(BLOB[12345:])
    assert part.whole  # the hash covers the bytes an earlier attempt left


def test_a_reader_waits_for_bytes_to_come_and_is_cut_off_by_a_failure():
    part = Partial(SHA, len(BLOB))
    part.write(BLOB[:10])
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("tail", part.read(10, 100, 0)))
    reader.start()
    part.write(BLOB[10:50])
    reader.join(5)
    assert got["tail"] == BLOB[10:50]
    waiting = threading.Thread(target=lambda: got.setdefault("cut", part.read(50, 100, 0)))
    waiting.start()
    part.fail()
    waiting.join(5)
    assert got["cut"] == b""


def test_a_restart_cuts_off_a_reader_of_the_bytes_before_it():
    """A peer passing a download on that starts over (wrong bytes) must not splice the new
    bytes onto the old ones for its reader: the reader is cut off, and asks again."""
    part = Partial(SHA, len(BLOB))
    part.restart()  # a source's first answer, with nothing in yet: no reader is cut off
    assert part.generation == 0
    part.write(b"x" * 100)
    generation = part.generation
    assert part.read(0, 50, generation) == b"x" * 50
    part.restart()
    part.write(BLOB[:200])
    assert part.read(50, 50, generation) == b""
    assert part.read(50, 50, part.generation) == BLOB[50:100]


def test_the_peer_server_passes_a_version_on_while_it_arrives():
    part = Partial(SHA, len(BLOB))
    part.write(BLOB[: 1 << 20])  # a third is in
    shelf = Shelf()
    shelf.put(part)
    with PeerServer(shelf, "127.0.0.1") as server:
        server.secret = "s3cret"
        url = server.url("127.0.0.1") + f"/v1/peer/weights/{SHA}"
        got = {}

        def read():
            auth = {"Authorization": f"Bearer {ticket('s3cret', SHA)}"}
            got["r"] = httpx.get(url, headers=auth, timeout=30)

        reader = threading.Thread(target=read)
        reader.start()
        part.write(BLOB[1 << 20 :])  # the rest, while the peer's response streams
        reader.join(30)
        assert got["r"].status_code == 200 and got["r"].content == BLOB
        # Resuming: Range from a byte on; past the end, 416; a wrong ticket, 403.
        auth = {"Authorization": f"Bearer {ticket('s3cret', SHA)}"}
        tail = httpx.get(url, headers=auth | {"Range": "bytes=1000-"})
        assert tail.status_code == 206 and tail.content == BLOB[1000:]
        past = httpx.get(url, headers=auth | {"Range": f"bytes={len(BLOB)}-"})
        assert past.status_code == 416
        other = {"Authorization": f"Bearer {ticket('another secret', SHA)}"}
        assert httpx.get(url, headers=other).status_code == 403
        # An expired ticket, and one whose expiry was moved on (the HMAC covers it): 403.
        old = ticket("s3cret", SHA, int(time.time()) - 1)
        assert httpx.get(url, headers={"Authorization": f"Bearer {old}"}).status_code == 403
        moved = f"{int(time.time()) + 60}.{old.partition('.')[2]}"
        assert httpx.get(url, headers={"Authorization": f"Bearer {moved}"}).status_code == 403
        assert server.served == 2 * len(BLOB) - 1000


class Misbehaving(BaseHTTPRequestHandler):
    """A peer that trickles its bytes, or sends garbage marked as gzip."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        if self.server.mode == "gzip":
            garbage = b"not gzip at all" * 1000
            self.send_header("Content-Length", str(len(garbage)))
            self.send_header("Content-Encoding", "gzip")
            self.end_headers()
            self.wfile.write(garbage)
            return
        self.send_header("Content-Length", str(len(BLOB)))
        self.end_headers()
        with contextlib.suppress(OSError):
            for _ in range(100):  # 100 bytes a second: would take a month
                self.wfile.write(BLOB[:10])
                self.wfile.flush()
                time.sleep(0.1)


def test_a_peer_that_trickles_or_sends_garbage_is_given_up_not_waited_for(monkeypatch):
    monkeypatch.setattr(client_module, "PEER_GRACE_S", 0.5)
    info = WeightVersion(version=0, sha256=SHA, size_bytes=len(BLOB))
    for mode in ("trickle", "gzip"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
        server.mode, server.daemon_threads = mode, True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        peer = WeightSource(
            url=f"http://127.0.0.1:{server.server_address[1]}", ticket=ticket("x", SHA)
        )
        with BrokerClient("http://127.0.0.1:9", retries=0) as client:
            t0 = time.monotonic()
            with pytest.raises(BrokerUnavailable):  # reported, and the broker asked instead
                client.receive(info, Partial(SHA, len(BLOB)), peer)
            assert time.monotonic() - t0 < 5, mode
        server.shutdown()


def test_a_flood_of_connections_gets_no_more_than_max_readers_threads_and_a_503():
    """Past MAX_READERS connections a peer answers 503 without a thread; a sampler takes
    that as TooSlow (the broker, and nothing reported: the flood may be anyone's)."""
    from echorl.rollout.peers import MAX_READERS

    info = WeightVersion(version=0, sha256=SHA, size_bytes=len(BLOB))
    with PeerServer(Shelf(), "127.0.0.1") as server:
        server.secret = "s3cret"
        url = server.url("127.0.0.1")
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_READERS)]

        def busy():
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
                return extra.recv(100).startswith(b"HTTP/1.1 503")

        wait_for(busy)  # once the server has taken the first MAX_READERS in
        peer = WeightSource(url=url, ticket=ticket("s3cret", SHA))
        client = BrokerClient("http://127.0.0.1:9", retries=0)
        with client, pytest.raises(client_module.TooSlow, match="busy"):
            client.receive(info, Partial(SHA, len(BLOB)), peer)
        for conn in held:
            conn.close()
        auth = {"Authorization": f"Bearer {ticket('s3cret', SHA)}"}
        target = f"{url}/v1/peer/weights/{SHA}"
        wait_for(lambda: httpx.get(target, headers=auth).status_code == 404)  # slots free


def test_connections_that_trickle_their_head_are_cut_and_one_address_holds_half_the_slots():
    """A byte every second never trips a read timeout: 20 such sockets kept a peer answering
    503 for 40 s. A head must be whole within HEAD_S; and one address holds at most
    MAX_PER_ADDRESS connections, so it cannot take every slot even while it lasts."""
    from echorl.rollout.peers import HEAD_S, MAX_PER_ADDRESS

    with PeerServer(Shelf(), "127.0.0.1") as server:
        server.secret = "s3cret"
        trickling = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
        stop = threading.Event()

        def trickle():
            while not stop.wait(1.0):
                for conn in trickling:
                    with contextlib.suppress(OSError):
                        conn.send(b"G")

        threading.Thread(target=trickle, daemon=True).start()
        try:
            time.sleep(0.5)
            answered = []
            for conn in trickling:
                conn.settimeout(HEAD_S + 3)
                try:
                    answered.append(conn.recv(100))  # 503 (over the cap), or b"" once cut
                except OSError as e:
                    answered.append(repr(e).encode())
            busy = sum(a.startswith(b"HTTP/1.1 503") for a in answered)
            assert busy == 20 - MAX_PER_ADDRESS and answered.count(b"") == MAX_PER_ADDRESS
            auth = {"Authorization": f"Bearer {ticket('s3cret', SHA)}"}
            target = f"{server.url('127.0.0.1')}/v1/peer/weights/{SHA}"
            assert httpx.get(target, headers=auth, timeout=5).status_code == 404  # served again
        finally:
            stop.set()
            for conn in trickling:
                conn.close()


def wait_for(predicate, timeout=10.0):
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)


def test_a_peer_under_the_brokers_min_rate_is_left_for_the_broker(monkeypatch):
    """Slow, not broken (it may be passing on a slow arrival): TooSlow, which obtain() does
    not report, a few seconds in, long before the 10 s grace of a trickling peer."""
    monkeypatch.setattr(client_module, "PEER_CHECK_S", 0.3)
    info = WeightVersion(version=0, sha256=SHA, size_bytes=len(BLOB))
    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    server.mode, server.daemon_threads = "trickle", True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    peer = WeightSource(url=url, ticket=ticket("x", SHA), min_rate=1e6)
    with BrokerClient("http://127.0.0.1:9", retries=0) as client:
        t0 = time.monotonic()
        with pytest.raises(client_module.TooSlow, match="under 1.00"):
            client.receive(info, Partial(SHA, len(BLOB)), peer)
        assert time.monotonic() - t0 < 3
    server.shutdown()


def test_a_delta_round_trips_and_a_zlib_bomb_is_refused_before_it_inflates():
    """A delta is applied to the held bytes; one that inflates past the most a delta of
    those weights can be (every word changed) is refused at that bound: a 509 KiB bomb
    once cost a sampler +1 GB before it was refused."""
    import tracemalloc
    import zlib

    import numpy as np

    from echorl.transfer import apply_delta, make_delta

    old = np.arange(4096, dtype="<u2").tobytes()
    words = np.frombuffer(old, "<u2").copy()
    words[[3, 700, 4000]] += 1
    new = words.tobytes()
    delta = make_delta(old, new)
    assert delta is not None and apply_delta(old, delta) == new
    bomb = zlib.compress(bytes(200 << 20), 9)  # 200 MiB of zeros in ~200 KiB
    tracemalloc.start()
    with pytest.raises(ValueError, match="inflating past 24584 bytes"):
        apply_delta(old, bomb)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20  # the bound's bytes, not the bomb's
    with pytest.raises(ValueError, match="not a delta"):
        apply_delta(old, b"not zlib at all")
