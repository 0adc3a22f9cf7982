"""Samplers serve the weights they hold (or are fetching) to their peers.

A new version's bytes need not all come from the broker: the broker names, for each sampler
that asks, a source (`POST /v1/versions/{v}/source`): itself for the first few, and after that
a sampler already fetching or holding the version. A sampler serves a version while it is
still arriving (each chunk is passed on as soon as it is in): the swarm updates in a pipeline,
about the time of one download from the broker plus the tree's depth in chunks, however many
samplers there are.

Nothing a peer sends is trusted: the bytes are checked against the sha256 the broker states,
and any failure (no answer, a cut, a wrong hash) sends the sampler to the broker, with the
peer reported so that it is not named again for that version. A peer serves only a caller
holding a ticket from the broker for that sha256 (an HMAC under the secret the broker gave
the peer at registration, with an expiry: TICKET_S), so the weights go nowhere the broker
did not send them, and a ticket passed on outlives its purpose by an hour at most.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from echorl.client import BrokerClient, BrokerError, TooSlow
from echorl.protocol import TICKET_PATTERN, Took, WeightVersion
from echorl.transfer import Partial

log = logging.getLogger("echorl.peers")

CHUNK = 1 << 20  # bytes per write to a peer
KEEP = 2  # versions a sampler keeps to serve: the one it holds and the one arriving
PEER_TRIES = 3  # peers tried for one version before the broker
MAX_READERS = 16  # connections a sampler serves at once (a version goes to peer_fanout)
MAX_PER_ADDRESS = MAX_READERS // 2  # of them from one address
HEAD_S = 5.0  # a connection's request head must be in this long after it opens (or idles)
TICKET_S = 3600  # a ticket admits its holder for this long (a big version's resumed reads)
TICKET = re.compile(TICKET_PATTERN)
RANGE = re.compile(r"bytes=([0-9]+)-$")


@dataclass
class Obtained:
    peer: str | None  # the peer that delivered, or None: the broker did
    failures: int  # peers that did not
    took: Took  # how long the source that delivered took: told to the broker with the next ask


def obtain(
    client: BrokerClient, info: WeightVersion, part: Partial, name: str, took: Took | None = None
) -> Obtained:
    """`info`'s bytes into `part`, from the source the broker names (a peer, with a ticket,
    or itself), trying up to PEER_TRIES peers, each failure reported with the next ask; from
    the broker once it names itself, a peer is too slow, or they all failed. `took`: the last
    version's time from its source, told with the first ask (how the broker finds slow
    peers). The time returned is charged to the last source named: from its naming, or, for
    a peer left as too slow, from its naming to the end of the broker's download."""
    failed, failures, t0 = None, 0, time.perf_counter()
    for _ in range(PEER_TRIES):
        source = client.source(info.version, failed, took)
        took = None
        if source.url is None:
            break
        try:
            client.receive(info, part, source)
            return Obtained(source.url, failures, timed(info.version, t0))
        except TooSlow as e:  # perhaps only passing on a slow arrival: not reported
            log.info("%s: peer %s too slow for version %d (%s)", name, source.url, info.version, e)
            part.restart()
            break
        except BrokerError as e:  # no answer, a cut, wrong bytes
            log.warning(
                "%s: peer %s did not deliver version %d (%s); asking the broker again",
                name,
                source.url,
                info.version,
                e,
            )
            failed, failures = source.url, failures + 1
            part.restart()
            t0 = time.perf_counter()  # the next source named is charged from here
    client.receive(info, part)
    return Obtained(None, failures, timed(info.version, t0))


def with_served(took: Took, shelf: Shelf | None, sha256: str) -> Took:
    """`took`, with how fast this sampler passed that version (`sha256`) on to its peers,
    if it serves them (`shelf`)."""
    if shelf is None:
        return took
    return took.model_copy(update={"served": shelf.served_rate(sha256)})


