"""Your own task, with your own reward function, in about 20 lines.

    echorl run -o task.name=examples/custom_task.py:SortDigits -o train.steps=60
    echorl sft --out runs/sort/sft -o task.name=my_pkg.tasks:SortDigits   # an installed module

A task is any class with `name`, `max_new_tokens`, `problem(seed)`, `score(problem,
completion)` and `demonstration(problem)` (the `Task` protocol in echorl/tasks/base.py;
multi-turn games implement `Environment`). The broker, every sampler and the trainer
load it by the same name, so it must be importable on each machine. `problem(seed)`
must be a pure function of the seed; `score` sees untrusted text and returns a float in
[0, 1] (anything it raises scores 0).
"""

import random

from echorl.tasks import Problem


class SortDigits:
    name = "sort_digits"
    max_new_tokens = 6  # four digits, a newline or eos, and room to spare

    def problem(self, seed: int) -> Problem:
        digits = "".join(random.Random(seed).choices("0123456789", k=4))
        return Problem(self.name, seed, f"sort {digits}=", "".join(sorted(digits)))

    def score(self, problem: Problem, completion: str) -> float:
        """Partial credit: the share of the four places that hold the right digit."""
        answer = completion.split("\n", 1)[0].strip()
        if len(answer) != len(problem.answer):
            return 0.0
        return sum(a == b for a, b in zip(answer, problem.answer)) / len(answer)

    def demonstration(self, problem: Problem) -> str:
        return problem.answer
