"""Arithmetic: add (or subtract) two integers. `37+58=` -> `95`.

The easiest built-in task: a 1M-parameter model learns the format at once and
the carries by practice, so it shows RL gains within a hundred steps on a CPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from echorl.tasks.base import Problem, first_line


@dataclass(frozen=True)
class Arithmetic:
    name: str = "add"
    digits: int = 2
    ops: str = "+"
    max_new_tokens: int = 8

    def problem(self, seed: int) -> Problem:
        rng = random.Random(seed)
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        op = rng.choice(self.ops)
        value = a + b if op == "+" else a - b
        return Problem(self.name, seed, f"{a}{op}{b}=", str(value))

    def score(self, problem: Problem, completion: str) -> float:
        return float(first_line(completion) == problem.answer)

    def demonstration(self, problem: Problem) -> str:
        return problem.answer
