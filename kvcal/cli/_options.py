"""Options shared by several commands, and the one way commands report errors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcal.cli._console import stderr
from kvcal.cli._errors import plain
from kvcal.models import PACKAGED_MODELS

ModelOpt = Annotated[str, typer.Option(
    "--model", "-m", metavar="MODEL",
    help=f"Packaged model name ({', '.join(PACKAGED_MODELS)}), a .gguf file, or a Hugging Face folder.")]
BundleArg = Annotated[Path, typer.Argument(metavar="BUNDLE", help="A bundle written by `kvcal calibrate`.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for every random choice (token ids, text order).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]


def _check_threads(value: str) -> str:
    """`--threads` is checked as it is parsed, so a bad value is a one-line usage error before any work."""
    from kvcal.cli._threads import parse_threads

    try:
        parse_threads(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return value


# every command passes it to `kvcal.cli._threads.use_threads` first thing
ThreadsOpt = Annotated[str, typer.Option(
    "--threads", metavar="N|auto", callback=_check_threads,
    help="Threads for torch and the CPU kernels. auto: OMP_NUM_THREADS if set, else the cores not busy (usable cores "
         "minus the 1-minute load average); on a shared machine, 1 if another job may start.")]


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print a one-line error on stderr and return the Exit to raise. Only the first line of `message` is shown, as
    plain text: it may quote file contents (bundle metadata), which must not reach the terminal as markup or ANSI."""
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    stderr.print(f"[bold red]error:[/] {plain(lines[0] if lines else 'failed')}", highlight=False, soft_wrap=True)
    return typer.Exit(code=code)


def parse_max_memory(spec: str | None) -> dict | None:
    """'0=10GiB,cpu=30GiB' -> {0: '10GiB', 'cpu': '30GiB'} (accelerate's max_memory)."""
    if not spec:
        return None
    out: dict = {}
    for part in spec.split(","):
        if "=" not in part:
            raise ValueError(f"`--max-memory {spec}`: write DEVICE=SIZE pairs, e.g. `cpu=2GiB` or `0=10GiB,cpu=30GiB`")
        dev, size = part.split("=", 1)
        out[int(dev) if dev.strip().isdigit() else dev.strip()] = size.strip()
    return out
