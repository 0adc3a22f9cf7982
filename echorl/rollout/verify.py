"""Verifiers off the caller's path: scoring in worker processes, every call bounded.

A verifier is the task's own code run on untrusted text: math-verify on a policy's
answer, a user's Python, an environment's replay or its next turn. One that never returns, or that
holds the interpreter lock in a big-integer loop, must stall neither the broker's
HTTP server nor a sampler nor an evaluation, nor another sampler's groups. `VerifierPool`
runs the scoring in `workers` spawned processes (no torch, no server: the task and the
tokenizer only), with one more started and idle as a spare. Each worker may grow by
`memory_mb` of address space; each completion gets `time_limit_s` of wall clock. A worker
past its time is killed (SIGKILL) and the spare takes its place at once (starting one takes
seconds: spawn, import the task; a new spare starts meanwhile); that completion scores 0. A
verifier that crashes its process or runs out of memory scores 0 the same way, and so does
one that raises (a bug in the verifier: the first traceback's last line is kept as
`first_error`). Failures are counted by kind (`timeout`, `crash`, `memory`, `error`).

No group waits for another submitter's: groups queue per `key` (the broker's: the sampler
that pushed them) and the workers serve the keys in turn, a batch holding one key's groups
only. A worker sends each group's verdict the moment it is scored. When it gives up on a
call, the rest of its batch (that group included, the call given up on scored 0) queues
again, and its key's turn comes after every other key's. So one submitter's pile of groups
that hang the verifier delays another's group by the calls already running (one time limit
at most), not by the pile.

    pool = VerifierPool(VerifierSpec("math_word", codec), workers=2)
    verdicts = pool.score([(problem_seed, completions), ...])      # blocking, in order
    pool.submit(tag, problem_seed, completions, done, key=sampler)  # the broker's way
    steps = pool.step([(key, problem_seed, actions), ...])          # environments, live
    pool.close()                                                    # kills the workers now

`done(pairs)` is called on the pool's thread with `[(tag, Verdict), ...]`: the groups that
named the same `done` and were scored by the time their worker's verdicts were read, so a
caller can store them in one transaction. A group not delivered when `close` is called never
is (the broker scores its stored groups again when it starts).

`step` plays a multi-turn environment's games one turn further, each move bounded the
same way: a game whose move overruns or crashes ends there with return 0. A worker keeps
the games it is playing; one that has not seen a game (a fresh worker after a kill, or
another worker of the pool) replays its earlier actions first, which an episode's being
a pure function of its seed and actions makes exact.

What runs inside a worker process is in `verify_worker.py`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import Any

from echorl.config import RunConfig
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion
from echorl.rollout.verify_worker import StoredGroup, Verdict, VerifierSpec, Wire, Work, serve

log = logging.getLogger("echorl.verify")

POLL_S = 0.02  # how often a waiting feeder checks its worker's clock
BATCH = 64  # groups per worker call at most: under load, one round trip scores many
START_TIMEOUT_S = 120.0  # a worker that is not ready by then will not be


def run_pool(cfg: RunConfig, codec: RunTokenizer, workers: int = 1) -> VerifierPool:
    """The run's verifier pool for samplers, trainers and evaluations: one worker and no
    spare (they score their own groups, one caller; a spare is the broker's, whose pool
    serves a swarm it does not trust, and would only slow their start)."""
    return VerifierPool(VerifierSpec.for_run(cfg, codec), workers, spare=False)


Done = Callable[[list[tuple[Any, Verdict]]], None]


def _size(work: Work) -> int:
    """How many bounded calls (completions) an item holds."""
    return len(work[2]) if work[0] == "score" else 1


def _wire(completions: list[Completion] | StoredGroup) -> Wire | StoredGroup:
    if isinstance(completions, StoredGroup):
        return completions
    turns = lambda c: None if c.turns is None else [(t.start, t.end, t.version) for t in c.turns]  # noqa: E731
    return [(list(c.token_ids), turns(c)) for c in completions]


def _last_line(tb: str) -> str:
    """What a traceback says went wrong, e.g. "ZeroDivisionError: division by zero"."""
    return tb.rstrip().rsplit("\n", 1)[-1]


@dataclass(eq=False)
class _Job:
    """A group (or a game's move) to score, and what is known of it already: the completions
    given up on (index -> kind), and how often a worker died holding it outside any call."""

    tag: Any
    work: Work
    done: Done
    key: Hashable
    skip: dict[int, str] = field(default_factory=dict)
    lost: int = 0

    def give_up(self, k: int, kind: str) -> None:
        """Completion `k` scores 0 as `kind`; every one, for k = -1 (the problem itself)."""
        for i in range(_size(self.work)) if k < 0 else (k,):
            self.skip.setdefault(i, kind)

    def settled(self) -> Verdict | None:
        """The verdict, once every completion is given up on: no worker needs to see it."""
        n = _size(self.work)
        return Verdict([0.0] * n, Counter(self.skip.values())) if len(self.skip) == n else None


class _Turns:
    """The pool's queue: jobs per key, each `take` a batch of the next key's oldest ones, so
    one submitter's pile never stands in front of another submitter's group. A key that is
    a (tier, group, who) tuple is served by tiers (every lower tier's job first), then its
    groups in turn, then each group's submitters in turn: the broker's keys are (0, id,
    id) for proven samplers and (1, operator, id) for the rest, so unproven identities wait
    behind proven work and all of one operator's take one turn (`broker.standing`). Any
    other key is (0, key, key)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # tier -> group -> who -> jobs; dicts in turn order (next turn first)
        self._tiers: dict[int, OrderedDict[Hashable, OrderedDict[Hashable, deque[_Job]]]] = {}
        self._size = 0
        self._closed = False

    def put(self, job: _Job) -> None:
        tier, group, who = _place(job.key)
        with self._cond:
            groups = self._tiers.setdefault(tier, OrderedDict())
            groups.setdefault(group, OrderedDict()).setdefault(who, deque()).append(job)
            self._size += 1
            self._cond.notify()

    def put_back(self, jobs: list[_Job]) -> None:
        """One key's jobs, ahead of its others, but the key's (and its group's) turn after
        every other's: its worker just gave up on a call, which another should not wait for
        again."""
        if not jobs:
            return
        key = jobs[0].key
        assert all(j.key == key for j in jobs), "a batch holds one key's jobs"
        tier, group, who = _place(key)
        with self._cond:
            groups = self._tiers.setdefault(tier, OrderedDict())
            members = groups.pop(group, OrderedDict())
            waiting = members.pop(who, deque())
            waiting.extendleft(reversed(jobs))
            members[who] = waiting
            groups[group] = members
            self._size += len(jobs)
            self._cond.notify(len(jobs))

    def take(self, feeders: int) -> list[_Job] | None:
        """The next key's oldest jobs: a feeder's share of all that wait (at least 1, at most
        BATCH: batches grow only under load, where a round trip per group would cost). Waits
        for one; None once closed."""
        with self._cond:
            while not self._tiers and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            tier = min(self._tiers)
            groups = self._tiers[tier]
            group, members = next(iter(groups.items()))
            who, waiting = next(iter(members.items()))
            n = min(len(waiting), BATCH, max(1, self._size // feeders))
            jobs = [waiting.popleft() for _ in range(n)]
            del members[who], groups[group]  # their next turns after every other's
            if waiting:
                members[who] = waiting
            if members:
                groups[group] = members
            if not groups:
                del self._tiers[tier]
            self._size -= n
            return jobs

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _place(key: Hashable) -> tuple[int, Hashable, Hashable]:
    if isinstance(key, tuple) and len(key) == 3 and isinstance(key[0], int):
        return key
    return (0, key, key)


class _Closed(Exception):
    """The pool is closing: the feeder stops where it is."""


class _GaveUp(Exception):
    def __init__(self, kind: str):
        self.kind = kind


@dataclass
class _Stuck:
    """Where a worker gave up: at the `index`-th job of its batch, on completion `k` (-1: the
    problem), or `k` None when it died outside any call."""

    index: int
    k: int | None
    kind: str


class _Worker:
    """One worker process and its pipe; replaced, never restarted, when it is killed or dies."""

    def __init__(self, ctx, spec: VerifierSpec, closing: threading.Event):
        self.ctx, self.spec, self.closing = ctx, spec, closing
        self.proc = None

    def start(self) -> _Worker:
        """Spawn the process and wait until it has loaded the task: RuntimeError if it cannot,
        _Closed if the pool closes meanwhile."""
        self.conn, child = self.ctx.Pipe()
        self.clock = self.ctx.Array("d", [0.0, -1.0, -1.0], lock=False)
        self.proc = self.ctx.Process(
            target=serve, args=(child, self.clock, self.spec), daemon=True, name="echorl-verifier"
        )
        try:
            self.proc.start()
        except BaseException:
            self.proc = None
            self.conn.close()
            raise
        finally:
            child.close()
        # Below the server that feeds it from its first import on: a spinning verifier, or a
        # spare starting, takes only idle CPU.
        with contextlib.suppress(OSError):
            nice = os.getpriority(os.PRIO_PROCESS, 0) + 10
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, min(nice, 19))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.conn.poll(0.1) and time.monotonic() < deadline:
            if self.closing.is_set():
                self.stop()
                raise _Closed
        said = self._recv() if self.conn.poll(0) else "no answer"
        if said != "ready":
            self.stop()
            if self.closing.is_set():  # the pool's close stopped it starting: no failure
                raise _Closed
            raise RuntimeError(
                f"a verifier worker for task {self.spec.task!r} failed to start: {said}"
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def _recv(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None

    def kill(self) -> None:
        """SIGKILL, from any thread (the thread that uses the worker stops it)."""
        proc = self.proc
        if proc is not None:
            proc.kill()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()
        self.proc = None

    def run(self, jobs: list[_Job], deliver: Callable[[list[tuple[int, Verdict]]], None]):
        """Score `jobs`, handing `deliver` each `(index, verdict)` as it comes (those that
        came together at once). Returns None once all are scored, or the `_Stuck` where this
        worker gave up, stopped, the jobs from there on unscored. _Closed if the pool closes."""
        scored = 0
        try:
            self.conn.send([(j.work, j.skip) for j in jobs])
            while scored < len(jobs):
                got = self._next()
                deliver(got)
                scored += len(got)
        except (_GaveUp, OSError) as e:  # OSError: it died before the batch was sent
            if self.closing.is_set():
                raise _Closed from None  # killed by `close`, not by its verifier
            in_call = self.clock[0] != 0 and int(self.clock[1]) == scored
            k = int(self.clock[2]) if in_call else None
            self.stop()
            return _Stuck(scored, k, e.kind if isinstance(e, _GaveUp) else "crash")
        return None

    def _next(self) -> list[tuple[int, Verdict]]:
        """The verdicts in the pipe, waiting for one; _GaveUp when the worker died or its call
        overran (the verdicts it sent before are read first)."""
        limit = self.spec.time_limit_s
        while True:
            if self.conn.poll(POLL_S):
                got = []
                while not got or self.conn.poll(0):
                    if (out := self._recv()) is None:
                        break
                    got.append(out)
                if got:
                    return got
                raise _GaveUp("crash")
            if self.closing.is_set():
                raise _Closed
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise _GaveUp("crash")
            started = self.clock[0]
            if started and time.monotonic() - started > limit:
                raise _GaveUp("timeout")


class VerifierPool:
    """`workers` verifier processes and a spare, fed from one queue served in turn by key;
    see the module docstring."""

    def __init__(self, spec: VerifierSpec, workers: int = 1, wait: bool = True, spare: bool = True):
        """`wait`: start the workers now and raise if one cannot load the task; otherwise
        each starts on its feeder thread (the broker answers /healthz meanwhile) and a
        group submitted before then waits for it. `spare`: keep one more started, once the
        workers are up, to replace a killed one at once."""
        assert workers >= 1, f"a verifier pool needs a worker, not {workers}"
        self.spec = spec
        self.failures: Counter = Counter()  # kind -> completions scored 0 (replaced, not changed)
        self.first_error: str | None = None  # the first verifier exception, e.g. "KeyError: 'x'"
        self.refused = 0
        self.busy_s = 0.0  # summed over workers: seconds spent scoring
        self.t0 = time.monotonic()
        self._ctx = mp.get_context("spawn")  # never fork a process with threads (a server, torch)
        self._lock = threading.Lock()
        self._turns = _Turns()
        self._closing = threading.Event()
        self._spare: _Worker | None = None
        self._spare_taken = threading.Condition()
        self.workers = [self._new_worker() for _ in range(workers)]
        # Each process is started by a thread that lives as long as the pool (a feeder, or the
        # spare's): the kernel kills a worker when the thread that started it ends.
        started = [Future() for _ in self.workers]
        self.threads = [
            threading.Thread(target=self._feed, args=(n, f), daemon=True, name="verify-feed")
            for n, f in enumerate(started)
        ]
        if spare:
            keep = threading.Thread(target=self._keep_spare, args=(started,), daemon=True)
            self.threads.append(keep)
        for t in self.threads:
            t.start()
        if wait:
            errors = [f.result() for f in started]  # ~1 s each, in parallel
            if any(errors):
                self.close()
                raise next(e for e in errors if e)

    def submit(
        self,
        tag: Any,
        seed: int,
        completions: list[Completion] | StoredGroup,
        done: Done,
        format_reward: float | None = None,
        key: Hashable = None,
    ) -> None:
        """Score the group of problem `seed` later; `done([(tag, verdict), ...])` gets it.
        `format_reward`: the spec's unless given (evaluation scores the verifier alone: 0).
        `key`: who submits it (the broker's: the sampler); keys are served in turn."""
        fr = self.spec.format_reward if format_reward is None else format_reward
        self._turns.put(_Job(tag, ("score", seed, _wire(completions), fr), done, key))

    def score(
        self, items: list[tuple[int, list[Completion]]], format_reward: float | None = None
    ) -> list[Verdict]:
        """Score (problem seed, completions) groups; blocks until all are scored."""
        futures = [Future() for _ in items]
        for fut, (seed, completions) in zip(futures, items):
            self.submit(fut, seed, completions, _resolve, format_reward)
        return self._results(futures)

    def step(self, games: list[tuple[Any, int, list[str]]]) -> list[Verdict]:
        """Each game `(key, problem seed, actions so far)` one turn on: its last action played.
        A verdict's `rewards` is that turn's reward and `observation` the environment's
        answer, None once the game is over (done, or its move overran: reward 0, counted in
        `failed`). Keys name games across turns; blocks until every game has moved."""
        futures = [Future() for _ in games]
        for fut, (key, seed, actions) in zip(futures, games):
            self._turns.put(_Job(fut, ("step", seed, (key, list(actions)), 0.0), _resolve, None))
        return self._results(futures)

    def _results(self, futures: list[Future]) -> list[Verdict]:
        """The verdicts, once all have come; RuntimeError if the pool closes first."""
        while wait_for(futures, timeout=0.1).not_done:
            if self._closing.is_set():
                raise RuntimeError(f"the verifier pool of {self.spec.task!r} was closed")
        return [f.result() for f in futures]

    def utilisation(self) -> float:
        """Fraction of the workers' time spent scoring since the pool started."""
        return self.busy_s / max(1e-9, (time.monotonic() - self.t0) * len(self.workers))

    def close(self) -> None:
        """Kill every worker now (no stuck call's time limit is waited for) and end the
        threads; groups not delivered by the time it returns never are."""
        self._closing.set()
        self._turns.close()
        with self._spare_taken:
            self._spare_taken.notify_all()
        for w in [*self.workers, self._spare]:
            if w is not None:
                w.kill()
        for t in self.threads:
            t.join(timeout=5)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the threads ---------------------------------------------------------------------------

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self.spec, self._closing)

    def _feed(self, slot: int, started: Future) -> None:
        """Feeder `slot`: starts its worker, then scores the batches `take` gives it."""
        try:
            started.set_result(self._first_start(slot))
            while (jobs := self._turns.take(len(self.workers))) is not None:
                self._score(slot, jobs)
        except _Closed:
            pass
        finally:
            if not started.done():
                started.set_result(None)
            self.workers[slot].stop()

    def _first_start(self, slot: int) -> Exception | None:
        """Start `slot`'s worker: None, or why it cannot (tried again with the first batch)."""
        try:
            self.workers[slot].start()
        except _Closed:
            raise
        except Exception as e:  # the task's module, or no process: the reason is told
            log.error("verifier worker for %r cannot start: %s", self.spec.task, e)
            return e
        return None

    def _score(self, slot: int, jobs: list[_Job]) -> None:
        """One batch in `slot`'s worker, each verdict delivered as it comes. Where the worker
        gives up, the rest of the batch queues again (`_requeue`)."""
        t0 = time.monotonic()
        try:
            worker = self._alive(slot)
        except _Closed:
            raise
        except Exception as e:  # no worker can start: every group scores 0
            log.error("task %s: verifier pool failed: %s", self.spec.task, e)
            for j in jobs:
                j.give_up(-1, "crash")
            return self._deliver([(j, j.settled()) for j in jobs])
        try:
            stuck = worker.run(jobs, lambda got: self._deliver([(jobs[i], v) for i, v in got]))
        finally:
            with self._lock:
                self.busy_s += time.monotonic() - t0
        if stuck is not None:
            self._requeue(jobs[stuck.index :], stuck)

    def _alive(self, slot: int) -> _Worker:
        """`slot`'s worker, or the spare (else a fresh one) in its place if it is dead."""
        worker = self.workers[slot]
        if worker.alive():
            return worker
        if worker.proc is not None:
            log.warning("task %s: a verifier worker died idle; replaced", self.spec.task)
        worker.stop()
        self.workers[slot] = self._take_spare() or self._new_worker().start()
        return self.workers[slot]

    def _requeue(self, jobs: list[_Job], stuck: _Stuck) -> None:
        """After a worker gave up at `jobs[0]`: the call it gave up on scores 0, or, where it
        died outside any call, the group is tried again once (twice: it kills its worker, as
        a crash). The jobs not settled by that queue again."""
        first, kind = jobs[0], stuck.kind
        if stuck.k is not None:
            why = f"over {self.spec.time_limit_s:g} s" if kind == "timeout" else "died"
            log.error("task %s: a verifier call %s; scoring it 0", self.spec.task, why)
            first.give_up(stuck.k, kind)
        else:
            first.lost += 1
            log.warning("task %s: a verifier worker died between calls", self.spec.task)
            if first.lost > 1:
                log.error("task %s: a group kills its verifier worker; scored 0", self.spec.task)
                first.give_up(-1, "crash")
        if (verdict := first.settled()) is not None:
            self._deliver([(first, verdict)])
            jobs = jobs[1:]
        self._turns.put_back(jobs)

    def _deliver(self, pairs: list[tuple[_Job, Verdict]]) -> None:
        """Count the verdicts, then hand them over: one call per `done`."""
        by_done: dict[int, tuple[Done, list]] = {}
        new_error = None
        with self._lock:
            for job, v in pairs:
                if v.failed:  # a new Counter: readers on other threads need no lock
                    self.failures = self.failures + v.failed
                self.refused += v.refused is not None
                if v.error and self.first_error is None:
                    new_error, self.first_error = v.error, _last_line(v.error)
                by_done.setdefault(id(job.done), (job.done, []))[1].append((job.tag, v))
        if new_error is not None:
            log.error(
                "task %s: the verifier raised (scored 0, counted as `error`; only the first is "
                "logged):\n%s",
                self.spec.task,
                new_error.rstrip(),
            )
        for done, got in by_done.values():
            try:
                done(got)
            except Exception:
                log.exception("verifier pool: the caller's callback failed")

    def _keep_spare(self, started: list[Future]) -> None:
        """The spare's thread: once the workers are up, keeps one more worker started, to
        take a killed one's place at once. It ends only with the pool: the processes it
        started (some now feeders' workers) die with it."""
        if any(f.result() for f in started):
            return  # the task cannot load: a spare could not either
        while not self._closing.is_set():
            with self._spare_taken:
                while self._spare is not None and not self._closing.is_set():
                    self._spare_taken.wait()
            if self._closing.is_set():
                break
            try:
                spare = self._new_worker().start()
            except _Closed:
                break
            except Exception as e:  # the feeders start their own instead
                log.warning("task %s: no spare verifier worker: %s", self.spec.task, e)
                self._closing.wait()
                break
            with self._spare_taken:
                self._spare = spare
        with self._spare_taken:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.stop()

    def _take_spare(self) -> _Worker | None:
        """The spare, if one is ready (a new one starts meanwhile)."""
        with self._spare_taken:
            spare, self._spare = self._spare, None
            self._spare_taken.notify()
        if spare is not None and not spare.alive():
            spare.stop()
            return None
        return spare


def _resolve(pairs: list[tuple[Future, Verdict]]) -> None:
    """The `done` of `score` and `step`: each verdict to its future."""
    for fut, verdict in pairs:
        fut.set_result(verdict)
