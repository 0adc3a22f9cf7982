"""Tasks: the `Task` protocol and the built-in procedural tasks, by name; also any
`jsonl:PATH` (math problems from a file), `rg:DATASET` (reasoning-gym), your own dataset
with reward functions (`data:{...}`, from `task.dataset`: tasks/dataset.py), and your own
task or environment by import path: `my_pkg.my_module:MyTask` or `path/to/file.py:MyTask`.

from echorl.tasks import get_task
task = get_task("add")
task = get_task("examples/custom_task.py:SortDigits")
"""

import inspect
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
from echorl.userpath import import_path

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
    if name.startswith("data:"):
        from echorl.tasks.dataset import DatasetSpec, DatasetTask

        return DatasetTask(DatasetSpec.parse(name))
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
    if ":" in name:
        return load_user_task(name)
    raise KeyError(
        f"unknown task {name!r}; built-in tasks are {sorted(TASKS)}, environments "
        f"{sorted(ENVIRONMENTS)}, or jsonl:PATH, rg:DATASET, module.path:Name, file.py:Name"
    )


def load_user_task(name: str) -> Task | Environment:
    """`module.path:Name` or `file.py:Name`: a Task or Environment class (called with no
    arguments), a factory function (likewise), or an instance. Modules are imported as
    installed or from the working directory; files by path. ValueError says what is wrong."""
    where, _, attr = name.rpartition(":")
    if not where or not attr.isidentifier():
        raise ValueError(f"{name!r}: a user task is module.path:Name or file.py:Name")
    module = import_path(where, name)
    if not hasattr(module, attr):
        raise ValueError(f"{name!r}: {where} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if inspect.isclass(obj) or inspect.isfunction(obj):
        try:
            obj = obj()
        except Exception as e:  # the user's constructor: its failure is the reason
            raise ValueError(f"{name!r}: calling {attr}() raised {type(e).__name__}: {e}") from e
    if is_environment(obj) or isinstance(obj, Task):
        return obj
    missing = [
        m
        for m in ("name", "max_new_tokens", "problem", "score", "demonstration")
        if not hasattr(obj, m)
    ]
    raise ValueError(
        f"{name!r}: {type(obj).__name__} is not a Task (it lacks {', '.join(missing)}) "
        "nor an Environment; see echorl/tasks/base.py for both protocols"
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
