"""Scoring a group from its token ids: the one function the broker (where trust lives),
the sampler (its own claims) and evaluation all use, so they agree on every reward.

Single-turn tasks: the task's verifier on the completion decoded by the run's
tokenizer. Multi-turn environments: the episode is replayed from the problem's
seed with the action texts decoded from the model's turns; the observation
tokens between turns must be exactly what the environment says, or the group is
refused (a sampler cannot feed its model an easier game).
"""

from __future__ import annotations

import math

from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion, ProtocolError
from echorl.tasks import Environment, Problem, Task, is_environment
from echorl.tasks.base import reward


def score_group(
    task: Task | Environment,
    problem: Problem,
    completions: list[Completion],
    codec: RunTokenizer,
    format_reward: float = 0.0,
) -> list[float]:
    """Every completion's reward, in this process (unbounded: `verify.VerifierPool` runs this
    in workers with time and memory limits)."""
    return [
        score_completion(task, problem, c, codec, format_reward, k)
        for k, c in enumerate(completions)
    ]


def score_completion(
    task: Task | Environment,
    problem: Problem,
    c: Completion,
    codec: RunTokenizer,
    format_reward: float = 0.0,
    k: int = 0,
    strict: bool = False,
) -> float:
    """Completion `k`'s reward: the verifier on its text, or its episode's replayed return.
    `strict`: the verifier's exceptions propagate (the verifier pool counts them) rather than
    scoring 0 with a log line."""
    if is_environment(task):
        return replay_episode(task, problem.seed, c, codec, k)
    if c.turns is not None:  # the broker refuses these on arrival; never score them
        raise ProtocolError(f"completions[{k}]: turns on single-turn task {task.name}")
    ((start, end),) = c.spans  # all of it: no turns
    return reward(task, problem, codec.decode(c.token_ids[start:end]), format_reward, strict)


def replay_episode(
    env: Environment, seed: int, c: Completion, codec: RunTokenizer, k: int = 0
) -> float:
    """The episode's return, replayed; ProtocolError if its transcript is not the game's."""
    if c.turns is None:
        raise ProtocolError(f"completions[{k}]: {env.name} is multi-turn; the turns are missing")
    actions = [codec.decode(c.token_ids[start:end]) for start, end in c.spans]
    try:
        rewards, observations, _ = env.replay(seed, actions)
    except Exception as e:  # the environment's own code on untrusted actions
        raise ProtocolError(
            f"completions[{k}]: {env.name}'s replay raised {type(e).__name__}: {e}"
        ) from e
    if len(c.turns) > len(rewards):
        raise ProtocolError(
            f"completions[{k}]: {len(c.turns)} turns, but the episode ended after {len(rewards)}"
        )
    ends = [t.start for t in c.turns[1:]] + [len(c.token_ids)]
    for n, (turn, nxt) in enumerate(zip(c.turns, ends)):
        between = c.token_ids[turn.end : nxt]
        expected = [] if n == len(c.turns) - 1 else codec.encode(observations[n])
        if between != expected:
            raise ProtocolError(
                f"completions[{k}]: the tokens after turn {n} are not the environment's observation"
            )
    total = float(sum(rewards[: len(c.turns)]))
    if not math.isfinite(total):
        raise ProtocolError(f"completions[{k}]: {env.name}'s replay returned {total}")
    return total
