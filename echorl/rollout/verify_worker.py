"""Inside a verifier worker process (`verify.VerifierPool` spawns it): the task's verifier
on batches of groups, each verdict sent back the moment it is scored, each call's start on a
clock the parent watches. It knows nothing of the time limit (the parent kills it), the
queue, or who submitted what.
"""

from __future__ import annotations

import json
import math
import resource
import time
import traceback
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion, ProtocolError, Turn
from echorl.stopping import die_with_parent

if TYPE_CHECKING:
    from echorl.config import RunConfig

GAMES_HELD = 4096  # live games a worker keeps; one forgotten is replayed when asked again

Wire = list[tuple[list[int], list[tuple[int, int, int]] | None]]  # token ids, turns


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
        return cls(cfg.task.spec, codec, cfg.task.format_reward, v.time_limit_s, v.memory_mb)


@dataclass(frozen=True)
class StoredGroup:
    """A group's completions as the broker stored them: its JSON, parsed by the worker that
    scores it (the broker's process never builds their token lists). It was validated on
    arrival."""

    body: str
    size: int  # completions

    def __len__(self) -> int:
        return self.size

    def wire(self) -> Wire:
        turns = lambda c: c["turns"] and [(t["start"], t["end"], t["version"]) for t in c["turns"]]  # noqa: E731
        return [(c["token_ids"], turns(c)) for c in json.loads(self.body)["completions"]]


# What a worker is sent per item: ("score", seed, Wire, format_reward), or
# ("step", seed, (game key, actions so far), 0.0) for one more turn of a live game.
Work = tuple[str, int, Any, float]


@dataclass
class Verdict:
    """The scores of one group: `rewards` (0 where the pool gave up), `failed` (kind ->
    completions it gave up on) and `refused` (the group is not what the task would produce,
    e.g. an episode transcript that is not the game's: store nothing)."""

    rewards: list[float]
    failed: Counter = field(default_factory=Counter)
    refused: str | None = None
    observation: str | None = None  # a step's: the environment's answer; None: the game is over
    error: str | None = None  # the traceback of the first exception the verifier raised here
    parts: dict | None = None  # a dataset task's rewards: name -> (sum, count) over the group


def _completion(ids: list[int], turns) -> Completion:
    return Completion.model_construct(
        token_ids=ids,
        logprobs=[],
        finished=True,
        turns=None
        if turns is None
        else [Turn.model_construct(start=s, end=e, version=v) for s, e, v in turns],
    )


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


def serve(conn, clock, spec: VerifierSpec) -> None:
    """A worker: load the task, say ready, then score batches of `(Work, skip)` until told to
    stop, sending `(index in the batch, Verdict)` the moment each is scored. `clock` is (the
    start of the call in progress, or 0; its item's index in the batch; its completion's, -1
    while the problem is made) for the parent to watch."""
    from echorl.tasks import get_task, is_environment

    die_with_parent()
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
    if hasattr(task, "drain_tally"):  # that call's values are nobody's
        task.drain_tally()
    _limit_memory(spec.memory_mb)
    games: OrderedDict = OrderedDict()  # key -> (episode, actions taken): the live games
    conn.send("ready")
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if batch is None:
            return
        for i, ((kind, seed, payload, format_reward), skip) in enumerate(batch):
            clock[1] = i
            if kind == "step":
                _started(clock, 0)
                verdict = _move(task, games, seed, *payload)
            else:
                verdict = _score(task, spec, seed, payload, format_reward, skip, clock)
            clock[0] = 0.0  # before the send: a death after it is no call's
            conn.send((i, verdict))


def _started(clock, k: int) -> None:
    clock[2], clock[0] = k, time.monotonic()  # the position first: the parent reads it second


def _score(
    task, spec: VerifierSpec, seed: int, wire: Wire | StoredGroup, fr: float, skip, clock
) -> Verdict:
    """One group's verdict. A completion in `skip` (index -> kind) scores 0 as that kind
    unasked: a call on it overran or crashed before. A verifier that raises scores 0 as
    `error`, its first traceback kept."""
    from echorl.rollout.scoring import score_completion

    verdict = Verdict([])
    try:
        _started(clock, -1)
        problem = task.problem(seed)
        for k, (ids, turns) in enumerate(wire.wire() if isinstance(wire, StoredGroup) else wire):
            if k in skip:
                verdict.rewards.append(0.0)
                verdict.failed[skip[k]] += 1
                continue
            _started(clock, k)
            c = _completion(ids, turns)
            try:
                r = score_completion(task, problem, c, spec.codec, fr, k, strict=True)
            except ProtocolError:
                raise
            except MemoryError:
                r = 0.0
                verdict.failed["memory"] += 1
            except Exception:  # deliberate fault boundary: the verifier's bug, counted
                r = 0.0
                verdict.failed["error"] += 1
                verdict.error = verdict.error or traceback.format_exc()
            verdict.rewards.append(r)
    except ProtocolError as e:
        verdict.refused = str(e)
    except MemoryError:
        verdict.refused = "the task's problem could not be made within the memory limit"
    if hasattr(task, "drain_tally"):  # each reward's values, for its mean in the metrics
        verdict.parts = task.drain_tally()
    return verdict


def _move(env, games: OrderedDict, seed: int, key, actions: list[str]) -> Verdict:
    """Game `key` one turn on: its last action played, from the episode this worker holds
    or from a replay of the earlier ones. An error ends the game with return 0."""
    held = games.pop(key, None)
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
        return Verdict([0.0], Counter(memory=1))
    except Exception:  # the environment's code on the policy's text: counted
        return Verdict([0.0], Counter(error=1), error=traceback.format_exc())
    if done:
        return Verdict([reward])
    games[key] = (episode, len(actions))
    if len(games) > GAMES_HELD:
        games.popitem(last=False)
    return Verdict([reward], observation=str(obs))
