"""Held-out evaluation: greedy accuracy on problems that training and warm-up never see."""

from __future__ import annotations

from dataclasses import dataclass

from echorl.config import SamplingConfig
from echorl.sampler.backends.hf import HFBackend
from echorl.sampler.rollout import rollout
from echorl.tasks import Task, take

GREEDY = SamplingConfig(temperature=0.0)


@dataclass
class EvalResult:
    accuracy: float  # fraction of problems with reward 1
    reward: float  # mean reward
    n: int


def evaluate(
    backend: HFBackend,
    task: Task,
    n: int,
    seed: int = 0,
    params: SamplingConfig | None = None,
    chunk: int = 256,
) -> EvalResult:
    """Greedy decoding (in `params`' prompt format); the verifier's reward alone."""
    greedy = GREEDY if params is None else params.model_copy(update={"temperature": 0.0})
    problems = take(task, n, seed, split="eval")
    rewards: list[float] = []
    for i in range(0, n, chunk):
        groups = rollout(backend, task, problems[i : i + chunk], 1, greedy, seed=0)
        rewards += [g.rewards[0] for g in groups]
    return EvalResult(sum(r >= 1.0 for r in rewards) / n, sum(rewards) / n, n)
