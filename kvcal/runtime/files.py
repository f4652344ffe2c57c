"""Reading and writing files safely, for the runtime's own artefacts and for the tools above it.

* `safetensors_header`: a safetensors file's JSON header, read without the tensors (and without safetensors).
* `remove_stale_temps`: `.NAME.tmp-PID` files left by a writer that was killed (kill -9, power loss) are removed
  once their process is gone; a live writer's temp file is left alone. Writers (`save_bundle`, calibration
  checkpoints, `kvcal export`) write `.NAME.tmp-PID` beside `NAME`, fsync it and rename it into place.
* `make_shareable`: the permissions the umask allows, for a file another user may read.
* `write_file`: the one way kvcal writes a file (bundles, reports, checkpoints, bench and export outputs). It never
  writes through a symbolic link (a link at the target is refused, `UnsafePathError`), writes `.NAME.tmp-PID` beside
  the target, fsyncs it and renames it in, and without `overwrite` creates the final name exclusively, so of two runs
  racing on one path exactly one wins and the other gets `FileExistsError`.
* `write_folder`: the same for a folder (`kvcal export`), which lists its files so that a later `--overwrite` removes
  only those.
* `check_writable`: a folder kvcal is about to write in, tried with a temporary file before any long work.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def temp_target(name: str) -> tuple[str, int] | None:
    """(NAME, PID) when `name` is a writer's temporary file `.NAME.tmp-PID`, else None."""
    m = _TMP.match(name)
    return None if m is None else (m["name"], int(m["pid"]))


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
        target = temp_target(p.name)
        if target is None or target[0] != path.name or _pid_alive(target[1]):
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


class UnsafePathError(ValueError):
    """A path kvcal refuses to write: a symbolic link, or a folder where a file goes."""


def refuse_link(path: str | os.PathLike, what: str = "") -> None:
    """Raise `UnsafePathError` when `path` is a symbolic link (or a folder): writing there would follow it."""
    path = Path(path)
    shown = what or f"`{path}`"
    if path.is_symlink():
        raise UnsafePathError(f"{shown} is a symbolic link; kvcal never writes through links: remove the link or "
                              "choose another path")
    if path.is_dir():
        raise UnsafePathError(f"{shown} is a folder, where kvcal writes a file; move it or choose another path")


