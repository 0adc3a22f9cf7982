"""Scored groups of random tokens, for benchmarks and tests of the trainer's step.

groups = random_groups(step, b=16, g=8, vocab=model.config.vocab_size, completion=(64, 64))
"""

from __future__ import annotations

import random

from echorl.protocol import Completion, ScoredGroup


def random_groups(
    step: int,
    b: int,
    g: int,
    vocab: int,
    prompt: tuple[int, int] = (8, 16),
    completion: tuple[int, int] = (1, 8),
) -> list[ScoredGroup]:
    """`b` groups of `g` completions (token ids past the 3 special ones, lengths drawn from the
    inclusive ranges `prompt` and `completion`, sampler log-probs in [-4, -0.1]), the same for
    the same `step`. Never flat (one reward 0, one 1): every row trains."""
    rng = random.Random(step)
    out = []
    for k in range(b):
        prompt_ids = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))]
        completions = []
        for _ in range(g):
            ids = [rng.randrange(3, vocab) for _ in range(rng.randint(*completion))]
            logprobs = [-rng.uniform(0.1, 4) for _ in ids]
            completions.append(Completion(token_ids=ids, logprobs=logprobs, finished=True))
        rewards = [0.0, 1.0] + [float(rng.random() < 0.5) for _ in range(g - 2)]
        out.append(
            ScoredGroup(
                job_id=step * b + k,
                version=step,
                prompt_ids=prompt_ids,
                completions=completions,
                rewards=rewards,
            )
        )
    return out
