"""A long, lossy path to the broker, in user space: a TCP relay that holds every chunk it
passes on for a one-way delay, and holds the stream longer where a segment was "lost".

This kernel has tc's tbf and htb (bandwidth: bench/netns.py) but neither netem nor tc's
actions, so latency and loss cannot be put on a veth. The relay is a SIMULATION of what
TCP makes of them, and is labelled so wherever it is used:

- delay: each chunk read is written out `delay_s` after it arrived (both directions, so a
  round trip gains 2 x delay_s), in order;
- loss: each 1448-byte segment of a chunk is lost with probability `loss`; TCP resends it,
  and the stream behind it waits (head-of-line) for `resend_s`, by default a round trip
  or TCP's 200 ms minimum retransmission timeout, whichever is longer.

Bytes are never dropped or altered: TCP delivers them, late. Bandwidth stays tc's job.

    with Relay(("127.0.0.1", broker_port), delay_s=0.05, loss=0.01) as relay:
        sampler_url = f"http://127.0.0.1:{relay.port}"

    python bench/relay.py --to 127.0.0.1:8000 --port 9000 --delay-ms 50 --loss 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import signal
import threading
import time
from dataclasses import dataclass, field

SEGMENT = 1448  # bytes of payload in one TCP segment on a 1500-byte link
CHUNK = 64 << 10
QUEUED = 64  # chunks held per direction of a connection: past that, the relay reads no more


@dataclass
class Counts:
    connections: int = 0
    chunks: int = 0
    bytes: int = 0
    lost_segments: int = 0
    held_s: float = 0.0  # extra seconds streams waited for resent segments
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Relay:
    """Listen on `host:port` (0: any free port) and relay every connection to `target`,
    delayed and lossy as above; runs its own event loop in a thread while entered."""

    def __init__(
        self,
        target: tuple[str, int],
        delay_s: float = 0.0,
        loss: float = 0.0,
        resend_s: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
    ):
        if not 0 <= loss < 1:
            raise ValueError(f"loss must be in [0, 1), not {loss}")
        self.target, self.delay_s, self.loss = target, delay_s, loss
        self.resend_s = max(0.2, 2 * delay_s) if resend_s is None else resend_s
        self.host, self.port = host, port
        self.random = random.Random(seed)
        self.counts = Counts()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="relay", daemon=True)

    def __enter__(self) -> Relay:
        self.thread.start()
        serving = asyncio.run_coroutine_threadsafe(self._serve(), self.loop)
        self.server = serving.result(timeout=10)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        async def close():
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    async def _serve(self) -> asyncio.Server:
        return await asyncio.start_server(self._relay, self.host, self.port)

    async def _relay(self, client_r, client_w) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        with self.counts.lock:
            self.counts.connections += 1
        try:
            await asyncio.gather(
                self._pipe(client_r, server_w),
                self._pipe(server_r, client_w),
                return_exceptions=True,
            )
        finally:
            for w in (client_w, server_w):
                w.close()

    def _extra(self, n: int) -> float:
        """Seconds the stream waits for the segments of an `n`-byte chunk that were lost."""
        segments = math.ceil(n / SEGMENT) if self.loss else 0
        lost = sum(self.random.random() < self.loss for _ in range(segments))
        with self.counts.lock:
            self.counts.chunks += 1
            self.counts.bytes += n
            self.counts.lost_segments += lost
            self.counts.held_s += lost * self.resend_s
        return lost * self.resend_s

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy `reader` to `writer`, each chunk leaving `delay_s` after it came (plus any
        resends), never before the chunk ahead of it; the end of the stream goes on too."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED)

        async def send():
            while True:
                due, data = await queue.get()
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()  # a reset ends the sender, and with it the reading

        async def offer(item: tuple[float, bytes]) -> bool:
            """Queue `item` unless the sender dies first (a full queue would wait forever)."""
            put = asyncio.ensure_future(queue.put(item))
            await asyncio.wait({put, sender}, return_when=asyncio.FIRST_COMPLETED)
            if not put.done():
                put.cancel()
            return put.done() and not put.cancelled()

        sender = asyncio.create_task(send())
        last = 0.0
        try:
            while data := await reader.read(CHUNK):
                last = max(last, time.monotonic() + self.delay_s) + self._extra(len(data))
                if not await offer((last, data)):
                    break
        finally:
            if not sender.done():
                await offer((max(last, time.monotonic() + self.delay_s), b""))
            await sender


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--to", required=True, help="HOST:PORT to relay to (the broker)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--delay-ms", type=float, default=50.0, help="one way")
    ap.add_argument("--loss", type=float, default=0.0, help="share of segments lost")
    args = ap.parse_args()
    host, port = args.to.rsplit(":", 1)
    relay = Relay(
        (host, int(port)), args.delay_ms / 1000, args.loss, host=args.host, port=args.port
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with relay:
        print(
            f"relaying {args.host}:{relay.port} -> {args.to}: {args.delay_ms:g} ms each way, "
            f"{args.loss:.1%} of segments lost (SIMULATED in user space); Ctrl-C stops",
            flush=True,
        )
        stop.wait()
    print(relay.counts)


if __name__ == "__main__":
    main()
