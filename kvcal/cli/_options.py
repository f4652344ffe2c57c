"""Options shared by several commands, and the one way commands report errors."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from kvcal.cli._console import stderr
from kvcal.cli._errors import plain
from kvcal.cli._help import KvcalCommand
from kvcal.models import PACKAGED_MODELS

ModelOpt = Annotated[str, typer.Option(
    "--model", "-m", metavar="MODEL",
    help=f"Packaged model name ({', '.join(PACKAGED_MODELS)}), a .gguf file, or a Hugging Face folder.")]
BundleArg = Annotated[Path, typer.Argument(metavar="BUNDLE", help="A bundle written by `kvcal calibrate`.")]
MAX_SEED = 2**63 - 1      # torch's generators take 64 bits, and the search and evaluation splits use seed + 1, + 2


def _check_seed(value: int) -> int:
    """`--seed` in range as it is parsed: a larger one failed in torch only after the model had loaded."""
    if not 0 <= value <= MAX_SEED:
        raise typer.BadParameter(f"{value} is out of range; pass a seed from 0 to {MAX_SEED}")
    return value


SeedOpt = Annotated[int, typer.Option("--seed", callback=_check_seed,
                                      help="Seed for every random choice (token ids, text order).")]
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
    help="Threads for torch and the CPU kernels. auto: OMP_NUM_THREADS if set, else the usable cores that other work "
         "does not keep busy (read from /proc/stat as the command starts).")]


# --------------------------------------------------------------------------------------------- option groups


def option_values(cls: type, options: Mapping[str, Any]) -> dict[str, Any]:
    """The parsed options (a command's parameters by name) that are init fields of the dataclass `cls`."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return {name: value for name, value in options.items() if name in names}


def from_options(cls: type, options: Mapping[str, Any], **derived: Any) -> Any:
    """The dataclass `cls` built once from a command's parsed options: each field takes the option of its name;
    `derived` (what the command computed from options: a parsed list, a checked device map) wins over them."""
    return cls(**{**option_values(cls, options), **derived})


@dataclass(frozen=True)
class Output:
    """How a command reports: `json_out`, one JSON object on stdout instead of tables; `quiet`, no progress bars."""

    json_out: bool = False
    quiet: bool = False


class CheckedCommand(KvcalCommand):
    """Every command's class: kvcal's help layout, and every number checked as it is parsed, before any work.

    `nan`, `inf` and `-inf` parse as floats, and no kvcal option means one (a NaN target is never met, so the search
    ran its whole time for nothing): a float option that is not finite is a one-line usage error. Ranges are the
    commands' own (CalibrationConfig, BenchSettings, the exports), checked before the model loads too."""

    def parse_args(self, ctx, args):
        rest = super().parse_args(ctx, args)
        for param in self.get_params(ctx):
            value = ctx.params.get(param.name)
            if isinstance(value, float) and not math.isfinite(value):
                default = param.default
                fix = (f"a finite number such as {default:g}, the default" if isinstance(default, float)
                       and math.isfinite(default) else "a finite number")
                raise typer.BadParameter(f"{value:g} is not a finite number; pass {fix}", ctx=ctx, param=param)
        return rest


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print a one-line error on stderr and return the Exit to raise. Only the first line of `message` is shown, as
    plain text: it may quote file contents (bundle metadata), which must not reach the terminal as markup or ANSI."""
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    stderr.print(f"[bold red]error:[/] {plain(lines[0] if lines else 'failed')}", highlight=False, soft_wrap=True)
    return typer.Exit(code=code)


# `--device-map` values that let accelerate place the layers (and read `--max-memory`); any other value is one device
PLACEMENTS = ("auto", "balanced", "balanced_low_0", "sequential")


def devices_offered() -> list[str]:
    """The devices this torch can use here: cpu, then each CUDA (or XPU) device by index, and mps."""
    import torch

    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        out += [f"xpu:{i}" for i in range(xpu.device_count())]
    if torch.backends.mps.is_available():
        out.append("mps")
    return out


def _no_such_device(flag: str, spec: str, what: str, offered: list[str], fix: str) -> ValueError:
    import torch

    why = ("this torch has no CUDA device (torch.cuda.is_available() is False)"
           if what.startswith("cuda") and not torch.cuda.is_available() else f"`{what}` is not a device here")
    return ValueError(f"`{flag} {spec}`: {why}; torch offers {', '.join(offered)}: {fix}")


def check_device_map(spec: str | None) -> str | None:
    """`--device-map`, checked against what torch offers before the model loads (transformers would fail only while
    loading, with a traceback or an error blamed on the weights): a placement (`PLACEMENTS`) or one device that
    exists here (cpu, cuda, cuda:N or N, mps, xpu:N)."""
    if spec is None:
        return None
    value = spec.strip()
    if value in PLACEMENTS:
        return value
    import torch

    offered = devices_offered()
    try:
        device = torch.device(f"cuda:{value}" if value.isdigit() else value)
    except (RuntimeError, ValueError):
        raise ValueError(f"`--device-map {spec}` is neither a placement ({', '.join(PLACEMENTS)}) nor a device; "
                         f"pass `--device-map auto` or one of the devices torch offers here: {', '.join(offered)}"
                         ) from None
    name = device.type if device.index is None else f"{device.type}:{device.index}"
    if device.type != "cpu" and name not in offered and not any(o.startswith(name + ":") for o in offered):
        raise _no_such_device("--device-map", spec, name, offered, "pass one of those or `--device-map auto`")
    return name


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?", re.IGNORECASE)


def parse_max_memory(spec: str | None, device_map: str | None = None) -> dict | None:
    """'0=10GiB,cpu=30GiB' -> {0: 10737418240, 'cpu': 32212254720} (accelerate's max_memory, in bytes), checked
    before the model loads: each DEVICE is one torch offers here (a GPU index, cpu, mps) or disk, each SIZE a number
    with a unit, and a placement `--device-map` reads them (with no or one device, accelerate would ignore them)."""
    if not spec:
        return None
    example = "e.g. `cpu=2GiB` or `0=10GiB,cpu=30GiB`"
    offered = devices_offered()
    out: dict = {}
    for part in spec.split(","):
        dev, eq, size = (x.strip() for x in part.partition("="))
        if not eq or not dev or not size:
            raise ValueError(f"`--max-memory {spec}`: write DEVICE=SIZE pairs, {example}")
        m = _SIZE.fullmatch(size)
        if m is None:
            raise ValueError(f"`--max-memory {spec}`: `{size}` is not a size; write a number and a unit (B, KB, MB, "
                             f"GB, KiB, MiB, GiB), {example}")
        # accelerate names a GPU (CUDA or XPU) by its index, everything else by name
        gpus = [o.split(":")[1] for o in offered if o.startswith(("cuda:", "xpu:"))]
        index = dev.removeprefix("cuda:").removeprefix("xpu:")
        if index.isdigit():
            if str(int(index)) not in gpus:
                raise _no_such_device("--max-memory", spec, f"{'xpu' if dev.startswith('xpu') else 'cuda'}:{index}",
                                      offered, f"cap only those, {example}")
            key: int | str = int(index)
        elif dev in ("cpu", "disk") or (dev == "mps" and dev in offered):
            key = dev
        else:
            names = ["cpu", "disk", *(["mps"] if "mps" in offered else []), *(f"GPU index {g}" for g in gpus)]
            raise ValueError(f"`--max-memory {spec}`: `{dev}` is not a device here; use {', '.join(names)}, {example}")
        out[key] = int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])
    if device_map is None or device_map.strip() not in PLACEMENTS:
        raise ValueError(f"`--max-memory {spec}` caps what a placement `--device-map` puts on each device; add "
                         f"`--device-map auto` (or {', '.join(PLACEMENTS[1:])})")
    return out
