"""reasoning-gym (PyPI `reasoning-gym`) as echorl tasks: any of its datasets by name.

    task.name = "rg:knights_knaves"      # or rg:sokoban, rg:countdown, rg:basic_arithmetic, ...

reasoning-gym datasets are procedural: entry i of a dataset made with seed s is a
pure function of (s, i), so problem(seed) is entry `seed % SIZE` of the dataset
made with the run's seed, and the broker, samplers and trainer regenerate the
same entry from the seed alone. Scoring is the dataset's own `score_answer`,
given the answer extracted from the completion (after `<answer>`, in
`\\boxed{}`, or the last non-empty line). Nothing is downloaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from echorl.tasks.base import Problem

SIZE = 1_000_000
_TAGGED = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)


def extract(completion: str) -> str:
    from echorl.tasks.math import extract_answer

    tagged = _TAGGED.findall(completion)
    return tagged[-1].strip() if tagged else extract_answer(completion)


@dataclass(frozen=True)
class ReasoningGym:
    dataset: str
    seed: int = 0
    max_new_tokens: int = 512

    @property
    def name(self) -> str:
        return f"rg:{self.dataset}"

    @cached_property
    def data(self):
        import reasoning_gym  # an optional dependency: pip install echorl[rg]

        return reasoning_gym.create_dataset(self.dataset, seed=self.seed, size=SIZE)

    def entry(self, seed: int) -> dict:
        return self.data[seed % SIZE]

    def problem(self, seed: int) -> Problem:
        e = self.entry(seed)
        return Problem(self.name, seed, e["question"], str(e["answer"]), {"index": seed % SIZE})

    def score(self, problem: Problem, completion: str) -> float:
        return float(
            self.data.score_answer(answer=extract(completion), entry=self.entry(problem.seed))
        )

    def demonstration(self, problem: Problem) -> str:
        return f"<answer>{problem.answer}</answer>"
