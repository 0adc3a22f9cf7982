"""Tasks: the `Task` protocol and the built-in procedural tasks, by name.

from echorl.tasks import get_task
task = get_task("add")
"""

from echorl.tasks.arithmetic import Arithmetic
from echorl.tasks.base import Problem, Task, is_heldout, problem_stream, take
from echorl.tasks.countdown import Countdown
from echorl.tasks.knights import KnightsKnaves
from echorl.tasks.reverse import Reverse
from echorl.tasks.sokoban import SokobanPlan

# Rising difficulty for a tiny model.
TASKS: dict[str, Task] = {
    "add": Arithmetic(),
    "add3": Arithmetic(name="add3", digits=3, max_new_tokens=8),
    "reverse": Reverse(),
    "countdown": Countdown(),
    "knights": KnightsKnaves(),  # logic puzzles, compact notation for the tiny model
    "knights_text": KnightsKnaves(name="knights_text", style="text"),  # for real checkpoints
    "sokoban_plan": SokobanPlan(),  # 5x5, one box, the whole plan in one answer
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; built-in tasks are {sorted(TASKS)}") from None


__all__ = ["TASKS", "Problem", "Task", "get_task", "is_heldout", "problem_stream", "take"]
