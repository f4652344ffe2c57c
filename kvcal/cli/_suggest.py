"""Suggestions for a mistyped bundle path: the existing bundles whose names are closest come before the advice to
calibrate, which takes minutes."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

BUNDLE_SUFFIX = ".safetensors"
MAX_ENTRIES = 2000        # files looked at per folder: a suggestion must stay instant, even in a huge folder


def _candidates(folder: Path) -> list[Path]:
    """Bundles (`*.safetensors`) in `folder` and in its direct, non-hidden subfolders."""
    out: list[Path] = []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)[:MAX_ENTRIES]
    except OSError:
        return out
    for e in entries:
        if e.name.startswith("."):
            continue
        try:
            if e.is_file() and e.name.endswith(BUNDLE_SUFFIX):
                out.append(Path(e.path))
            elif e.is_dir():
                with os.scandir(e.path) as sub:
                    for i, f in enumerate(sub):
                        if i >= MAX_ENTRIES:
                            break
                        if f.name.endswith(BUNDLE_SUFFIX) and not f.name.startswith(".") and f.is_file():
                            out.append(Path(f.path))
        except OSError:
            continue
    return out


def similar_bundles(path: Path, n: int = 3) -> list[Path]:
    """Existing bundles that `path` (which does not exist) most likely means: the same file name in a subfolder
    first, then names close to it, looked up from the nearest existing folder of `path`."""
    folder = path.parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    found = _candidates(folder if folder.is_dir() else Path("."))
    same = [p for p in found if p.name == path.name]
    names = sorted({p.name for p in found})
    close = difflib.get_close_matches(path.name, names, n=n, cutoff=0.6)
    ranked = same + [p for name in close for p in found if p.name == name and p not in same]
    return ranked[:n]


def missing_bundle(path: Path) -> str:
    """One-line error for a bundle path that does not exist: similar existing bundles first, then how to make one."""
    guesses = similar_bundles(path)
    if guesses:
        listed = " or ".join(f"`{_shown(p)}`" for p in guesses)
        return (f"no bundle at `{path}`; did you mean {listed}? (otherwise create one with "
                f"`kvcal calibrate --out {path}`)")
    return f"no bundle at `{path}`; create one with `kvcal calibrate --out {path}`"


def _shown(p: Path) -> str:
    """A path as the user would type it: relative to the current folder when it is below it."""
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)
