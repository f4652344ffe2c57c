"""Checks that keep kvcal from overwriting or deleting what it did not write.

Every output path is checked before any work starts, so a bad `--out` costs a second, not a calibration:

* `check_bundle_out`: a bundle path may replace only an existing kvcal bundle, and only with `overwrite`; never a
  folder, another file, or a file of the model or the dataset being read.
* `check_out_folder`: an export folder may not be, contain or lie inside an input (the model's folder, the bundle)
  or the working directory.
* `remove_stale_temps`: `.NAME.tmp-PID` files left by a writer that was killed (kill -9, power loss) are removed
  once their process is gone; a live writer's temp file is left alone.

Errors are `ValueError` (bad input) with one line naming the path and the fix.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def _resolved(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()


def _inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies under it (both resolved)."""
    return path == folder or folder in path.parents


def safetensors_header(path: str | os.PathLike) -> tuple[int, dict] | None:
    """(header length n, JSON header) of a safetensors file (8-byte little-endian n, then a JSON object; the tensor
    data starts at byte 8 + n), read without the tensors; None when `path` cannot be read or its header is not one
    that fits in the file (at most 100 MB)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if not 2 <= n <= min(size - 8, 100 << 20):
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    return (n, header) if isinstance(header, dict) else None


def is_kvcal_bundle(path: str | os.PathLike) -> bool:
    """True when `path` is a safetensors file whose metadata says `format = kvcal-bundle` (reads the header only)."""
    found = safetensors_header(path)
    meta = found[1].get("__metadata__") if found else None
    return isinstance(meta, dict) and meta.get("format") == "kvcal-bundle"


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


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # someone else's live process
        return True
    return True


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Remove `.NAME.tmp-PID` files and folders beside `path` (NAME = its file name) whose writer process is dead.
    Returns what was removed."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return []
    removed = []
    for p in folder.glob(f".{path.name}.tmp-*"):
        m = _TMP.match(p.name)
        if m is None or m["name"] != path.name or _pid_alive(int(m["pid"])):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError as e:
            logger.warning("could not remove stale temporary file %s (%s)", p, e)
            continue
        removed.append(p)
    return removed
