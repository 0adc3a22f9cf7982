"""One rollout step: G completions per prompt, scored, or G episodes of a multi-turn
environment, as `ScoredGroup`s.

Shared by the sampler process, the co-located loop and evaluation, so all of them
produce the same groups from the same seeds and score them with the same
function as the broker. Prompts arrive as token ids (a job's `prompt_ids`, or
`RunTokenizer.encode_prompts` in process); nothing here encodes a prompt.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from echorl.config import SamplingConfig
from echorl.protocol import Completion, ScoredGroup, Turn
from echorl.rollout.backend import Backend
from echorl.rollout.scoring import score_group
from echorl.rollout.verify import VerifierPool
from echorl.seeding import derive_seed
from echorl.tasks import Environment, Problem, Task, is_environment


def rollout(
    backend: Backend,
    task: Task | Environment,
    problems: list[Problem],
    prompt_ids: list[list[int]],
    group_size: int,
    params: SamplingConfig,
    seed: int,
    version: int = 0,
    format_reward: float = 0.0,
    job_ids: list[int] | None = None,
    scorer: VerifierPool | None = None,
) -> list[ScoredGroup]:
    """`group_size` scored completions (or episodes) for each problem, whose prompt is
    `prompt_ids[i]`; groups are numbered by `job_ids` (default: their position). With
    `scorer`, single-turn answers are scored in its worker processes (time and memory
    bounded), and an environment's moves too; without, here."""
    job_ids = job_ids or list(range(len(problems)))
    if is_environment(task):
        return play(
            backend, task, problems, prompt_ids, group_size, params, seed, version, job_ids, scorer
        )
    max_new = params.max_new_tokens or task.max_new_tokens
    contexts = [ids for ids in prompt_ids for _ in range(group_size)]
    flat = backend.generate_ids(contexts, params, max_new, seed)
    per_problem = [flat[i * group_size : (i + 1) * group_size] for i in range(len(problems))]
    if scorer is not None:
        items = [(p.seed, c) for p, c in zip(problems, per_problem)]
        verdicts = scorer.score(items, format_reward)
        scored, parts = [v.rewards for v in verdicts], [v.parts for v in verdicts]
    else:
        scored, parts = [], []
        if hasattr(task, "drain_tally"):
            task.drain_tally()  # what earlier calls left is not these groups'
        for p, c in zip(problems, per_problem):
            scored.append(score_group(task, p, c, backend.codec, format_reward))
            parts.append(task.drain_tally() if hasattr(task, "drain_tally") else None)
    return [
        _group(job_ids[i], version, ids, per_problem[i], scored[i], parts[i])
        for i, ids in enumerate(prompt_ids)
    ]


def play(
    backend: Backend,
    env: Environment,
    problems: list[Problem],
    prompt_ids: list[list[int]],
    group_size: int,
    params: SamplingConfig,
    seed: int,
    version: int,
    job_ids: list[int],
    scorer: VerifierPool | None = None,
) -> list[ScoredGroup]:
    """G episodes per problem, all games advanced one turn per batched `generate`.

    A turn ends at a newline (or eos, which ends the episode: the model quit); the
    environment's observation is appended (log-prob 0, outside every turn) unless the
    episode is over. An episode also ends, after a model turn, when the observation and
    another turn would not fit the model. With `scorer`, the environment moves in its
    bounded workers: a move that overruns ends its game with return 0."""
    codec = backend.codec
    newline = codec.encode("\n")[-1]
    owner = [i for i in range(len(problems)) for _ in range(group_size)]
    move = _moves(env, [problems[i].seed for i in owner], scorer)
    ids: list[list[int]] = [[] for _ in owner]
    lps: list[list[float]] = [[] for _ in owner]
    turns: list[list[Turn]] = [[] for _ in owner]
    returns, quit_ = [0.0] * len(owner), [False] * len(owner)
    room = backend.max_positions - env.max_action_tokens  # a context that fits another turn
    live = [k for k in range(len(owner)) if len(prompt_ids[owner[k]]) <= room]
    for turn in range(env.max_turns):
        if not live:
            break
        outs = backend.generate_ids(
            [prompt_ids[owner[k]] + ids[k] for k in live],
            params,
            env.max_action_tokens,
            derive_seed(seed, "turn", turn),
            stop_ids=(newline,),
        )
        still = []
        answers = move(live, [codec.decode(out.token_ids) for out in outs])
        for k, out, (obs, reward) in zip(live, outs, answers):
            start = len(ids[k])
            ids[k] += out.token_ids
            lps[k] += out.logprobs
            turns[k].append(Turn(start=start, end=len(ids[k]), version=version))
            returns[k] = 0.0 if reward is None else returns[k] + reward
            quit_[k] = out.finished
            obs_ids = [] if obs is None else codec.encode(obs)
            # The episode goes on unless it is over or the next turn would not fit; an episode
            # ends on a model turn (the broker's replay expects no observation after the last).
            if (
                not (obs is None or out.finished)
                and len(prompt_ids[owner[k]]) + len(ids[k]) + len(obs_ids) <= room
            ):
                ids[k] += obs_ids
                lps[k] += [0.0] * len(obs_ids)
                still.append(k)
        live = still
    completions = [
        Completion(token_ids=ids[k], logprobs=lps[k], finished=quit_[k], turns=turns[k])
        for k in range(len(owner))
    ]
    return [
        _group(
            job_ids[i],
            version,
            prompt_ids[i],
            completions[i * group_size : (i + 1) * group_size],
            returns[i * group_size : (i + 1) * group_size],
        )
        for i in range(len(problems))
    ]


Moves = Callable[[list[int], list[str]], list[tuple[str | None, float | None]]]


def _moves(env: Environment, seeds: list[int], scorer: VerifierPool | None) -> Moves:
    """`move(games, actions)`: each game (an index into `seeds`) takes its action; per game
    the observation (None: the game is over) and the turn's reward (None: the move failed,
    the game's return is 0)."""
    if scorer is None:  # in process, unbounded
        games = [env.episode(seed) for seed in seeds]

        def here(live, actions):
            out = []
            for k, action in zip(live, actions):
                obs, reward, done, _ = games[k].step(action)
                out.append((None if done else obs, reward))
            return out

        return here
    history: list[list[str]] = [[] for _ in seeds]
    play_id = uuid.uuid4().hex  # names this call's games in the workers

    def bounded(live, actions):
        for k, action in zip(live, actions):
            history[k].append(action)
        verdicts = scorer.step([((play_id, k), seeds[k], history[k]) for k in live])
        return [(v.observation, None if v.failed else v.rewards[0]) for v in verdicts]

    return bounded


def _group(job_id, version, prompt_ids, completions, rewards, parts=None) -> ScoredGroup:
    # Built from validated parts: model_construct skips re-checking every token.
    return ScoredGroup.model_construct(
        job_id=job_id,
        version=version,
        prompt_ids=prompt_ids,
        completions=completions,
        rewards=rewards,
        gen_seconds=0.0,
        reward_parts=parts,
    )
