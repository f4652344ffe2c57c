"""Progress of `kvcal calibrate`: one bar per statistics pass, then one bar over choosing the settings.

How many steps choosing takes is known before the first (kvcal.profile.choose.planned_steps): the recording windows,
at most `max_probes` probes and `max_checks` checks. The bar counts them, so its ETA covers the whole choice from
the start; a confirmation that meets at once ends it early.
"""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

STAGE_NAMES = {"record": "quality model", "probe": "budget probes", "confirm": "evaluation text"}


def pass_bars(console: Console, quiet: bool) -> Progress:
    """Bars of the statistics passes (one task per pass, in windows)."""
    return Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TextColumn("windows"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console, disable=quiet,
                    transient=False)


class SearchBar(Progress):
    """Choosing the settings as one bar plus one line on the step being run. Feed it `step(stage, label, point)`
    (kvcal.profile.choose.Progress); `plan` is `kvcal.profile.choose.planned_steps(cfg)`."""

    def __init__(self, console: Console, plan: dict[str, int], quiet: bool = False):
        self.plan = plan
        self.done = 0
        self.label: str | None = None      # what is being run now
        self.since = time.monotonic()
        super().__init__(TextColumn("choose"), TextColumn("{task.fields[stage]:<18}"), BarColumn(bar_width=None),
                         MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                         console=console, disable=quiet, transient=False, expand=True)
        # the clock starts with the first step, not when the bar is built before the statistics passes
        self.task = self.add_task("choose", total=sum(self.plan.values()), stage="", start=False)

    def step(self, stage: str, label: str, point) -> None:
        if not self.tasks[0].started:
            self.start_task(self.task)
        if point is None:
            self.label, self.since = label, time.monotonic()
        else:
            self.done += 1
            self.label = None
        self.update(self.task, completed=self.done, stage=STAGE_NAMES.get(stage, stage))

    def finish(self) -> None:
        self.update(self.task, completed=self.tasks[0].total)
        self.label = None

    def current(self) -> Text:
        """The second line: what is run now, and for how long."""
        if self.label is None:
            return Text("")
        line = Text("  ", style="dim")
        line.append(self.label, style="bold")
        line.append(f" for {time.monotonic() - self.since:.0f} s", style="dim")
        return line

    def get_renderables(self):
        yield Group(self.make_tasks_table(self.tasks), self.current())

