"""Held-out evaluation on problems that training and warm-up never see: greedy accuracy,
and optionally pass@1 under the sampling policy (mean success of k samples per problem,
at the run's temperature), which is what RL optimises."""

from __future__ import annotations

from dataclasses import dataclass

from echorl.config import SamplingConfig
from echorl.rollout.backend import Backend
from echorl.rollout.generate import rollout
from echorl.rollout.verify import VerifierPool
from echorl.tasks import Task, take
from echorl.tasks.base import success


@dataclass
class EvalResult:
    accuracy: float  # greedy: fraction of problems with reward 1
    reward: float  # greedy: mean reward
    n: int
    pass1: float | None = None  # sampled: mean success over `samples` per problem
    samples: int = 0

    def record(self) -> dict[str, float]:
        """The metrics a run logs."""
        out = {"eval/accuracy": self.accuracy, "eval/reward": self.reward}
        return out if self.pass1 is None else out | {"eval/pass1": self.pass1}


def evaluate(
    backend: Backend,
    task: Task,
    n: int,
    seed: int = 0,
    params: SamplingConfig | None = None,
    samples: int = 0,
    chunk: int = 256,
    scorer: VerifierPool | None = None,
) -> EvalResult:
    """Greedy decoding (in `params`' prompt format), and `samples` draws per problem at
    `params`' temperature when `samples` > 0; the verifier's reward alone (success is a
    reward of at least 1: a solved episode, a right answer), in `scorer`'s bounded workers
    when given."""
    params = params or SamplingConfig()
    greedy = params.model_copy(update={"temperature": 0.0})
    problems = take(task, n, seed, split="eval")
    rewards: list[float] = []
    sampled: list[float] = []
    for i in range(0, n, chunk):
        part = problems[i : i + chunk]
        ids = backend.codec.encode_prompts([p.query for p in part], params)
        rewards += [
            g.rewards[0]
            for g in rollout(backend, task, part, ids, 1, greedy, seed=0, scorer=scorer)
        ]
        if samples:
            groups = rollout(
                backend, task, part, ids, samples, params, seed=seed + 1, scorer=scorer
            )
            sampled += [sum(map(success, g.rewards)) / samples for g in groups]
    return EvalResult(
        sum(map(success, rewards)) / n,
        sum(rewards) / n,
        n,
        sum(sampled) / n if samples else None,
        samples,
    )
