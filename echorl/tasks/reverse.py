"""String reversal: `rev:hello=` -> `olleh`. Harder for a tiny model than it looks:
it has to copy by position, which it learns gradually as strings grow."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from echorl.tasks.base import Problem, first_line


@dataclass(frozen=True)
class Reverse:
    name: str = "reverse"
    min_len: int = 3
    max_len: int = 7
    alphabet: str = string.ascii_lowercase
    max_new_tokens: int = 10

    def problem(self, seed: int) -> Problem:
        rng = random.Random(seed)
        word = "".join(rng.choices(self.alphabet, k=rng.randint(self.min_len, self.max_len)))
        return Problem(self.name, seed, f"rev:{word}=", word[::-1])

    def score(self, problem: Problem, completion: str) -> float:
        return float(first_line(completion) == problem.answer)

    def demonstration(self, problem: Problem) -> str:
        return problem.answer
