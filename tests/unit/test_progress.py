"""Progress where no bar is drawn, and the flat-step watch: both against a fake clock."""

import io

import pytest
from rich.console import Console

from echorl.progress import BarSteps, LineSteps, steps
from echorl.trainer.flat import FlatStreak, NothingLearned, Run


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def plain() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=40), out  # a file: no terminal, and narrow


def test_a_console_that_is_no_terminal_gets_timed_plain_lines_with_an_eta():
    console, out = plain()
    clock = Clock()
    with LineSteps(console, "warm-up on add", 800, every_s=10, clock=clock) as bar:
        for step in range(1, 801):
            clock.now += 0.125  # 8 steps a second (exact in binary)
            bar.update(step, f"loss {1 / step:.3f}")
    lines = out.getvalue().splitlines()
    # one line per 10 s of a 100 s loop (the 800th step's is the 10th), each on one line
    assert len(lines) == 10, lines
    assert lines[0] == "warm-up on add: step 80/800 loss 0.013 eta 0:01:30"
    assert lines[-1] == "warm-up on add: step 800/800 loss 0.001 eta 0:00:00"


def test_the_last_state_is_shown_at_the_end_and_a_late_watcher_counts_from_its_first_look():
    console, out = plain()
    clock = Clock()
    with LineSteps(console, "echorl run", 40, start=None, every_s=15, clock=clock) as lines:
        lines.update(20, "reward 0.5")  # a resumed run: 20 steps done before anyone looked
        clock.now += 16
        lines.update(20, "reward 0.5")  # nothing moved yet: no rate, no ETA
        clock.now += 10
        lines.update(25, "reward 0.6")  # 5 steps in 26 s; shown at exit
    assert out.getvalue().splitlines() == [
        "echorl run: step 20/40 reward 0.5 eta ?",
        "echorl run: step 25/40 reward 0.6 eta 0:01:18",
    ]


def test_steps_draws_a_bar_on_a_terminal_only():
    assert isinstance(steps(Console(file=io.StringIO(), force_terminal=True), "x", 3), BarSteps)
    assert isinstance(steps(plain()[0], "x", 3), LineSteps)


FLAT = {"rollout/groups_flat_frac": 1.0, "reward/mean": 0.0, "reward/std": 0.0}
LEARNING = {"rollout/groups_flat_frac": 0.5, "reward/mean": 0.4, "reward/std": 0.5}


RUN = Run(
    task="countdown",
    task_flags="--task countdown",
    model="ckpt/qwen",
    out="runs/c",
    group_size=8,
    temperature=0.7,
)


def test_three_flat_steps_warn_with_this_runs_command_and_a_step_with_signal_ends_the_streak():
    streak = FlatStreak(give_up_s=60, clock=Clock(), run=RUN)
    said = [streak.see(r) for r in (FLAT, FLAT, LEARNING, FLAT, FLAT, FLAT, FLAT)]
    assert said[:6] == [None] * 5 + [said[5]] and said[6] is None
    assert said[5] == (
        "every group of the last 3 steps was flat (all rewards 0.0): nothing is learned; "
        "the model never scores on countdown: warm it up on it first (echorl sft --task "
        "countdown --model ckpt/qwen --out runs/c/warmed), then train from it "
        "(-o model.path=runs/c/warmed)"
    )


def test_a_saturated_model_and_flat_groups_get_their_own_cures():
    """The hint said 'warm the model up' of a model scoring 1.0 everywhere too."""
    solved = FlatStreak(clock=Clock(), run=RUN)
    said = [solved.see(FLAT | {"reward/mean": 1.0}) for _ in range(3)][-1]
    assert "(all rewards 1.0)" in said and "already solves every prompt of countdown" in said
    assert "-o train.group_size=16" in said and "echorl sft" not in said
    mixed = FlatStreak(clock=Clock(), run=RUN)
    said = [mixed.see(FLAT | {"reward/mean": 0.5, "reward/std": 0.5}) for _ in range(3)][-1]
    assert "each group's rewards all equal" in said and "sampling.temperature=1.0" in said


def test_a_long_flat_run_is_told_at_growing_intervals_not_every_few_steps():
    """Streaks of 3 flat steps and 1 with signal, for 60 steps, printed the hint 7 times (a
    warning per streak); now after 3, then 6, 12, 24 more flat steps."""
    streak = FlatStreak(clock=Clock(), run=RUN)
    records = [FLAT, FLAT, FLAT, LEARNING] * 15 + [FLAT] * 60
    warned = [k for k, r in enumerate(records) if streak.see(r)]
    flat_before = [records[: k + 1].count(FLAT) for k in warned]
    assert flat_before == [3, 9, 21, 45, 93][: len(warned)] and len(warned) == 5


def test_flat_steps_for_the_stall_timeout_stop_the_run_naming_the_cure():
    clock = Clock()
    streak = FlatStreak(give_up_s=30, clock=clock)
    streak.see(FLAT)
    clock.now += 40  # past the timeout, but after one flat step only: never before the warning
    assert streak.see(FLAT | {"reward/mean": 1.0}) is None
    with pytest.raises(NothingLearned, match="last 3 steps .40 s.*score alike") as raised:
        streak.see(FLAT)
    assert "each group's rewards all equal" in str(raised.value)  # 0.0 and 1.0: no one value
