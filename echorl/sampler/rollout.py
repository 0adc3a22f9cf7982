"""One rollout step: generate G completions per problem and score them with the task.

Shared by the co-located loop and (later) the sampler process, so both produce
the same `Group`s from the same seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

from echorl.config import SamplingConfig
from echorl.protocol import Completion as WireCompletion
from echorl.protocol import RolloutGroup
from echorl.sampler.backends.hf import Completion, HFBackend
from echorl.tasks import Problem, Task
from echorl.tasks.base import safe_score


@dataclass
class Group:
    """A GRPO group: one problem, G scored completions."""

    problem: Problem
    completions: list[Completion]
    rewards: list[float]
    version: int = 0  # policy version that generated every token


def rollout(
    backend: HFBackend,
    task: Task,
    problems: list[Problem],
    group_size: int,
    params: SamplingConfig,
    seed: int,
    version: int = 0,
) -> list[Group]:
    max_new = params.max_new_tokens or task.max_new_tokens
    outs = backend.generate([p.prompt for p in problems], group_size, params, max_new, seed)
    return [
        Group(p, comps, [safe_score(task, p, c.text) for c in comps], version)
        for p, comps in zip(problems, outs)
    ]


def to_wire(group: Group, job_id: int, gen_seconds: float = 0.0) -> RolloutGroup:
    """The group as a sampler pushes it to the broker (its rewards go as claims only)."""
    return RolloutGroup(
        job_id=job_id,
        version=group.version,
        completions=[
            WireCompletion(token_ids=c.token_ids, logprobs=c.logprobs, finished=c.finished)
            for c in group.completions
        ],
        claimed_rewards=group.rewards,
        gen_seconds=gen_seconds,
    )