def fsync_folder(folder: str | os.PathLike) -> None:
    """Make a rename in `folder` durable (where the file system supports it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: str | os.PathLike, data: bytes | str | Callable[[Path], object], *,
               overwrite: bool) -> Path:
    """Write `data` to `path`: bytes, text (UTF-8), or a function that writes the file whose path it is given
    (safetensors `save_file`, matplotlib `savefig`; it must not rely on the file name's suffix).

    A reader sees the old file or the whole new one; an error leaves the target as it was and no temporary file.
    Without `overwrite` an existing `path` is refused (`FileExistsError`), also when another process creates it
    while this one writes. A symbolic link at `path` is refused either way (`UnsafePathError`): a link that kvcal
    did not create may point at anything, the model's weights included.
    """
    path = Path(path)
    refuse_link(path)
    if not overwrite and os.path.lexists(path):
        raise _exists(path)
    folder = path.parent if str(path.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    tmp = folder / f".{path.name}.tmp-{os.getpid()}"
    try:
        if os.path.lexists(tmp):         # this process's own leftover (or a link planted at its name): never reused
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, str):
                f.write(data.encode())
            elif isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
        if callable(data):               # writes into the file created above (exclusively, so no link)
            data(tmp)
        make_shareable(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        _install(tmp, path, overwrite)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_folder(folder)
    return path


def _exists(path: Path) -> FileExistsError:
    # one argument: str() of the error is then the message alone, as the CLI prints it
    return FileExistsError(f"`{path}` already exists (another run may have written it meanwhile); refusing to "
                           "replace it: pass `--overwrite` to replace it")


def _install(tmp: Path, path: Path, overwrite: bool) -> None:
    """Rename `tmp` to `path`; without `overwrite` only if `path` does not exist at that moment."""
    if overwrite:
        refuse_link(path)               # a link made while the file was written: replaced never, followed never
        os.replace(tmp, path)           # rename(2) replaces a name; it never writes through a link there
        return
    try:
        os.link(tmp, path)              # link(2) fails with EEXIST when the name exists: the exclusive create
    except FileExistsError:
        raise _exists(path) from None
    except OSError:                     # no hard links on this file system: claim the name, then rename over it
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
        except FileExistsError:
            raise _exists(path) from None
        os.replace(tmp, path)


def check_writable(folder: str | os.PathLike, what: str = "") -> None:
    """Refuse (`UnsafePathError`, one line naming the folder) a folder that cannot take a new file, by creating and
    removing one; a folder that does not exist yet is tried at its nearest existing parent, where it will be made."""
    folder = Path(folder) if str(folder) else Path(".")
    probe_in = folder
    while not os.path.lexists(probe_in) and probe_in != probe_in.parent:
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        raise UnsafePathError(f"{what or f'`{folder}`'}: `{probe_in}` is a file, not a folder; choose another path")
    probe = probe_in / f".kvcal-write-check.tmp-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
        os.unlink(probe)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise UnsafePathError(f"cannot write in `{probe_in}` ({reason}); choose a folder you can write to, or "
                              "fix its permissions") from None


@contextlib.contextmanager
def write_folder(out: str | os.PathLike, *, overwrite: bool, listing: str):
    """`write_file` for a folder: yield a temporary folder beside `out`, which replaces `out` by rename when the block
    ends, or is removed when it raises. The new folder lists its files in `out/listing`.

    Refuses (FileExistsError, one line) an `out` that is a link or a file; a non-empty one unless `overwrite`, and
    even then unless everything in it is listed in its `listing` (an earlier run's): the user's files are never
    deleted, only what kvcal listed as its own.
    """
    out = Path(out)
    check_folder(out, overwrite=overwrite, listing=listing)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for path in tmp.rglob("*"):
            if path.is_file() and path.stat().st_nlink == 1:   # hard links point at files already on disk
                make_shareable(path)
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        write_file(tmp / listing, json.dumps({"written_by": "kvcal", "files": files}, indent=2), overwrite=False)
        filled = FileExistsError(f"`{out}` was filled while kvcal wrote it (another run?); refusing to replace it: "
                                 "pass `--overwrite` to replace it")
        try:
            if out.is_dir() and any(out.iterdir()):
                if not overwrite:
                    raise filled
                held = _listed_files(out, listing)           # again: the folder may have changed since the start
                old = out.with_name(f".{out.name}.old-{os.getpid()}")
                os.replace(out, old)
                os.replace(tmp, out)
                _remove_files(old, held)
            else:
                os.replace(tmp, out)                         # rename(2) replaces an empty folder, never a full one
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise filled from None
        fsync_folder(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_folder(out: str | os.PathLike, *, overwrite: bool, listing: str) -> None:
    """What `write_folder` refuses, checked alone (before a long load): see there."""
    out = Path(out)
    if out.is_symlink():
        raise FileExistsError(f"`{out}` is a symbolic link; pass a real folder path for `--out`")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"`{out}` exists and is a file; pass a folder path for `--out`")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"`{out}` exists and is not empty; pass `--overwrite` to replace it")
        _listed_files(out, listing)


def _listed_files(out: Path, listing: str) -> list[str]:
    """The files in `out` (relative paths), every one listed in `out/listing`; FileExistsError naming the first that
    is not (or is a link), or when there is no list: those are the user's."""
    try:
        names = json.loads((out / listing).read_text()).get("files", [])
        listed = {n for n in names if isinstance(n, str)}
    except (OSError, ValueError, AttributeError):
        raise FileExistsError(f"`{out}` is not empty and was not written by kvcal (no `{listing}`); refusing to "
                              "delete its files: choose a new folder") from None
    held = []
    for path in sorted(out.rglob("*")):              # rglob does not descend into linked folders
        rel = path.relative_to(out).as_posix()
        if path.is_dir() and not path.is_symlink():
            continue
        if rel != listing and (rel not in listed or path.is_symlink()):
            raise FileExistsError(f"`{out}` holds `{rel}`, which kvcal did not write there; refusing to delete it: "
                                  "move it away or choose a new folder")
        held.append(rel)
    return held


def _remove_files(folder: Path, held: list[str]) -> None:
    """Delete `held` (checked by `_listed_files`), then the folders left empty; a file added meanwhile stays."""
    for rel in held:
        (folder / rel).unlink(missing_ok=True)
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
        with contextlib.suppress(OSError):
            sub.rmdir()
    try:
        folder.rmdir()
    except OSError:
        logger.warning("left %s in place: it holds files kvcal did not write", folder)


def wait_for_test_barrier() -> None:
    """For the tests only: with `KVCAL_TEST_WRITE_BARRIER=FOLDER:N`, wait (at most a minute) until N processes have
    reached this point, so that two runs reach their final write together (tests/test_bad_inputs.py's race)."""
    spec = os.environ.get("KVCAL_TEST_WRITE_BARRIER")
    if not spec:
        return
    folder, _, n = spec.rpartition(":")
    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(list(Path(folder).iterdir())) < int(n) and time.monotonic() < deadline:
        time.sleep(0.05)
