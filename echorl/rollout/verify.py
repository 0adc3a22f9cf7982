"""Verifiers off the caller's path: scoring in worker processes, every call bounded.

A verifier is the task's own code run on untrusted text: math-verify on a policy's
answer, a user's Python, an environment's replay or its next turn. One that never returns, or that
holds the interpreter lock in a big-integer loop, must stall neither the broker's
HTTP server nor a sampler nor an evaluation. `VerifierPool` runs the scoring in
`workers` spawned processes (no torch, no server: the task and the tokenizer only).
Each worker may grow by `memory_mb` of address space; each completion gets
`time_limit_s` of wall clock. A worker past its time is killed (SIGKILL) and
replaced; that completion scores 0 and the rest of its batch is scored again by
the new worker. A verifier that crashes its process or runs out of memory scores 0
the same way. Failures are counted by kind (`timeout`, `crash`, `memory`).

    pool = VerifierPool(VerifierSpec("math_word", codec), workers=2)
    verdicts = pool.score([(problem_seed, completions), ...])      # blocking, in order
    pool.submit(tag, problem_seed, completions, done)               # the broker's way
    steps = pool.step([(key, problem_seed, actions), ...])          # environments, live
    pool.close()

`done(pairs)` is called on the pool's thread with `[(tag, Verdict), ...]`: every item
of one worker batch that named the same `done`, so a caller can store them in one
transaction.

`step` plays a multi-turn environment's games one turn further, each move bounded the
same way: a game whose move overruns or crashes ends there with return 0. A worker keeps
the games it is playing; one that has not seen a game (a fresh worker after a kill, or
another worker of the pool) replays its earlier actions first, which an episode's being
a pure function of its seed and actions makes exact.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import multiprocessing as mp
import os
import queue
import resource
import signal
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from echorl.config import RunConfig
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import MAX_GROUP_SIZE, Completion, ProtocolError, Turn

log = logging.getLogger("echorl.verify")

POLL_S = 0.02  # how often a waiting feeder checks its worker's clock
BATCH = 64  # groups per worker call: one round trip scores many
GAMES_HELD = 4096  # live games a worker keeps; one forgotten is replayed when asked again
START_TIMEOUT_S = 120.0  # a worker that is not ready by then will not be


@dataclass(frozen=True)
class VerifierSpec:
    """What a worker needs to score: the task (by the name `get_task` resolves), the run's
    tokenizer, the format bonus and the limits."""

    task: str
    codec: RunTokenizer
    format_reward: float = 0.0
    time_limit_s: float = 5.0
    memory_mb: int = 1024

    @classmethod
    def for_run(cls, cfg: RunConfig, codec: RunTokenizer) -> VerifierSpec:
        v = cfg.verify
        return cls(cfg.task.name, codec, cfg.task.format_reward, v.time_limit_s, v.memory_mb)


def run_pool(cfg: RunConfig, codec: RunTokenizer, workers: int = 1) -> VerifierPool:
    """The run's verifier pool (samplers, trainers and evaluations use one worker)."""
    return VerifierPool(VerifierSpec.for_run(cfg, codec), workers)


@dataclass
class Verdict:
    """The scores of one group: `rewards` (0 where the pool gave up), `failed` (kind ->
    completions it gave up on) and `refused` (the group is not what the task would produce,
    e.g. an episode transcript that is not the game's: store nothing)."""

    rewards: list[float]
    failed: Counter = field(default_factory=Counter)
    refused: str | None = None
    observation: str | None = None  # a step's: the environment's answer; None: the game is over


Done = Callable[[list[tuple[Any, Verdict]]], None]
Wire = list[tuple[list[int], list[tuple[int, int, int]] | None]]  # token ids, turns
# What a worker is sent per item: ("score", seed, Wire, format_reward), or
# ("step", seed, (game key, actions so far), 0.0) for one more turn of a live game.
Work = tuple[str, int, Any, float]
Result = tuple[list[float], Counter, str | None, str | None]  # rewards, failed, refused, obs


