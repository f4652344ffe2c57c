"""Reading and writing files safely, for the runtime's own artefacts and for the tools above it.

* `safetensors_header`: a safetensors file's JSON header, read without the tensors (and without safetensors).
* `remove_stale_temps`: `.NAME.tmp-PID` files left by a writer that was killed (kill -9, power loss) are removed
  once their process is gone; a live writer's temp file is left alone. Writers (`save_bundle`, calibration
  checkpoints, `kvcal export`) write `.NAME.tmp-PID` beside `NAME`, fsync it and rename it into place.
* `make_shareable`: the permissions the umask allows, for a file another user may read.

Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path

logger = logging.getLogger(__name__)

_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


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


def make_shareable(path: str | os.PathLike) -> None:
    """Give a file the permissions the umask allows (safetensors creates 0600; artefacts are meant to be shared)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


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