def timed(version: int, t0: float) -> Took:
    return Took(version=version, seconds=max(time.perf_counter() - t0, 1e-6))


def ticket(secret: str, sha256: str, expires: int | None = None) -> str:
    """What a peer with `secret` accepts as leave to read the version with `sha256` until
    `expires` (unix seconds; default TICKET_S from now): `EXPIRES.HMAC`."""
    expires = int(time.time() + TICKET_S) if expires is None else expires
    mac = hmac.new(secret.encode(), f"{sha256}:{expires}".encode(), hashlib.sha256)
    return f"{expires}.{mac.hexdigest()}"


def admits(secret: str | None, sha256: str, given: str) -> bool:
    """`given` is the broker's ticket for `sha256` under `secret`, and has not expired."""
    if secret is None or not TICKET.fullmatch(given):
        return False
    expires = int(given.partition(".")[0])
    return expires >= time.time() and hmac.compare_digest(given, ticket(secret, sha256, expires))


class Shelf:
    """The versions a sampler can serve, by sha256: the one it holds and the one arriving."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.parts: dict[str, Partial] = {}
        # sha256 -> (bytes sent to peers, seconds any peer was reading, when the last read
        # ended)
        self.serving: dict[str, tuple[int, float, float]] = {}
        self.lock = threading.Lock()

    def put(self, part: Partial) -> None:
        with self.lock:
            gone = [self.parts.pop(part.sha256, None)]
            self.parts[part.sha256] = part
            while len(self.parts) > self.keep:  # the oldest goes (dicts keep insertion order)
                gone.append(self.parts.pop(next(iter(self.parts))))
            for sha256 in [s for s in self.serving if s not in self.parts]:
                del self.serving[sha256]
        for old in gone:
            if old is not None and old.path is not None and old.path != part.path:
                old.path.unlink(missing_ok=True)

    def drop(self, sha256: str) -> None:
        with self.lock:
            part = self.parts.pop(sha256, None)
        if part is not None and part.path is not None:
            part.path.unlink(missing_ok=True)

    def get(self, sha256: str) -> Partial | None:
        with self.lock:
            return self.parts.get(sha256)

    def served(self, sha256: str, start: float, end: float, sent: int) -> None:
        """A peer read `sent` bytes of `sha256` from `start` to `end` (time.monotonic), told
        as each read ends: its time counts where no read that ended before it was going."""
        with self.lock:
            if sha256 in self.parts:
                total, busy, until = self.serving.get(sha256, (0, 0.0, float("-inf")))
                busy += max(0.0, end - max(start, until))
                self.serving[sha256] = (total + sent, busy, max(until, end))

    def served_rate(self, sha256: str) -> float | None:
        """Bytes/s `sha256` went out to peers while any was reading, all of them together
        (a late reader does not count the wait before it); None: it went to nobody."""
        with self.lock:
            sent, busy, _ = self.serving.get(sha256, (0, 0.0, 0.0))
        return sent / busy if sent and busy > 0 else None


class PeerServer:
    """A sampler's weights server for its peers: `GET /v1/peer/weights/{sha256}` with the
    broker's ticket as bearer token, `Range: bytes=N-` to resume. In a thread of its own."""

    def __init__(self, shelf: Shelf, host: str = "0.0.0.0", port: int = 0):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30  # a connection silent this long is closed (its thread freed)

            def log_message(self, *args) -> None:  # not on stderr: the sampler's log is for people
                log.debug("peer: " + args[0], *args[1:])

            def handle_one_request(self) -> None:
                # The socket timeout is per read: a byte every 20 s would hold a slot for
                # ever. The whole head must be in within HEAD_S, or the connection is cut.
                self.head = threading.Timer(HEAD_S, self.cut)
                self.head.start()
                try:
                    super().handle_one_request()
                finally:
                    self.head.cancel()

            def cut(self) -> None:
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                self.head.cancel()  # the head is in: the body may take as long as it takes
                server.serve(self)

        self.shelf = shelf
        self.secret: str | None = None  # the broker's, given at registration
        self.served = 0  # bytes sent to peers
        self.lock = threading.Lock()  # for `served`, added to by every serving thread
        self.http = _Bounded((host, port), Handler)
        self.port = self.http.server_address[1]
        self.thread = threading.Thread(target=self.http.serve_forever, name="peers", daemon=True)

    def serve(self, req: BaseHTTPRequestHandler) -> None:
        match = re.fullmatch(r"/v1/peer/weights/([0-9a-f]{64})", req.path)
        if match is None:
            return _refuse(req, 404, "no such route")
        given = req.headers.get("Authorization", "").removeprefix("Bearer ")
        if not admits(self.secret, match[1], given):
            return _refuse(
                req, 403, "no ticket (or an expired one) from the broker for this version"
            )
        part = self.shelf.get(match[1])
        if part is None:
            return _refuse(req, 404, "not held here")
        start = 0
        if wanted := req.headers.get("Range"):
            if not (m := RANGE.match(wanted)):
                return _refuse(req, 416, "only Range: bytes=N- is served")
            start = int(m[1])
            if start >= part.size:
                return _refuse(req, 416, "nothing after that byte")
        req.send_response(206 if start else 200)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Content-Length", str(part.size - start))
        if start:
            req.send_header("Content-Range", f"bytes {start}-{part.size - 1}/{part.size}")
        req.end_headers()
        sent, generation, t0 = start, part.generation, time.monotonic()
        try:
            while sent < part.size:
                chunk = part.read(sent, CHUNK, generation)
                if not chunk:  # failed, restarted or stalled: cut, and the reader goes elsewhere
                    break
                req.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # the reader went away
            pass
        finally:
            self.shelf.served(part.sha256, t0, time.monotonic(), sent - start)
            with self.lock:
                self.served += sent - start
            if sent < part.size:
                req.close_connection = True

    def url(self, host: str) -> str:
        """Where peers reach it, at `host` (an IPv6 address in brackets)."""
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def __enter__(self) -> PeerServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()


BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Bounded(ThreadingHTTPServer):
    """A thread per connection, at most MAX_READERS at once and MAX_PER_ADDRESS of them from
    one address: more are answered 503 and closed (the reader goes to the broker without
    reporting this peer: a flood of connections from anyone costs a sampler no more threads,
    and no standing with the broker)."""

    daemon_threads = True

    def __init__(self, *args):
        super().__init__(*args)
        self.slots = threading.BoundedSemaphore(MAX_READERS)
        self.lock = threading.Lock()
        self.per_address: Counter[str] = Counter()

    def process_request(self, request, client_address) -> None:
        address = client_address[0]
        with self.lock:
            room = self.per_address[address] < MAX_PER_ADDRESS
            if room:
                self.per_address[address] += 1
        if not (room and self.slots.acquire(blocking=False)):
            if room:
                self._leave(address)
            with contextlib.suppress(OSError):  # busy: no thread, one write, closed
                request.sendall(BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            self._leave(address)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()
            self._leave(client_address[0])

    def _leave(self, address: str) -> None:
        with self.lock:
            self.per_address[address] -= 1
            if not self.per_address[address]:
                del self.per_address[address]


def reachable_host(broker_url: str) -> str:
    """The address this machine reaches the broker from: where peers on the broker's network
    are likeliest to reach it (no packet is sent)."""
    parts = urlsplit(broker_url)
    family = socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        return s.getsockname()[0]


def _refuse(req: BaseHTTPRequestHandler, status: int, reason: str) -> None:
    body = reason.encode()
    req.send_response(status)
    req.send_header("Content-Type", "text/plain")
    req.send_header("Content-Length", str(len(body)))
    req.end_headers()
    req.wfile.write(body)
