"""Where kvcal keeps files it can rebuild: converted models, compiled kernels, per-machine profiles."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of kvcal's on-disk cache (`$KVCAL_CACHE`, else `~/.cache/kvcal`)."""
    return Path(os.environ.get("KVCAL_CACHE", Path.home() / ".cache" / "kvcal"))
