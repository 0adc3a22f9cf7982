"""The `Task` protocol: seeded prompts, a verifier that trusts nothing, demonstrations.

A task is a pure function of a seed: `problem(seed)` always returns the same
problem, so a broker, a sampler and a trainer that share only a seed agree on
the prompt and on the right answer. `score` receives untrusted model text and
must return a float in [0, 1] without raising.

Held-out problems are a partition of the problem *space*, not of seeds: a
problem whose text hashes into the held-out bucket is never produced by the
train stream, so evaluation never sees a prompt that training or warm-up saw.
"""

from __future__ import annotations

import logging
import math
import random
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

log = logging.getLogger(__name__)
Split = Literal["train", "eval"]
HELDOUT_BUCKETS = 8  # one problem in eight is held out


@dataclass(frozen=True)
class Problem:
    """One prompt and what the verifier needs to judge an answer to it."""

    task: str
    seed: int
    prompt: str
    answer: str  # the reference answer (one of possibly many right ones)
    data: dict = field(default_factory=dict, compare=False)

    @property
    def query(self) -> str | list[dict]:
        """What the model is asked: the prompt's text, or a dataset's chat messages."""
        return self.data.get("messages") or self.prompt


@runtime_checkable
class Task(Protocol):
    name: str
    max_new_tokens: int  # enough for any right answer plus eos

    def problem(self, seed: int) -> Problem:
        """The problem for `seed` (deterministic)."""
        ...

    def score(self, problem: Problem, completion: str) -> float:
        """Reward in [0, 1] for `completion`; malformed text scores 0 and never raises."""
        ...

    def demonstration(self, problem: Problem) -> str:
        """A right answer, as the model should write it, for the warm-up."""
        ...


@runtime_checkable
class Environment(Protocol):
    """A multi-turn task: the model acts, the environment answers, within one token sequence.

    The transcript is `problem(seed).prompt`, then turns of model text (ending at a newline,
    its stop token) each followed by the environment's observation text, until `done` or
    `max_turns`. An episode is a pure function of the seed and the action texts, so anyone
    can `replay` it: that is how the broker re-scores without trusting the sampler."""

    name: str
    max_turns: int
    max_action_tokens: int  # per model turn

    def problem(self, seed: int) -> Problem:
        """The first observation as the prompt; `answer` is a reference solution."""
        ...

    def episode(self, seed: int):
        """A fresh game: `.step(action_text) -> (observation, reward, done, info)`."""
        ...

    def replay(self, seed: int, actions: list[str]) -> tuple[list[float], list[str], bool]:
        """Per-turn rewards, the observation after each turn, and success, for these actions."""
        ...

    def demonstration_turns(self, problem: Problem) -> list[tuple[str, str]]:
        """A good episode for the warm-up: (action text incl. its newline, observation) turns."""
        ...


def play_actions(episode, actions: list[str], max_turns: int) -> tuple[list[float], list[str]]:
    """Per-turn rewards and observations of `actions` played in `episode` (a fresh game),
    up to `max_turns` and stopping when the game is done: the body of most `replay`s."""
    rewards, observations = [], []
    for text in actions[:max_turns]:
        obs, reward, done, _ = episode.step(text)
        rewards.append(reward)
        observations.append(obs)
        if done:
            break
    return rewards, observations


def is_environment(task: object) -> bool:
    return isinstance(task, Environment)


def is_heldout(problem: Problem) -> bool:
    """One problem in eight, by its text; a task that splits its own (a dataset's eval file)
    says so in `problem.data["heldout"]`."""
    if "heldout" in problem.data:
        return problem.data["heldout"]
    return zlib.crc32(problem.prompt.encode()) % HELDOUT_BUCKETS == 0


def problem_stream(task: Task, seed: int, split: Split = "train") -> Iterator[Problem]:
    """Endless, reproducible stream of problems of one split, drawn from `seed`."""
    rng = random.Random(f"{task.name}/{split}/{seed}")
    want_heldout = split == "eval"
    while True:
        problem = task.problem(rng.getrandbits(63))
        if is_heldout(problem) == want_heldout:
            yield problem


def take(task: Task, n: int, seed: int, split: Split = "train") -> list[Problem]:
    stream = problem_stream(task, seed, split)
    return [next(stream) for _ in range(n)]


def first_line(completion: str) -> str:
    """The answer part of a completion: text before the first newline, stripped."""
    return completion.split("\n", 1)[0].strip()


def success(reward):
    """A right answer or a solved episode: a reward of 1 or more (with a float tolerance, since
    an episode's return is a sum of per-step rewards). Elementwise on a tensor."""
    return reward >= 1.0 - 1e-6


_TAGGED = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def reward(
    task: Task, problem: Problem, text: str, format_reward: float = 0.0, strict: bool = False
) -> float:
    """The verifier's reward, plus `format_reward` when the answer sits in <answer> tags.
    The two stay apart: only the first says whether the answer is right. `strict`: a
    verifier's failure raises (`checked_score`) instead of scoring 0 (`safe_score`)."""
    bonus = format_reward if format_reward and _TAGGED.search(text) else 0.0
    score = checked_score if strict else safe_score
    return score(task, problem, text) + bonus


def checked_score(task: Task, problem: Problem, text: str) -> float:
    """The task's reward, clamped to [0, 1] (or the task's own `reward_range`). Raises what
    the verifier raises, and ValueError
    for a score that is not a finite number: the verifier pool counts these as `error`."""
    score = float(task.score(problem, text))
    if not math.isfinite(score):
        raise ValueError(f"task {task.name}: the verifier returned {score!r}")
    low, high = getattr(task, "reward_range", (0.0, 1.0))
    return min(max(score, low), high)


def safe_score(task: Task, problem: Problem, text: str) -> float:
    """`checked_score`, in process: a verifier that raises on model output, or returns no
    finite number, is a bug in the verifier; it is logged and scored 0 rather than killing
    the run. (The verifier pool's workers use `checked_score` and count the failures.)"""
    try:
        return checked_score(task, problem, text)
    except MemoryError:  # the verifier pool's memory limit: counted there, not swallowed
        raise
    except Exception:  # deliberate fault boundary: verifiers see untrusted text
        log.exception("task %s: verifier failed on %r; scoring 0", task.name, text[:200])
        return 0.0
