"""Progress of a long loop: a rich bar on a terminal, plain timed lines everywhere else.

rich draws no bar and no live view when its console is not a terminal (CI, `nohup`,
`> file`), so a loop behind one would say nothing for minutes. `steps()` picks: on a
terminal a bar (label and note, bar, M/N, elapsed, remaining); otherwise one line at most
every `every_s` seconds, and the last state at the end:

    warm-up on add: step 120/800 loss 0.412 eta 0:01:10

    with steps(console, "warm-up on add", total=800) as bar:
        for i in range(800):
            ...
            bar.update(i + 1, f"loss {loss:.3f}")

It knows nothing of what the loop does: the caller says how far it is and what to show.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

LINE_EVERY_S = 10.0  # often enough to see a loop is alive, rare enough for a log file


def draws_live(console: Console) -> bool:
    """Whether rich redraws on `console` (a bar, a live table): a real terminal or Jupyter."""
    return console.is_jupyter or (console.is_terminal and not console.is_dumb_terminal)


class BarSteps:
    """A rich progress bar; `note` follows the label."""

    def __init__(self, console: Console, label: str, total: int, start: int = 0):
        self.label = escape(label)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self.task = self.progress.add_task(self.label, total=total, completed=start)

    def __enter__(self) -> BarSteps:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, done: int, note: str = "") -> None:
        """`done` of the total steps are done; `note` (e.g. `loss 0.412`) is shown beside."""
        text = f"{self.label}  {escape(note)}" if note else self.label
        self.progress.update(self.task, completed=done, description=text)


class LineSteps:
    """Plain lines, `LABEL: step DONE/TOTAL NOTE eta H:MM:SS`: at most one every `every_s`
    seconds, one when the last step is done, and the last state on exit if not yet shown.
    The ETA extrapolates the rate since `start`; `start=None` counts from the first update
    (a loop watched from outside, which may have begun before the watcher, or resumed)."""

    def __init__(
        self,
        console: Console,
        label: str,
        total: int,
        start: int | None = 0,
        every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.console, self.label, self.total = console, label, total
        self.every_s, self.clock = every_s, clock
        self.t0 = self.printed_at = clock()
        self.base = start  # the steps done when the rate's clock started
        self.done, self.note, self.shown = start or 0, "", True

    def __enter__(self) -> LineSteps:
        return self

    def __exit__(self, *exc) -> None:
        if not self.shown:
            self.emit(self.clock())

    def update(self, done: int, note: str = "") -> None:
        """As `BarSteps.update`; prints when `every_s` has passed since the last line."""
        now = self.clock()
        if self.base is None:
            self.base, self.t0 = done, now
        if (done, note) != (self.done, self.note):
            self.done, self.note, self.shown = done, note, False
        if not self.shown and (now - self.printed_at >= self.every_s or done >= self.total):
            self.emit(now)

    def emit(self, now: float) -> None:
        # soft_wrap: a console that is no terminal is 80 columns wide; a line must stay one line
        self.console.print(self.line(now), markup=False, highlight=False, soft_wrap=True)
        self.printed_at, self.shown = now, True

    def line(self, now: float) -> str:
        parts = [f"{self.label}: step {self.done}/{self.total}", self.note, f"eta {self.eta(now)}"]
        return " ".join(p for p in parts if p)

    def eta(self, now: float) -> str:
        """H:MM:SS left at the rate since the base; `?` before any step was seen done."""
        if self.done >= self.total:
            return "0:00:00"
        moved = self.done - (self.base or 0)
        if moved <= 0 or now <= self.t0:
            return "?"
        return str(timedelta(seconds=round((self.total - self.done) * (now - self.t0) / moved)))


def steps(
    console: Console,
    label: str,
    total: int,
    start: int | None = 0,
    every_s: float = LINE_EVERY_S,
) -> BarSteps | LineSteps:
    """A bar where rich draws one, plain lines (`LineSteps`) elsewhere; use it as a context
    manager and call `update(done, note)` after each step."""
    if draws_live(console):
        return BarSteps(console, label, total, start or 0)
    return LineSteps(console, label, total, start, every_s)