def _size(work: Work) -> int:
    """How many bounded calls (positions) an item holds."""
    return len(work[2]) if work[0] == "score" else 1


def _wire(completions: list[Completion]) -> Wire:
    turns = lambda c: None if c.turns is None else [(t.start, t.end, t.version) for t in c.turns]  # noqa: E731
    return [(list(c.token_ids), turns(c)) for c in completions]


def _completion(ids: list[int], turns) -> Completion:
    return Completion.model_construct(
        token_ids=ids,
        logprobs=[],
        finished=True,
        turns=None
        if turns is None
        else [Turn.model_construct(start=s, end=e, version=v) for s, e, v in turns],
    )


# -- the worker process ------------------------------------------------------------------------


def _limit_memory(mb: int) -> None:
    """Cap the address space at what the worker holds now plus `mb` (Linux; elsewhere the time
    limit alone bounds a call)."""
    try:
        with open("/proc/self/status") as f:
            held = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize:"))
    except (OSError, StopIteration):
        return
    limit = held + (mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when its parent dies (even by SIGKILL), so a
    verifier spinning forever never outlives the broker."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the pipe's EOF ends it
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _serve(conn, clock, spec: VerifierSpec) -> None:
    """A worker: load the task, say ready, then score batches until told to stop. `clock` is
    (the start of the call in progress, or 0; its position) for the parent to watch."""
    from echorl.rollout.scoring import score_completion
    from echorl.tasks import get_task, is_environment

    _die_with_parent()
    os.nice(10)  # below the server that feeds it: a spinning verifier takes only idle CPU
    try:
        task = get_task(spec.task)
    except Exception as e:  # the user's module: its error is the reason
        conn.send(f"{type(e).__name__}: {e}")
        return
    try:  # a first call imports what the verifier needs (math-verify: sympy): untimed
        if not is_environment(task):
            task.score(task.problem(0), "0")
    except Exception:
        pass
    _limit_memory(spec.memory_mb)
    games: OrderedDict = OrderedDict()  # key -> (episode, actions taken): the live games
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if msg is None:
            return
        batch, skip = msg
        out = []
        for g, (kind, seed, payload, format_reward) in enumerate(batch):
            base = g * (MAX_GROUP_SIZE + 1)
            if kind == "step":
                clock[1], clock[0] = base + 1, time.monotonic()
                out.append(_move(task, games, seed, *payload, skip.get(base + 1)))
                clock[0] = 0.0
                continue
            rewards, failed, refused = [], Counter(), None
            try:
                clock[1], clock[0] = base, time.monotonic()
                problem = task.problem(seed)
                for k, (ids, turns) in enumerate(payload):
                    pos = base + k + 1
                    if pos in skip:
                        rewards.append(0.0)
                        failed[skip[pos]] += 1
                        continue
                    clock[1], clock[0] = pos, time.monotonic()
                    try:
                        rewards.append(
                            score_completion(
                                task, problem, _completion(ids, turns), spec.codec, format_reward, k
                            )
                        )
                    except MemoryError:
                        rewards.append(0.0)
                        failed["memory"] += 1
            except ProtocolError as e:
                refused = str(e)
            except MemoryError:
                refused = "the task's problem could not be made within the memory limit"
            clock[0] = 0.0
            out.append((rewards, failed, refused, None))
        clock[1] = -1.0  # between batches: a death now is nobody's completion
        conn.send(out)


def _move(env, games: OrderedDict, seed: int, key, actions: list[str], skipped: str | None):
    """Game `key` one turn on: its last action played, from the episode this worker holds
    or from a replay of the earlier ones. An error ends the game with return 0."""
    held = games.pop(key, None)
    if skipped is not None:  # this move overran or crashed its worker before
        return [0.0], Counter({skipped: 1}), None, None
    try:
        if held is None or held[1] != len(actions) - 1:
            episode = env.episode(seed)
            for action in actions[:-1]:
                episode.step(action)
        else:
            episode = held[0]
        obs, reward, done, _ = episode.step(actions[-1])
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward {reward}")
    except MemoryError:
        return [0.0], Counter(memory=1), None, None
    except Exception as e:  # the environment's code on the policy's text
        log.debug("environment step failed: %s", e)
        return [0.0], Counter(error=1), None, None
    if done:
        return [reward], Counter(), None, None
    games[key] = (episode, len(actions))
    if len(games) > GAMES_HELD:
        games.popitem(last=False)
    return [reward], Counter(), None, str(obs)


# -- the parent's side -------------------------------------------------------------------------


class _Stuck(Exception):
    def __init__(self, position: int, kind: str):
        self.position, self.kind = position, kind


class _Worker:
    """One worker process and its pipe, restarted when it is killed or dies."""

    def __init__(self, ctx, spec: VerifierSpec):
        self.ctx, self.spec = ctx, spec
        self.proc = None

    def start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.clock = self.ctx.Array("d", [0.0, -1.0], lock=False)
        self.proc = self.ctx.Process(
            target=_serve, args=(child, self.clock, self.spec), daemon=True, name="echorl-verifier"
        )
        try:
            self.proc.start()
        except BaseException:
            self.proc = None
            self.conn.close()
            raise
        finally:
            child.close()
        said = self._recv() if self.conn.poll(START_TIMEOUT_S) else "no answer"
        if said != "ready":
            self.stop()
            raise RuntimeError(
                f"a verifier worker for task {self.spec.task!r} failed to start: {said}"
            )

    def _recv(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()
        self.proc = None

    def run(self, batch: list[Work]) -> list[Result]:
        """Score `batch`, restarting the worker past every completion it gives up on."""
        skip: dict[int, str] = {}
        idle_deaths = 0
        while True:
            if self.proc is not None and not self.proc.is_alive():
                self.stop()  # died between batches (killed, out of memory): a fresh one
            if self.proc is None:
                self.start()
            try:
                self.conn.send((batch, skip))
                return self._wait()
            except _Stuck as e:
                self.stop()
                if e.position < 0:  # died before it scored anything: killed idle, once
                    idle_deaths += 1
                    if idle_deaths > 1:  # or the batch itself kills it: it would again
                        raise RuntimeError(
                            f"a verifier worker for {self.spec.task!r} died before scoring"
                        ) from None
                    log.warning("task %s: a verifier worker died idle; restarted", self.spec.task)
                    continue
                why = f"over {self.spec.time_limit_s:g} s" if e.kind == "timeout" else "died"
                log.error("task %s: a verifier call %s; scoring it 0", self.spec.task, why)
                if e.position % (MAX_GROUP_SIZE + 1) == 0:  # the problem itself: the whole group
                    g = e.position // (MAX_GROUP_SIZE + 1)
                    for k in range(_size(batch[g])):
                        skip[e.position + k + 1] = e.kind
                else:
                    skip[e.position] = e.kind
            except (BrokenPipeError, OSError):
                self.stop()  # died between batches: a fresh one takes it

    def _wait(self):
        limit = self.spec.time_limit_s
        while True:
            if self.conn.poll(POLL_S):
                out = self._recv()
                if out is not None:
                    return out
                raise _Stuck(int(self.clock[1]), "crash")
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise _Stuck(int(self.clock[1]), "crash")
            started = self.clock[0]
            if started and time.monotonic() - started > limit:
                raise _Stuck(int(self.clock[1]), "timeout")


class VerifierPool:
    """`workers` verifier processes fed from one queue; see the module docstring."""

    def __init__(self, spec: VerifierSpec, workers: int = 1, wait: bool = True):
        """`wait`: start the workers now and raise if one cannot load the task; otherwise
        each starts on its feeder thread (the broker answers /healthz meanwhile) and a
        group submitted before then waits for it."""
        ctx = mp.get_context("spawn")  # never fork a process with threads (a server, torch)
        self.spec = spec
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.failures: Counter = Counter()  # kind -> completions scored 0 by the pool
        self.refused = 0
        self.busy_s = 0.0  # summed over workers: seconds spent scoring
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self.workers = [_Worker(ctx, spec) for _ in range(workers)]
        # Each worker is started (and restarted) by its own feeder thread, which lives as long
        # as the pool: the kernel kills a worker when the thread that started it ends.
        started = [Future() for _ in self.workers]
        self.threads = [
            threading.Thread(target=self._feed, args=(w, f), daemon=True, name="verify-feed")
            for w, f in zip(self.workers, started)
        ]
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
        completions: list[Completion],
        done: Done,
        format_reward: float | None = None,
    ) -> None:
        """Score the group of problem `seed` later; `done([(tag, verdict), ...])` gets it.
        `format_reward`: the spec's unless given (evaluation scores the verifier alone: 0)."""
        fr = self.spec.format_reward if format_reward is None else format_reward
        self.queue.put((tag, ("score", seed, _wire(completions), fr), done))

    def score(
        self, items: list[tuple[int, list[Completion]]], format_reward: float | None = None
    ) -> list[Verdict]:
        """Score (problem seed, completions) groups; blocks until all are scored."""
        futures = [Future() for _ in items]

        def done(pairs):
            for fut, verdict in pairs:
                fut.set_result(verdict)

        for fut, (seed, completions) in zip(futures, items):
            self.submit(fut, seed, completions, done, format_reward)
        return [f.result() for f in futures]

    def step(self, games: list[tuple[Any, int, list[str]]]) -> list[Verdict]:
        """Each game `(key, problem seed, actions so far)` one turn on: its last action played.
        A verdict's `rewards` is that turn's reward and `observation` the environment's
        answer, None once the game is over (done, or its move overran: reward 0, counted in
        `failed`). Keys name games across turns; blocks until every game has moved."""
        futures = [Future() for _ in games]

        def done(pairs):
            for fut, verdict in pairs:
                fut.set_result(verdict)

        for fut, (key, seed, actions) in zip(futures, games):
            self.queue.put((fut, ("step", seed, (key, list(actions)), 0.0), done))
        return [f.result() for f in futures]

    def utilisation(self) -> float:
        """Fraction of the workers' time spent scoring since the pool started."""
        return self.busy_s / max(1e-9, (time.monotonic() - self.t0) * len(self.workers))

    def _feed(self, worker: _Worker, started: Future) -> None:
        try:
            worker.start()
            started.set_result(None)
        except Exception as e:  # retried with the first batch; counted as crashes
            log.error("verifier worker for %r cannot start: %s", self.spec.task, e)
            started.set_result(e)
        while (first := self.queue.get()) is not None:
            items = [first]
            while len(items) < BATCH:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.queue.put(None)  # for this feeder's next turn: stop then
                    break
                items.append(item)
            t0 = time.monotonic()
            try:
                results = worker.run([work for _, work, _ in items])
            except Exception as e:  # a worker that cannot even start: every group scores 0
                log.error("task %s: verifier pool failed: %s", self.spec.task, e)
                results = [
                    ([0.0] * _size(w), Counter(crash=_size(w)), None, None) for _, w, _ in items
                ]
            by_done: dict[int, tuple[Done, list]] = {}
            with self._lock:
                self.busy_s += time.monotonic() - t0
                for (tag, _, done), (rewards, failed, refused, obs) in zip(items, results):
                    self.failures.update(failed)
                    self.refused += refused is not None
                    by_done.setdefault(id(done), (done, []))[1].append(
                        (tag, Verdict(rewards, failed, refused, obs))
                    )
            for done, pairs in by_done.values():
                try:
                    done(pairs)
                except Exception:
                    log.exception("verifier pool: the caller's callback failed")
        worker.stop()

    def close(self) -> None:
        for _ in self.workers:
            self.queue.put(None)
        for t in getattr(self, "threads", []):
            t.join(timeout=10)
        for w in self.workers:
            w.stop()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
