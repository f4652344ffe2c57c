"""Progress of `kvcal calibrate` (`CalibrateProgress`): one bar per statistics pass, then one bar over choosing the
settings.

How many steps choosing takes is known before the first (kvcal.profile.choose.planned_steps): the recording windows,
at most `max_probes` probes and `max_checks` checks. The bar counts them, so its ETA covers the whole choice from
the start; a confirmation that meets at once ends it early, and a ("plan", label, {stage: steps}) step revises a
stage's count once the pipeline knows it (the moves measured past the bisection's point, or none). Stage names are
the pipeline's own (kvcal.profile.choose.STAGES).
"""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from kvcal.cli._errors import plain
from kvcal.profile.choose import STAGES


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
        if stage == "plan":                 # the pipeline knows a stage's count now (point: {stage: steps})
            self.plan.update(point)
            self.update(self.task, total=sum(self.plan.values()))
            return
        if not self.tasks[0].started:
            self.start_task(self.task)
        if point is None:
            self.label, self.since = label, time.monotonic()
        else:
            self.done += 1
            self.label = None
        self.update(self.task, completed=self.done, stage=STAGES.get(stage, stage))

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


class CalibrateProgress:
    """What `kvcal calibrate` shows while it runs: the statistics passes' bars, then the search's bar below them, one
    display live at a time (a stopped one stays printed, even if blank), and status lines. Its methods are the
    callbacks of `kvcal.profile.calibrate.calibrate`; `plan` is `planned_steps(cfg)`."""

    def __init__(self, console: Console, plan: dict[str, int], quiet: bool = False):
        self.console, self.quiet = console, quiet
        self.passes, self.search = pass_bars(console, quiet), SearchBar(console, plan, quiet)
        self.tasks: dict[str, int] = {}         # pass name -> its task in `passes`
        self.shown: list = []                   # the displays started so far, the live one last

    def show(self, display) -> None:
        if self.quiet or (self.shown and self.shown[-1] is display):
            return
        if self.shown:
            self.shown[-1].stop()
        display.start()
        self.shown.append(display)

    def progress(self, name: str, done: int, total: int) -> None:
        self.show(self.passes)
        if name not in self.tasks:
            self.tasks[name] = self.passes.add_task(name, total=total, completed=done)
        self.passes.update(self.tasks[name], completed=done)

    def search_progress(self, stage: str, label: str, point) -> None:
        self.show(self.search)                  # the passes are done: their bars stay, the search's comes below
        self.search.step(stage, label, point)

    def status(self, msg: str) -> None:
        if not self.quiet:
            self.console.print(f"[dim]{plain(msg)}[/]", highlight=False)      # msg names the model: plain text

    def stop(self) -> None:
        if self.shown:
            self.shown[-1].stop()
