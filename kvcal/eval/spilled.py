"""Recorded prompts kept on disk, a window per file, so that only the window in use is in memory.

A record is what a prefill leaves in the cache, per layer: (key, value [1, H, n, d], tokens seen or None), as
`KvcalCache.record_prompt` and the search's recording make them. At 4k tokens a window of a 30-layer model is about
94 MB in fp16; the search and the confirmation each keep four, and read them a window (or once a batch) at a time.
The files live in a private folder under the temporary folder (`TMPDIR`, else /tmp), removed when the object goes
(or the process ends). Where /tmp is a tmpfs they stay in memory, outside the process's RSS: point `TMPDIR` at a disk.

    spilled = SpilledRecords()
    spilled.append(records)           # layer -> (key, value [1, H, n, d], seen)
    spilled.window(0)                 # the same dict, read back
    spilled.batch()                   # layer -> (key, value [B, H, n, d], seen): every window stacked
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch


class SpilledRecords:
    """Per-window prompt records in files (module docstring)."""

    def __init__(self):
        self._folder = tempfile.TemporaryDirectory(prefix="kvcal-records-")
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def _path(self, b: int) -> Path:
        return Path(self._folder.name) / f"window-{b}.pt"

    def append(self, records: dict) -> None:
        """Add a window's records: layer -> tuple of tensors [1, ...], dicts of them and plain values."""
        torch.save(_each(records, _one_window), self._path(self._count))
        self._count += 1

    def window(self, b: int) -> dict:
        """Window b's records, as appended."""
        if not 0 <= b < self._count:
            raise IndexError(f"window {b} of {self._count}")
        return torch.load(self._path(b), weights_only=True)

    def batch(self) -> dict:
        """Every window's records, tensors stacked along the batch (layer -> (key, value [B, H, n, d], ...)), filled a
        window at a time into tensors made once, so the batch is never held twice. Plain values (tokens seen) must
        agree between windows."""
        first = self.window(0) if self._count else {}
        out = _each(first, lambda t: t.new_empty(self._count, *t.shape[1:]))
        for b in range(self._count):
            _fill(out, self.window(b) if b else first, b)
        return out


def _one_window(t: torch.Tensor) -> torch.Tensor:
    if t.shape[0] != 1:
        raise ValueError(f"a window's records hold one window: tensors [1, ...], not {list(t.shape)}")
    return t.contiguous()


def _each(x, f):
    """`x` (dicts, tuples and lists of tensors and plain values) with f applied to every tensor."""
    if isinstance(x, torch.Tensor):
        return f(x)
    if isinstance(x, dict):
        return {k: _each(v, f) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_each(v, f) for v in x)
    return x


def _fill(full, one, b: int) -> None:
    """Write window `one`'s tensors [1, ...] at row b of `full`'s (same structure); plain values must be equal."""
    if isinstance(full, torch.Tensor):
        full[b] = one[0]
    elif isinstance(full, dict):
        for k in full:
            _fill(full[k], one[k], b)
    elif isinstance(full, (tuple, list)):
        for f, o in zip(full, one, strict=True):
            _fill(f, o, b)
    elif full != one:
        raise ValueError(f"the windows differ in {one!r} vs {full!r}: they cannot be one batch")
