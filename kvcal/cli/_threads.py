"""`--threads N|auto`, on every command: how many threads torch runs, and with it the fused CPU decode (which asks
`torch.get_num_threads()` for each layer's OpenMP region).

On a machine where another CPU-bound job runs, a parallel region with one thread per core waits at its barrier for a
thread the OS has descheduled, so torch's default (every core) can be several times slower than one thread (issue 35).
`auto`, the default, uses the cores no other job keeps busy: `max(1, usable cores - round(1-minute load average))`,
with the load average read when this module is imported, before kvcal has done any work, so that it counts the other
jobs and not kvcal. An `OMP_NUM_THREADS` in the environment is respected when `--threads` is left at `auto`.

`resolve_threads` is the rule, a pure function; `use_threads` applies it for a command."""

from __future__ import annotations

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


CORES_AT_START, LOAD_AT_START = usable_cores(), load_average()


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count a command runs with, and why: source is "option" (`--threads N`), "env" (`OMP_NUM_THREADS`)
    or "auto" (the free cores)."""

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
            return f"{self.count} (auto: no load average, {self.cores} cores)"
        return f"{self.count} (auto: load {self.load:.1f} on {self.cores} cores)"

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

    choice = resolve_threads(parse_threads(value), cores=CORES_AT_START, load=LOAD_AT_START, env=os.environ.get(ENV))
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
