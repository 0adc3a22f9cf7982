"""One rollout step: generate G completions per problem and score them with the task.

Shared by the co-located loop and (later) the sampler process, so both produce
the same `Group`s from the same seeds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from echorl.config import SamplingConfig
from echorl.protocol import Completion as WireCompletion
from echorl.protocol import RolloutGroup
from echorl.sampler.backends.hf import Completion, HFBackend
from echorl.tasks import Problem, Task

log = logging.getLogger(__name__)


@dataclass
class Group:
    """A GRPO group: one problem, G scored completions."""

    problem: Problem
    completions: list[Completion]
    rewards: list[float]
    version: int = 0  # policy version that generated every token


def safe_score(task: Task, problem: Problem, text: str) -> float:
    """The task's reward, clamped to [0, 1]. A verifier that raises on model output is a
    bug in the verifier; it is logged and scored 0 rather than killing the run."""
    try:
        return min(max(float(task.score(problem, text)), 0.0), 1.0)
    except Exception:  # deliberate fault boundary: verifiers see untrusted text
        log.exception("task %s: verifier raised on %r; scoring 0", task.name, text[:200])
        return 0.0


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
