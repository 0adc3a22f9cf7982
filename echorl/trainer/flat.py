"""Flat steps: a step whose every group got G equal rewards teaches the policy nothing.

A group-relative advantage is a reward less its group's mean, so a group whose rewards are
all equal (an untrained model that never answers right: every reward 0) has none, and a
step made of such groups moves nothing but the KL term (under `train.drop_flat_groups` it
makes no optimiser step at all: `optim/skipped = 1`). Left alone, such a run "finishes"
its steps having learned nothing. `FlatStreak` reads the step records: after `WARN_AFTER`
flat steps in a row it says so, and once the streak has lasted `launch.stall_timeout_s`
(wall-clock, from its first step) it raises NothingLearned, naming the cure: warm the
model up with `echorl sft`.

It reads `rollout/groups_flat_frac`, `reward/mean` and `reward/std` of the records alone,
so the co-located loop, the decoupled trainer and `echorl run`'s view share it (no torch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

WARN_AFTER = 3  # one flat step is chance; three in a row is a model that cannot score
CURE = "warm the model up first: echorl sft --out DIR --model MODEL, then train from DIR"


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
    ):
        self.give_up_s, self.warn_after, self.clock = give_up_s, warn_after, clock
        self.steps, self.since = 0, 0.0
        self.rewards: set[float | None] = set()  # a step's one reward; None: groups differ

    def see(self, record: dict) -> str | None:
        """Take the next step's record. Returns the warning when it makes the streak
        `warn_after` steps long (once a streak), else None; raises NothingLearned when
        the streak is at least that long and has lasted `give_up_s` seconds since its
        first step's record was seen."""
        if not is_flat(record):
            self.steps, self.rewards = 0, set()
            return None
        now = self.clock()
        if not self.steps:
            self.since = now
        self.steps += 1
        one = record.get("reward/std") == 0  # every reward of the step equal, not just per group
        self.rewards.add(round(record.get("reward/mean", math.nan), 3) if one else None)
        lasted = now - self.since
        if self.steps >= self.warn_after and lasted >= self.give_up_s:
            raise NothingLearned(
                f"every group of the last {self.steps} steps ({lasted:.0f} s, "
                f"launch.stall_timeout_s) was flat ({self.what()}): nothing is learned; {CURE}"
            )
        if self.steps == self.warn_after:
            return (
                f"every group of the last {self.steps} steps was flat ({self.what()}): "
                f"nothing is learned; {CURE}"
            )
        return None

    def what(self) -> str:
        """The streak's rewards in words: `all rewards 0.0`, or that each group's were equal."""
        if len(self.rewards) == 1 and None not in self.rewards:
            return f"all rewards {next(iter(self.rewards))}"
        return "each group's rewards all equal"
