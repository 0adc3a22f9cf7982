"""One rollout step: generate G completions per problem and score them with the task,
or play G episodes per problem in a multi-turn environment.

Shared by the co-located loop and the sampler process, so both produce the same
`Group`s from the same seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

from echorl.config import SamplingConfig
from echorl.models.prompts import encode_prompts
from echorl.protocol import Completion as WireCompletion
from echorl.protocol import RolloutGroup, Turn
from echorl.sampler.backends.hf import Completion, HFBackend
from echorl.seeding import derive_seed
from echorl.tasks import Environment, Problem, Task, is_environment
from echorl.tasks.base import reward


@dataclass
class Group:
    """A GRPO group: one problem, G scored completions."""

    problem: Problem
    completions: list[Completion]
    rewards: list[float]
    version: int = 0  # policy version that generated every token


def rollout(
    backend: HFBackend,
    task: Task | Environment,
    problems: list[Problem],
    group_size: int,
    params: SamplingConfig,
    seed: int,
    version: int = 0,
    format_reward: float = 0.0,
) -> list[Group]:
    if is_environment(task):
        return play(backend, task, problems, group_size, params, seed, version)
    max_new = params.max_new_tokens or task.max_new_tokens
    outs = backend.generate([p.prompt for p in problems], group_size, params, max_new, seed)
    return [
        Group(p, comps, [reward(task, p, c.text, format_reward) for c in comps], version)
        for p, comps in zip(problems, outs)
    ]


def play(
    backend: HFBackend,
    env: Environment,
    problems: list[Problem],
    group_size: int,
    params: SamplingConfig,
    seed: int,
    version: int = 0,
) -> list[Group]:
    """G episodes per problem, all games advanced one turn per batched `generate`.

    A turn ends at a newline (or eos, which ends the episode: the model quit); the
    environment's observation is appended (log-prob 0, outside every turn) unless the
    episode is over. An episode also ends when another turn would not fit the model."""
    tok = backend.tokenizer
    newline = tok("\n", add_special_tokens=False)["input_ids"][-1]
    limit = getattr(backend.model.config, "max_position_embeddings", 1 << 30)
    prompts = encode_prompts(tok, [p.prompt for p in problems], params)
    owner = [i for i in range(len(problems)) for _ in range(group_size)]
    games = [env.episode(problems[i].seed) for i in owner]
    ids: list[list[int]] = [[] for _ in games]
    lps: list[list[float]] = [[] for _ in games]
    turns: list[list[tuple[int, int, int]]] = [[] for _ in games]
    returns, quit_ = [0.0] * len(games), [False] * len(games)
    live = list(range(len(games)))
    for turn in range(env.max_turns):
        live = [
            k for k in live if len(prompts[owner[k]]) + len(ids[k]) + env.max_action_tokens <= limit
        ]
        if not live:
            break
        outs = backend.generate_ids(
            [prompts[owner[k]] + ids[k] for k in live],
            params,
            env.max_action_tokens,
            derive_seed(seed, "turn", turn),
            stop_ids=(newline,),
        )
        still = []
        for k, out in zip(live, outs):
            start = len(ids[k])
            ids[k] += out.token_ids
            lps[k] += out.logprobs
            turns[k].append((start, len(ids[k]), version))
            obs, reward, done, _ = games[k].step(out.text)
            returns[k] += reward
            quit_[k] = out.finished
            if not (done or out.finished):
                obs_ids = tok(obs, add_special_tokens=False)["input_ids"]
                ids[k] += obs_ids
                lps[k] += [0.0] * len(obs_ids)
                still.append(k)
        live = still
    completions = [
        Completion(ids[k], lps[k], tok.decode(ids[k], skip_special_tokens=True), quit_[k], turns[k])
        for k in range(len(games))
    ]
    return [
        Group(
            p,
            completions[i * group_size : (i + 1) * group_size],
            returns[i * group_size : (i + 1) * group_size],
            version,
        )
        for i, p in enumerate(problems)
    ]


def to_wire(group: Group, job_id: int, gen_seconds: float = 0.0) -> RolloutGroup:
    """The group as a sampler pushes it to the broker (its rewards go as claims only)."""
    return RolloutGroup(
        job_id=job_id,
        version=group.version,
        completions=[
            WireCompletion(
                token_ids=c.token_ids,
                logprobs=c.logprobs,
                finished=c.finished,
                turns=None
                if c.turns is None
                else [Turn(start=s, end=e, version=v) for s, e, v in c.turns],
            )
            for c in group.completions
        ],
        claimed_rewards=group.rewards,
        gen_seconds=gen_seconds,
    )
