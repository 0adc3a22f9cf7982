"""Flat steps: a step whose every group got G equal rewards teaches the policy nothing.

A group-relative advantage is a reward less its group's mean, so a group whose rewards are
all equal (an untrained model that never answers right: every reward 0) has none, and a
step made of such groups moves nothing but the KL term (under `train.drop_flat_groups` it
makes no optimiser step at all: `optim/skipped = 1`). Left alone, such a run "finishes"
its steps having learned nothing. `FlatStreak` reads the step records: after `WARN_AFTER`
flat steps in a row it says so, again at growing intervals (after 3, 6, 12, ... more flat
steps: a long run is not told every few steps), and once the streak has lasted
`launch.stall_timeout_s` (wall-clock, from its first step) it raises NothingLearned. Each
names the cure for what it saw, as a command for this run: a cold model (every reward 0)
is warmed up on this run's task (`echorl sft`); a saturated one (every reward 1) needs
harder prompts or more answers per prompt; groups flat at mixed rewards, more diverse
answers.

It reads `rollout/groups_flat_frac`, `reward/mean` and `reward/std` of the records alone,
so the co-located loop, the decoupled trainer and `echorl run`'s view share it (no torch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

WARN_AFTER = 3  # one flat step is chance; three in a row is a model that cannot score


@dataclass(frozen=True)
class Run:
    """What a cure's command fills in (from the run's config)."""

    task: str = "TASK"
    task_flags: str = "--task TASK"  # what names the task on the command line
    model: str | None = None  # None: the built-in tiny model
    out: str = "OUT"
    group_size: int = 8
    temperature: float = 1.0

    @classmethod
    def of(cls, cfg) -> Run:
        t = cfg.task
        flags = f"--task {t.name}"
        if t.dataset:  # rewards in YAML's flow form, quoted for the shell
            flags = f"-o task.dataset={t.dataset} -o 'task.rewards=[{', '.join(t.rewards)}]'"
        return cls(
            t.dataset or t.name,
            flags,
            cfg.model.path,
            cfg.train.out_dir,
            cfg.train.group_size,
            cfg.sampling.temperature,
        )

    def cure(self, rewards: float | None) -> str:
        """The cure for a streak of flat steps whose one reward was `rewards` (None: mixed)."""
        if rewards is not None and rewards <= 0.0:
            model = f" --model {self.model}" if self.model else ""
            warm = f"{self.out}/warmed"
            return (
                f"the model never scores on {self.task}: warm it up on it first "
                f"(echorl sft {self.task_flags}{model} --out {warm}), then train from it "
                f"(-o model.path={warm})"
            )
        if rewards is not None and rewards >= 1.0:
            return (
                f"the model already solves every prompt of {self.task}: train on harder ones "
                f"(another task or dataset), or draw more answers per prompt so some differ "
                f"(-o train.group_size={2 * self.group_size})"
            )
        return (
            "every group's answers score alike: draw more diverse ones "
            f"(-o sampling.temperature={min(self.temperature + 0.3, 1.5):.1f} or "
            f"-o train.group_size={2 * self.group_size})"
        )


class NothingLearned(RuntimeError):
    """Every group of every step for `launch.stall_timeout_s` was flat."""


def is_flat(record: dict) -> bool:
    """Whether the step of `record` had every group flat (all its rewards equal)."""
    return record.get("rollout/groups_flat_frac") == 1.0


class FlatStreak:
    """Consecutive flat steps: how many, since when, and at which rewards."""

    def __init__(
        self,
        give_up_s: float = math.inf,
        warn_after: int = WARN_AFTER,
        clock: Callable[[], float] = time.monotonic,
        run: Run = Run(),
    ):
        self.give_up_s, self.warn_after, self.clock, self.run = give_up_s, warn_after, clock, run
        self.steps, self.since = 0, 0.0
        self.flat_total, self.next_warn, self.warned = 0, 0, 0  # over every streak
        self.rewards: set[float | None] = set()  # a step's one reward; None: groups differ

    def see(self, record: dict) -> str | None:
        """Take the next step's record. Returns the warning when the streak is `warn_after`
        steps long or more and the flat steps since the last warning (in any streak) are
        `warn_after` x 2^warnings so far, else None; raises NothingLearned when the streak
        is at least `warn_after` long and has lasted `give_up_s` seconds since its first
        step's record was seen."""
        if not is_flat(record):
            self.steps, self.rewards = 0, set()
            return None
        now = self.clock()
        if not self.steps:
            self.since = now
        self.steps += 1
        self.flat_total += 1
        one = record.get("reward/std") == 0  # every reward of the step equal, not just per group
        self.rewards.add(round(record.get("reward/mean", math.nan), 3) if one else None)
        lasted = now - self.since
        if self.steps >= self.warn_after and lasted >= self.give_up_s:
            raise NothingLearned(
                f"every group of the last {self.steps} steps ({lasted:.0f} s, "
                f"launch.stall_timeout_s) was flat ({self.what()}): nothing is learned; "
                + self.cure()
            )
        if self.steps >= self.warn_after and self.flat_total >= self.next_warn:
            self.next_warn = self.flat_total + self.warn_after * 2 ** (self.warned + 1)
            self.warned += 1
            return (
                f"every group of the last {self.steps} steps was flat ({self.what()}): "
                f"nothing is learned; {self.cure()}"
            )
        return None

    def cure(self) -> str:
        one = next(iter(self.rewards)) if len(self.rewards) == 1 else None
        return self.run.cure(one)

    def what(self) -> str:
        """The streak's rewards in words: `all rewards 0.0`, or that each group's were equal."""
        if len(self.rewards) == 1 and None not in self.rewards:
            return f"all rewards {next(iter(self.rewards))}"
        return "each group's rewards all equal"
