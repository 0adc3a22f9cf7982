"""Tasks: the `Task` protocol and the built-in procedural tasks, by name; also any
`jsonl:PATH` (math problems from a file) and `rg:DATASET` (reasoning-gym).

from echorl.tasks import get_task
task = get_task("add")
"""

from functools import lru_cache
from pathlib import Path

from echorl.tasks.arithmetic import Arithmetic
from echorl.tasks.base import (
    Environment,
    Problem,
    Task,
    is_environment,
    is_heldout,
    problem_stream,
    take,
)
from echorl.tasks.countdown import Countdown
from echorl.tasks.gym import ReasoningGym
from echorl.tasks.knights import KnightsKnaves
from echorl.tasks.math import MathJSONL, WordProblems
from echorl.tasks.reverse import Reverse
from echorl.tasks.sokoban import Sokoban, SokobanPlan

# Rising difficulty for a tiny model.
TASKS: dict[str, Task] = {
    "add": Arithmetic(),
    "add3": Arithmetic(name="add3", digits=3, max_new_tokens=8),
    "reverse": Reverse(),
    "countdown": Countdown(),
    "knights": KnightsKnaves(),  # logic puzzles, compact notation for the tiny model
    "knights_text": KnightsKnaves(name="knights_text", style="text"),  # for real checkpoints
    "sokoban_plan": SokobanPlan(),  # 5x5, one box, the whole plan in one answer
    "math_word": WordProblems(),  # multi-step arithmetic word problems, math-verify scored
}
# Multi-turn environments: the sampler plays them turn by turn, the broker replays them.
ENVIRONMENTS: dict[str, Environment] = {
    "sokoban": Sokoban(),  # 5x5, one box, one action per turn
}


@lru_cache(maxsize=64)
def get_task(name: str) -> Task | Environment:
    """A built-in task by name, `jsonl:PATH` (math problems from a file) or `rg:DATASET`
    (a reasoning-gym dataset). Raises KeyError/ValueError naming what is wrong."""
    if name in TASKS:
        return TASKS[name]
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if name.startswith("jsonl:"):
        task = MathJSONL(name.removeprefix("jsonl:"))
        if not Path(task.path).is_file():
            raise ValueError(f"{name}: no such file")
        task.rows  # noqa: B018  (read and checked now, not at the first prompt)
        return task
    if name.startswith("rg:"):
        task = ReasoningGym(name.removeprefix("rg:"))
        try:
            task.data  # noqa: B018
        except ImportError:
            raise ValueError(
                f"{name}: reasoning-gym is not installed (pip install echorl[rg])"
            ) from None
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"{name}: reasoning-gym has no dataset {task.dataset!r} ({e})"
            ) from None
        return task
    raise KeyError(
        f"unknown task {name!r}; built-in tasks are {sorted(TASKS)}, environments "
        f"{sorted(ENVIRONMENTS)}, or jsonl:PATH, rg:DATASET"
    )


__all__ = [
    "ENVIRONMENTS",
    "TASKS",
    "Environment",
    "Problem",
    "Task",
    "get_task",
    "is_environment",
    "is_heldout",
    "problem_stream",
    "take",
]
