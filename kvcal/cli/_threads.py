"""`--threads N|auto`, on every command: how many threads torch runs, and with it the fused CPU decode (which asks
`torch.get_num_threads()` for each layer's OpenMP region).

On a machine where another CPU-bound job runs, a parallel region with one thread per core waits at its barrier for a
thread the OS has descheduled, so torch's default (every core) can be several times slower than one thread (issue 35).
`auto`, the default, uses the cores no other job keeps busy: `max(1, usable cores - round(busy cores))`. The busy
cores are read from /proc/stat over 0.2 s when the command starts, before kvcal does any work, so they count the other
jobs and not kvcal. (The 1-minute load average, the fallback where /proc/stat is missing, also counts a kvcal command
that has just ended, and would halve the threads of the next one on a quiet machine.) An `OMP_NUM_THREADS` in the
environment is respected when `--threads` is left at `auto`.

`resolve_threads` is the rule, a pure function; `use_threads` applies it for a command."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

ENV = "OMP_NUM_THREADS"
FIX = "write a whole number of threads, at least 1 (e.g. `--threads 1`), or `auto`"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and `taskset` narrow), else all of them."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def load_average() -> float | None:
    """The 1-minute load average: runnable (and uninterruptible) tasks, averaged; None where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def _cpu_times(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) jiffies summed over `cpus`, from /proc/stat; None where it cannot be read."""
    busy = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                ticks = [int(x) for x in fields[:8]]          # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def busy_cores(window: float = 0.2) -> float | None:
    """How many of this process's usable cores other work keeps busy: the busy share of their time over `window`
    seconds, while this process sleeps, times their count. None where /proc/stat cannot be read."""
    import time

    try:
        cpus = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = set(range(os.cpu_count() or 1))
    first = _cpu_times(cpus)
    time.sleep(window)
    second = _cpu_times(cpus)
    if first is None or second is None or second[1] <= first[1]:
        return None
    return len(cpus) * (second[0] - first[0]) / (second[1] - first[1])


CORES_AT_START = usable_cores()


@functools.cache
def busy_at_start() -> float | None:
    """The busy cores (else the load average) when the first command of this process started: measured once."""
    busy = busy_cores()
    return load_average() if busy is None else busy


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count a command runs with, and why: source is "option" (`--threads N`), "env" (`OMP_NUM_THREADS`)
    or "auto" (the free cores); load is the cores other work kept busy at the start (see the module docstring)."""

    count: int
    source: str
    cores: int
    load: float | None

    def __str__(self) -> str:
        if self.source == "option":
            return f"{self.count} (--threads {self.count})"
        if self.source == "env":
            return f"{self.count} ({ENV}={self.count})"
        if self.load is None:
            return f"{self.count} (auto: busy cores unknown, {self.cores} cores)"
        return f"{self.count} (auto: {self.load:.1f} of {self.cores} cores busy)"

    def to_dict(self) -> dict:
        return {"count": self.count, "source": self.source, "cores": self.cores,
                "load": None if self.load is None else round(self.load, 2), "text": str(self)}


def parse_threads(value: str | int | None) -> int | None:
    """`--threads` as typed: a positive int, or None for `auto` (also for None). ValueError naming the fix."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    text = str(value).strip()
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"`--threads {text}` is neither a number nor `auto`: {FIX}") from None
    if n < 1:
        raise ValueError(f"`--threads {text}` runs no thread: {FIX}")
    return n


def _env_threads(env: str | None) -> int | None:
    """OMP_NUM_THREADS as OpenMP reads it (a list such as `4,2` gives the outer level first); None if unset or not
    a positive number (OpenMP ignores it then too)."""
    if not env or not env.strip():
        return None
    first = env.split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def resolve_threads(option: int | None, *, cores: int, load: float | None, env: str | None) -> ThreadChoice:
    """The rule: an explicit `--threads N` wins; with `auto` (option None), a valid `OMP_NUM_THREADS` (env); else the
    cores not busy, `max(1, cores - round(load))` (all cores where there is no load average)."""
    cores = max(1, int(cores))
    if option is not None:
        return ThreadChoice(int(option), "option", cores, load)
    from_env = _env_threads(env)
    if from_env is not None:
        return ThreadChoice(from_env, "env", cores, load)
    free = cores if load is None else max(1, cores - round(load))
    return ThreadChoice(free, "auto", cores, load)


def use_threads(value: str | int | None) -> ThreadChoice:
    """Resolve `--threads` for this command and apply it to torch (`set_num_threads`, and `set_num_interop_threads`
    where torch has not started its inter-op pool yet). Called inside a command, the previous count comes back when
    the command ends, so that a command run in-process (tests, notebooks) leaves the caller's setting as it was."""
    import torch
    from typer._click.globals import get_current_context  # typer vendors click: its context stack, not click's

    option, env = parse_threads(value), os.environ.get(ENV)
    measure = option is None and _env_threads(env) is None          # only `auto` needs the 0.2 s measurement
    choice = resolve_threads(option, cores=CORES_AT_START, load=busy_at_start() if measure else None, env=env)
    before = torch.get_num_threads()
    torch.set_num_threads(choice.count)
    try:
        torch.set_num_interop_threads(choice.count)
    except RuntimeError:          # "cannot set number of interop threads after parallel work has started or ..."
        pass
    ctx = get_current_context(silent=True)
    if ctx is not None:
        ctx.call_on_close(lambda: torch.set_num_threads(before))
    return choice
