"""Progress of `kvcal calibrate`: one bar per statistics pass, then one bar over the search.

The search is adaptive: a stage stops at the first point that misses the target, so how many points it will measure
is not known in advance. The bar therefore moves over the stages (each stage one step, split by the most points it can
measure), counts the points measured, and says what is being measured now, for how long, and how long points have
taken so far; the time of the current point is the one estimate that holds.
"""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from kvcal.profile.search import (
    ALPHA_HIGH_GRID,
    ALPHA_LOW_GRID,
    LOW_TIERS,
    PRECISION_LADDER,
    RATE_GRID,
    RECOVERY_GRID,
    RESIDUAL_ALPHA_GRID,
    RESIDUAL_HIGHS,
    RESIDUAL_LOW_TIERS,
    RESIDUAL_WINDOWS,
)

RANK_POINTS = 2 * (len(RATE_GRID) + 2)       # QK then V: the grid walk plus two bisection steps each
# stage -> the most points it can measure (the bar's split of that stage's step)
STAGE_POINTS = {
    "prefill": 1,
    "precision": len(PRECISION_LADDER),
    "tiers": len(LOW_TIERS) * (len(ALPHA_HIGH_GRID) + len(ALPHA_LOW_GRID)),
    "residual": (len(RESIDUAL_HIGHS) - 1 + len(RESIDUAL_LOW_TIERS) * len(RESIDUAL_ALPHA_GRID) + len(RESIDUAL_WINDOWS)
                 + len(ALPHA_LOW_GRID)),
    "policies": len(RECOVERY_GRID),
    "ranks": RANK_POINTS,
    "family": 1 + RANK_POINTS + len(RECOVERY_GRID),
    "held-out": 1,
}
STAGES = tuple(STAGE_POINTS)
STAGE_NAMES = {"prefill": "dense reference", "family": "families alone", "held-out": "evaluation text"}


def pass_bars(console: Console, quiet: bool) -> Progress:
    """Bars of the statistics passes (one task per pass, in windows)."""
    return Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TextColumn("windows"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console, disable=quiet,
                    transient=False)


class SearchBar(Progress):
    """The search as one bar plus one line on the point being measured. Feed it `step(stage, label, point)`
    (kvcal.profile.calibrate.SearchProgress)."""

    def __init__(self, console: Console, quiet: bool = False):
        self.stage_index = -1              # stages only move forward: "family" points come as ranks/policies
        self.in_stage = 0                  # points measured in the current stage
        self.measured: list[float] = []    # seconds of each point measured
        self.label: str | None = None      # what is being measured now
        self.since = time.monotonic()
        super().__init__(TextColumn("search"), TextColumn("{task.fields[stage]:<24}"), BarColumn(bar_width=None),
                         TextColumn("{task.fields[points]}"), TimeElapsedColumn(), console=console, disable=quiet,
                         transient=False, expand=True)
        # the clock starts with the first step, not when the bar is built before the statistics passes
        self.task = self.add_task("search", total=len(STAGES), stage="", points="0 points", start=False)

    def step(self, stage: str, label: str, point) -> None:
        if not self.tasks[0].started:
            self.start_task(self.task)
        index = STAGES.index(stage) if stage in STAGES else self.stage_index
        if index > self.stage_index:
            self.stage_index, self.in_stage = index, 0
        if point is None:
            self.label, self.since = label, time.monotonic()
        else:
            self.in_stage += 1
            self.measured.append(point.seconds)
            self.label = None
        name = STAGES[self.stage_index]
        done = self.stage_index + min(self.in_stage / STAGE_POINTS[name], 0.99)
        n = len(self.measured)
        self.update(self.task, completed=done,
                    stage=f"{self.stage_index + 1}/{len(STAGES)} {STAGE_NAMES.get(name, name)}",
                    points=f"{n} point{'s' if n != 1 else ''}")

    def finish(self) -> None:
        self.update(self.task, completed=len(STAGES))
        self.label = None

    def current(self) -> Text:
        """The second line: what is measured now, for how long, and what points took so far."""
        if self.label is None:
            return Text("")
        elapsed = time.monotonic() - self.since
        line = Text("  measuring ", style="dim")
        line.append(self.label, style="bold")
        line.append(f" for {elapsed:.0f} s", style="dim")
        if self.measured:
            mean = sum(self.measured) / len(self.measured)
            line.append(f" (points so far took {mean:.0f} s on average)", style="dim")
        return line

    def get_renderables(self):
        yield Group(self.make_tasks_table(self.tasks), self.current())
