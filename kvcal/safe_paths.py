"""Checks that keep kvcal from overwriting or deleting what it did not write.

Every output path is checked before any work starts, so a bad `--out` costs a second, not a calibration:

* `check_bundle_out`: a bundle path may replace only an existing kvcal bundle, and only with `overwrite`; never a
  folder, another file, or a file of the model or the dataset being read.
* `check_out_folder`: an export folder may not be, contain or lie inside an input (the model's folder, the bundle)
  or the working directory.
* `check_report_folder`: a folder of reports (`kvcal bench --out`) may hold only files named as the reports, replaced
  only with `overwrite`; never a file, a link, or a folder holding the user's own files.

Each also tries the output folder with a temporary file, so a read-only folder fails now, not after the model loads.
Symbolic links are refused where a file is written: `kvcal.runtime.files.write_file` never writes through one.

Telling a kvcal bundle from other files (`kvcal.runtime.bundle.is_kvcal_bundle`) and removing the temporary files of
a killed writer (`kvcal.runtime.files.remove_stale_temps`) live in the runtime, which writes bundles too.

Errors are `ValueError` (bad input) with one line naming the path and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from kvcal.runtime.bundle import is_kvcal_bundle
from kvcal.runtime.files import check_writable, refuse_link, temp_target


def _resolved(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()


def _inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies under it (both resolved)."""
    return path == folder or folder in path.parents


def check_bundle_out(out: str | os.PathLike, *, overwrite: bool = False, inputs: Iterable[str | os.PathLike] = (),
                     also_written: Iterable[str | os.PathLike] = ()) -> None:
    """Refuse a bundle output path that would overwrite something kvcal must not touch.

    out: where the bundle goes. inputs: files or folders being read (the model's folder, a .gguf, the dataset); the
    output may not be one of them or lie inside one. also_written: other files the run writes next to the bundle
    (the report); like the bundle, they are replaced only with `overwrite`.
    """
    out = Path(out)
    real = _resolved(out)
    for src in inputs:
        src_real = _resolved(src)
        if _inside(real, src_real):
            raise ValueError(f"`--out {out}` is {'' if real == src_real else 'inside '}an input of this run "
                             f"(`{src}`); write the bundle somewhere else")
    if out.is_dir():
        raise ValueError(f"`--out {out}` is a folder, not a bundle file; pass a file path such as "
                         f"`{out / 'model.kvcal.safetensors'}`")
    refuse_link(out, f"`--out {out}`")
    if out.exists():
        if not out.is_file() or not is_kvcal_bundle(out):
            raise ValueError(f"`--out {out}` exists and is not a kvcal bundle; refusing to overwrite it (choose "
                             "another path)")
        if not overwrite:
            raise ValueError(f"`--out {out}` already holds a kvcal bundle; pass `--overwrite` to replace it")
    for extra in also_written:
        extra = Path(extra)
        refuse_link(extra, f"`{extra}` (where the run writes its report)")
        if extra.exists() and not overwrite:
            raise ValueError(f"`{extra}` exists (the run writes its report there); move it or pass `--overwrite`")
    parent = out.parent if str(out.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"`--out {out}`: `{parent}` is a file, not a folder")
    check_writable(parent)


def check_report_folder(out: str | os.PathLike, names: Iterable[str], *, overwrite: bool = False,
                        known: Iterable[str] = ()) -> None:
    """Refuse a folder of reports (`kvcal bench --out`) before any work: a file or a link at `out`; a folder holding
    anything but files named as kvcal's reports (`names`, this run's; `known`, other runs' such as `--offload`'s);
    one of `names` already there without `overwrite`; a link at any of them; a folder that cannot be written."""
    out = Path(out)
    names, ours = list(names), {*names, *known}
    if out.is_symlink():
        raise ValueError(f"`--out {out}` is a symbolic link; pass the real folder, or a new one")
    if out.exists() and not out.is_dir():
        raise ValueError(f"`--out {out}` is a file; pass a folder for the reports (a new one, or an earlier report "
                         "folder with `--overwrite`)")
    if out.is_dir():
        theirs = sorted(p.name for p in out.iterdir() if not _written_by_us(p.name, ours))
        if theirs:
            raise ValueError(f"`--out {out}` holds files kvcal did not write (`{theirs[0]}`"
                             f"{f' and {len(theirs) - 1} more' if len(theirs) > 1 else ''}); choose a new folder")
        for name in names:
            refuse_link(out / name, f"`{out / name}`")
        there = [name for name in names if (out / name).exists()]
        if there and not overwrite:
            raise ValueError(f"`--out {out}` already holds `{there[0]}`; pass `--overwrite` to replace the reports, "
                             "or choose a new folder")
    check_writable(out)


def _written_by_us(name: str, ours: set[str]) -> bool:
    """`name` is one of `ours`, or the temporary file of a writer of one (`.NAME.tmp-PID`)."""
    target = temp_target(name)
    return name in ours or (target is not None and target[0] in ours)


def check_out_folder(out: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None] = ()) -> None:
    """Refuse an output folder that is, contains or lies inside an input (model folder, bundle), or that is or
    contains the working directory: replacing it would delete what is being read, or the user's own files."""
    out = Path(out)
    real = _resolved(out)
    for src in inputs:
        if src is None:
            continue
        src_real = _resolved(src)
        if _inside(real, src_real) or _inside(src_real, real):
            rel = "is" if real == src_real else "contains" if _inside(src_real, real) else "lies inside"
            raise ValueError(f"`--out {out}` {rel} `{src}`, an input of this export; choose an output folder "
                             "outside the model and the bundle")
    cwd = Path.cwd().resolve()
    if _inside(cwd, real):
        raise ValueError(f"`--out {out}` {'is' if cwd == real else 'contains'} the working directory; choose a "
                         "new folder for the export")
    check_writable(out.parent if str(out.parent) else Path("."))
