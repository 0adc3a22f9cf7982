"""The trainer's broker I/O in a process of its own, so that the training process does
nothing but train.

    io = BrokerIO(client, cpus={1})       # starts the helper (spawn; it never imports torch)
    io.prefetch(step, n)                  # the helper pulls step's groups (a long poll)
    groups, wait = io.batch(step, stop)   # ... and hands them over when the trainer asks
    io.ack(ids, step, s, tokens, idle); io.audit(report)   # fire and forget, in order
    io.publish(state, meta, version)      # one copy into a shared buffer; checked, hashed, uploaded there
    io.wait()                             # that version is stored at the broker
    io.open_log(path, step); io.log(record, line)   # metrics.jsonl, TensorBoard, the console
    io.close()

Threads in the training process (the old prefetch and upload threads) hold the GIL
between the training thread's small operations: in async mode the step grew by 10-16% on
the same core. The helper is a separate process on the I/O cores (`--io-cpus`): it pulls,
parses, acks, reports audits, asks for the swarm's status, and hashes and uploads weight
versions (refusing one with a NaN or inf: NonFiniteWeights at the trainer's next wait),
and writes the trainer's metrics (JSONL, TensorBoard events, the step's console line). The
trainer writes each version once into a buffer both processes map (a file in /dev/shm, or
in the run's folder when /dev/shm is too small, unlinked as soon as both hold it, so no
crash leaves it behind) and sends the helper a few bytes saying so.

Ordering: acks, audits and uploads run in the order they were asked for, on one lane, so a
version the trainer has waited for implies every earlier ack landed. A failed call comes
back as the same exception (BrokerRejected, BrokerUnavailable, ...) at the trainer's next
wait; a helper that dies is an error there too. The helper exits when the trainer does
(its end of the pipe closes), whatever killed it.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from echorl import client as broker_client
from echorl.client import BrokerClient
from echorl.metrics import MetricsLog
from echorl.protocol import AuditReport, ScoredGroup

# A float is NaN or inf when every bit of its exponent is set.
EXPONENT = {
    "F64": ("<u8", 0x7FF0000000000000),
    "F32": ("<u4", 0x7F800000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
}


class NonFiniteWeights(RuntimeError):
    """The policy holds a NaN or inf: it is never published."""


def nonfinite_tensors(file: memoryview, chunk: int = 1 << 22) -> list[str]:
    """The names of the float tensors of safetensors `file` that hold a NaN or an inf."""
    import numpy as np

    n = int.from_bytes(file[:8], "little")
    header, base, broken = json.loads(bytes(file[8 : 8 + n])), 8 + n, []
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] not in EXPONENT:
            continue
        dtype, exponent = EXPONENT[info["dtype"]]
        start, end = info["data_offsets"]
        bits = np.frombuffer(file, dtype, (end - start) // np.dtype(dtype).itemsize, base + start)
        if any(
            ((bits[i : i + chunk] & exponent) == exponent).any() for i in range(0, len(bits), chunk)
        ):
            broken.append(name)
    return broken


def collect(
    client: BrokerClient, n: int, step: int, stop, wait_s: float = 1.0
) -> tuple[list[ScoredGroup] | None, dict]:
    """Pull until `n` groups are in hand, sorted by job id (so the batch does not depend on
    arrival order); None if `stop` (an Event) was set first. Each pull is a long poll that
    the broker answers as soon as groups are pushed. Also returns the idle time and stale
    drops, and the auditors alive."""
    groups, dropped, t0 = [], 0, time.perf_counter()
    held: set[int] = set()
    while len(groups) < n:
        if stop.is_set():
            return None, {}
        reply = client.pull(n - len(groups), step, wait_s)
        # A group pulled before and offered again (its pull lease ran out while the broker
        # was down) is the same group: held once, trained once.
        groups += [g for g in reply.groups if g.job_id not in held]
        held |= {g.job_id for g in reply.groups}
        dropped += reply.dropped_stale
    groups.sort(key=lambda g: g.job_id)
    return groups, {
        "trainer/idle_s": time.perf_counter() - t0,
        "broker/groups_dropped_stale": dropped,
        "broker/auditors": reply.auditors,  # alive at the last pull
        "broker/wasted_tokens": reply.wasted_tokens,  # sync's cancelled work, so far
        "broker/flat_refilled": reply.flat_refilled,  # dynamic sampling's set-aside groups, so far
        # Completions scored 0 because the task's own verifier failed (raised, hung, crashed).
        "verifier/errors": reply.verifier_failures,
        **({"verifier/first_error": reply.verifier_error} if reply.verifier_error else {}),
    }


def swarm_metrics(client: BrokerClient) -> dict[str, float]:
    """Samplers alive and their summed generation speed, as they last reported it."""
    status = client.status()
    alive = [s for s in status.samplers if s.state == "alive"]  # listed first, all of them
    return {
        "samplers/alive": status.sampler_counts.get("alive", len(alive)),
        "samplers/tokens_per_s": sum(s.tokens_per_s or 0.0 for s in alive),
    }


class IOProcessDied(RuntimeError):
    """The helper process is gone (killed, or out of memory)."""


class BrokerIO:
    """The training process's side: commands go down a pipe, answers come back on it."""

    def __init__(self, client: BrokerClient, cpus: set[int] | None = None, spill: Path = Path(".")):
        ctx = mp.get_context("spawn")  # a fork would copy the trainer's threads and torch state
        self.stopping = ctx.Event()
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(
            target=serve,
            args=(theirs, client.settings(), cpus, self.stopping),
            name="echorl-trainer-io",
            daemon=True,
        )
        self.proc.start()
        theirs.close()
        self.spill = spill  # where the buffer goes when /dev/shm has no room
        self.buffer: mmap.mmap | None = None
        self.batches: dict[int, tuple[list[ScoredGroup] | None, dict]] = {}
        self.publishing: int | None = None  # the version being uploaded
        self.last_s, self.last_bytes = 0.0, 0  # the last finished upload: seconds, bytes
        self.quarantined: dict[str, str] = {}  # answers to audits, until taken
        self.swarm: dict[str, float] = {}  # the last answer to a status call
        self.opened = False

    # -- commands ---------------------------------------------------------------------------

    def prefetch(self, step: int, n: int) -> None:
        self._send(("pull", step, n))

    def batch(
        self, step: int, stop: threading.Event, timeout: float | None = None
    ) -> tuple[list[ScoredGroup] | None, dict] | None:
        """Step `step`'s groups (prefetch them first); None for the groups if `stop` was set
        meanwhile; None outright if `timeout` seconds passed first (the pull goes on)."""
        if not self._until(lambda: step in self.batches, stop, timeout):
            return None
        return self.batches.pop(step)

    def ack(
        self, job_ids: list[int], step: int, train_s: float, tokens: int, idle_s: float
    ) -> None:
        self._send(("ack", job_ids, step, train_s, tokens, idle_s))

    def audit(self, report: AuditReport) -> None:
        self._send(("audit", report))

    def ask_swarm(self) -> None:
        self._send(("swarm",))

    def publish(self, state: dict, meta: dict[str, str] | None, version: int) -> None:
        """Copy `state` (as a safetensors file) into the shared buffer and have the helper
        upload it; waits for the previous upload first (the buffer is one copy)."""
        from echorl.trainer.weights import safetensors_size, write_safetensors

        self.wait()
        size = safetensors_size(state, meta)
        if self.buffer is None or len(self.buffer) < size:
            self._new_buffer(size)
        write_safetensors(state, meta, memoryview(self.buffer))
        self._send(("publish", version, size))
        self.publishing = version

    def open_log(
        self, path: Path, keep_through_step: int = 0, tracking: tuple[dict, dict] | None = None
    ) -> None:
        """The run's metrics go to `path` (and TensorBoard, W&B, MLflow as `tracking` says),
        from the helper: MetricsLog."""
        self._send(("log_open", path, keep_through_step, tracking))

    def log(self, record: dict, line: str | None = None) -> None:
        """Append `record` to the metrics and print `line`, in the helper."""
        self._send(("log", record, line))

    def wait(self) -> None:
        """Until the last version asked for is stored at the broker (its errors raise here)."""
        self._until(lambda: self.publishing is None)

    def poll(self) -> None:
        """Take in whatever answers arrived (audit results, status) without waiting."""
        while self.conn.poll():
            self._take(self._recv())

    def close(self) -> None:
        try:
            self.wait()
            self._send(("close",))
            self.proc.join(30)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
            self.conn.close()
            if self.buffer is not None:
                self.buffer.close()

    # -- plumbing ---------------------------------------------------------------------------

    def _new_buffer(self, size: int) -> None:
        """A file both processes map, unlinked once the helper has it open."""
        shm = Path("/dev/shm")
        where = shm if shm.is_dir() and shutil.disk_usage(shm).free > 2 * size else self.spill
        where.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="echorl-weights-", dir=where)
        try:
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.opened = False
        self._send(("buffer", path, size))
        try:
            self._until(lambda: self.opened)
        finally:
            os.unlink(path)
        if self.buffer is not None:
            self.buffer.close()
        self.buffer = buffer

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # a broken pipe: the helper is gone
            raise IOProcessDied(
                f"the trainer's I/O process exited ({self.proc.exitcode})"
            ) from None

    def _recv(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise IOProcessDied(
                f"the trainer's I/O process exited ({self.proc.exitcode})"
            ) from None

    def _until(
        self,
        done: Callable[[], bool],
        stop: threading.Event | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Take in answers until `done()`; False if `timeout` seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        while not done():
            if end is not None and time.monotonic() > end:
                return False
            if stop is not None and stop.is_set():
                self.stopping.set()  # the helper's pull gives up: its batch comes back None
            if self.conn.poll(0.2):
                self._take(self._recv())
            elif not self.proc.is_alive():
                raise IOProcessDied(f"the trainer's I/O process exited ({self.proc.exitcode})")
        return True

    def _take(self, msg: tuple) -> None:
        kind, *rest = msg
        if kind == "batch":
            step, groups, wait = rest
            self.batches[step] = (groups, wait)
        elif kind == "published":
            _, self.last_s, self.last_bytes = rest
            self.publishing = None
        elif kind == "audited":
            self.quarantined |= rest[0]
        elif kind == "swarm":
            self.swarm = rest[0]
        elif kind == "opened":
            self.opened = True
        elif kind == "error":
            name, status, reason = rest
            self.publishing = None
            if name == "NonFiniteWeights":
                raise NonFiniteWeights(reason)
            error = getattr(broker_client, name, None)
            if isinstance(error, type) and issubclass(error, broker_client.BrokerError):
                raise error(status, reason)
            raise RuntimeError(reason)


METRIC = re.compile(r"[A-Za-z0-9_./-]{1,64}")


def dashboard_numbers(record: dict, most: int = 256) -> dict[str, float]:
    """The finite numbers of a metrics record (`trackers.numbers`), under names the broker
    takes."""
    from echorl.trackers import numbers

    kept = {k: v for k, v in numbers(record).items() if math.isfinite(v) and METRIC.fullmatch(k)}
    return dict(list(kept.items())[:most])


def serve(conn, settings: dict, cpus, stopping) -> None:
    """The helper process: pulls on one thread, everything else in order on another."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when it stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    lock = threading.Lock()
    buffer: list[mmap.mmap] = []

    def reply(*msg) -> None:
        with lock:
            conn.send(msg)

    def guarded(work: Callable, *args) -> None:
        try:
            work(*args)
        except broker_client.BrokerError as e:
            reply("error", type(e).__name__, e.status, e.reason)
        except NonFiniteWeights as e:
            reply("error", "NonFiniteWeights", None, str(e))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the trainer
            reply("error", "RuntimeError", None, f"{type(e).__name__}: {e}")

    def ack(client: BrokerClient, job_ids: list[int], step: int, *numbers: float) -> None:
        client.ack(job_ids, step, *numbers)  # train_s, tokens, idle_s

    def audit(client: BrokerClient, report: AuditReport) -> None:
        reply("audited", client.audit(report))

    def swarm(client: BrokerClient) -> None:
        reply("swarm", swarm_metrics(client))

    told = []

    def metrics(client: BrokerClient, record: dict) -> None:
        """The step's numbers to the broker's dashboard: a broker that cannot take them
        (an older one) costs the dashboard its training view, never the run."""
        try:
            client.log_metrics(record["step"], dashboard_numbers(record))
        except broker_client.BrokerError as e:
            if not told:
                told.append(e)
                print(f"the broker's dashboard gets no trainer metrics: {e}", flush=True)

    def upload(client: BrokerClient, version: int, size: int) -> None:
        view = memoryview(buffer[-1])[:size]
        t0 = time.perf_counter()
        broken = nonfinite_tensors(view)  # no sampler ever generates from a broken policy
        if broken:
            raise NonFiniteWeights(
                f"version {version} has non-finite values in {len(broken)} tensors (e.g. "
                f"{broken[0]}): not published"
            )
        digest = hashlib.sha256(view).hexdigest()
        chunk = broker_client.CHUNK

        def chunks():
            for i in range(0, size, chunk):
                yield view[i : i + chunk]

        stored = client.publish_stream(version, digest, size, chunks)
        reply("published", version, time.perf_counter() - t0, stored.size_bytes)

    def pull(client: BrokerClient, step: int, n: int) -> None:
        reply("batch", step, *collect(client, n, step, stopping))

    def open_buffer(path: str, size: int) -> None:
        """Map the trainer's buffer (no upload is in flight: the trainer waited for it)."""
        with open(path, "r+b") as f:
            buffer.append(mmap.mmap(f.fileno(), size))
        if len(buffer) > 1:
            buffer.pop(0).close()
        reply("opened")

    def run(work: queue.Queue, handlers: dict[str, Callable]) -> None:
        """One thread's commands, in order, on its own connections."""
        client = BrokerClient(**settings, cancel=stopping)
        for cmd, *args in iter(work.get, None):
            guarded(handlers[cmd], client, *args)
        client.close()

    lane, pulls = queue.Queue(), queue.Queue()
    handlers = {"ack": ack, "audit": audit, "swarm": swarm, "publish": upload, "metrics": metrics}
    threads = [
        threading.Thread(target=run, args=(lane, handlers), daemon=True),
        threading.Thread(target=run, args=(pulls, {"pull": pull}), daemon=True),
    ]
    for t in threads:
        t.start()
    log: list[MetricsLog] = []

    def open_log(path: Path, keep_through_step: int, tracking) -> None:
        log[:] = [MetricsLog(path, keep_through_step, tensorboard=True, tracking=tracking)]

    def write_log(record: dict, line: str | None) -> None:
        log[0].write(record)
        if line:
            print(line, flush=True)
        if isinstance(record.get("step"), int):
            lane.put(("metrics", record))

    def exit_now() -> None:
        if log:  # every line is flushed as written; this ends the TensorBoard file
            log[0].close()
        os._exit(0)

    while True:
        try:
            cmd, *args = conn.recv()
        except (EOFError, OSError):  # the trainer is gone: nothing left to do it for
            exit_now()
        if cmd == "close":
            break
        if cmd == "log":  # in order with the commands around it, never behind a pull
            guarded(write_log, *args)
        elif cmd == "log_open":
            guarded(open_log, *args)
        elif cmd == "pull":
            pulls.put((cmd, *args))
        elif cmd == "buffer":
            guarded(open_buffer, *args)
        else:
            lane.put((cmd, *args))
    lane.put(None)
    pulls.put(None)
    threads[0].join()  # an upload in flight finishes; a pull in flight is dropped
    exit_now()
