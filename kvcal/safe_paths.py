"""Checks that keep kvcal from overwriting or deleting what it did not write.

Every output path is checked before any work starts, so a bad `--out` costs a second, not a calibration:

* `check_bundle_out`: a bundle path may replace only an existing kvcal bundle, and only with `overwrite`; never a
  folder, another file, or a file of the model or the dataset being read.
* `check_out_folder`: an export folder may not be, contain or lie inside an input (the model's folder, the bundle)
  or the working directory.

Telling a kvcal bundle from other files (`kvcal.runtime.bundle.is_kvcal_bundle`) and removing the temporary files of
a killed writer (`kvcal.runtime.files.remove_stale_temps`) live in the runtime, which writes bundles too.

Errors are `ValueError` (bad input) with one line naming the path and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from kvcal.runtime.bundle import is_kvcal_bundle


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
        raise ValueError(f"`--out {out}` is a folder; pass a file path such as `{out / 'model.kvcal.safetensors'}`")
    if out.exists() or out.is_symlink():
        if not out.is_file() or not is_kvcal_bundle(out):
            raise ValueError(f"`--out {out}` exists and is not a kvcal bundle; refusing to overwrite it (choose "
                             "another path)")
        if not overwrite:
            raise ValueError(f"`--out {out}` already holds a kvcal bundle; pass `--overwrite` to replace it")
    for extra in also_written:
        extra = Path(extra)
        if extra.is_dir() or (extra.exists() and not overwrite):
            raise ValueError(f"`{extra}` exists (the run writes its report there); move it or pass `--overwrite`")
    parent = out.parent if str(out.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"`--out {out}`: `{parent}` is a file, not a folder")


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
