"""The broker's store writer: one thread runs every hot-path store call, in batches.

Under a swarm, pushes and leases arrive faster than one commit each can keep up with,
and threads queueing on the store's lock starve whoever waits longest. Here calls queue
in two lanes; the writer takes what has queued while the last batch committed and runs
it as one transaction (`BrokerStore.batch`: one WAL commit, each call still all or
nothing on its own savepoint). The trainer's lane goes first and alone, and a batch
of sampler calls commits early when a trainer call arrives: a pull or an ack waits for
at most one sampler call, never behind the swarm's queue.

    writer = Writer(store)
    await asyncio.wrap_future(writer.samplers.submit(store.push, ...))   # or run_in_executor
    writer.close()

A call's future resolves after its batch is committed: an answered push is durable.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import Executor, Future

from echorl.broker.store import BrokerStore

log = logging.getLogger("echorl.broker")

TRAINER, SAMPLERS = 0, 1  # lanes, in the order they are served
MAX_BATCH = 32  # sampler calls per transaction: a trainer call waits for at most this many


class Lane(Executor):
    """Calls submitted here run on the writer's thread, in this lane's turn."""

    def __init__(self, writer: Writer, priority: int):
        self.writer, self.priority = writer, priority

    def submit(self, fn, /, *args, **kwargs) -> Future:
        return self.writer.put(self.priority, fn, args, kwargs)


class Writer:
    def __init__(self, store: BrokerStore):
        self.store = store
        self.queue: queue.PriorityQueue = queue.PriorityQueue()
        self.order = itertools.count()  # first come, first served within a lane
        self.trainer, self.samplers = Lane(self, TRAINER), Lane(self, SAMPLERS)
        self.closed = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="store-writer")
        self.thread.start()

    def put(self, priority: int, fn, args, kwargs) -> Future:
        future: Future = Future()
        if self.closed:
            future.set_exception(RuntimeError("the broker is shutting down"))
        else:
            self.queue.put((priority, next(self.order), (future, fn, args, kwargs)))
        return future

    def close(self) -> None:
        """Run what is queued, then stop."""
        self.closed = True
        self.queue.put((SAMPLERS + 1, next(self.order), None))
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            first = self.queue.get()
            if first[2] is None:
                return
            items = [first]
            while len(items) < (1 if first[0] == TRAINER else MAX_BATCH):
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if nxt[0] != first[0]:  # another lane (the trainer's, or the stop): its turn
                    self.queue.put(nxt)
                    break
                items.append(nxt)
            self._commit(items)

    def _trainer_waits(self) -> bool:
        heap = self.queue.queue  # a peek at the head (the GIL makes it consistent enough)
        return bool(heap) and heap[0][0] == TRAINER

    def _commit(self, items: list) -> None:
        """Run the calls of `items` in one transaction; a sampler batch stops early (the rest
        queued again, in their places) as soon as the trainer asks for something."""
        calls, outcomes = [], []
        try:
            with self.store.batch():
                for n, item in enumerate(items):
                    if n and item[0] == SAMPLERS and self._trainer_waits():
                        for rest in items[n:]:
                            self.queue.put(rest)
                        break
                    future, fn, args, kwargs = item[2]
                    calls.append(item[2])
                    if not future.set_running_or_notify_cancel():
                        outcomes.append(None)
                        continue
                    try:
                        outcomes.append((True, fn(*args, **kwargs)))
                    except Exception as e:  # this call's own refusal: its savepoint undone
                        outcomes.append((False, e))
        except Exception as e:  # the commit itself failed: nothing of the batch is stored
            log.exception("store batch of %d calls failed", len(calls))
            for future, *_ in calls:
                if future.running():
                    future.set_exception(e)
            return
        for (future, *_), outcome in zip(calls, outcomes):
            if outcome is None:
                continue
            ok, value = outcome
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
