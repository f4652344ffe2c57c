"""Recorded prompts kept on disk, a file per window and layer, so that only what is in use is in memory.

A record is what a prefill leaves in the cache, per layer: (key, value [1, H, n, d], tokens seen or None), as
`KvcalCache.record_prompt` and the search's recording make them. At 4k tokens a window of a 30-layer model is about
94 MB in fp16; the search and the confirmation each keep four. The coded probe reads them a window at a time, the
runtime's check as one batch a layer at a time (`batch()` stacks a layer's windows when that layer is read, so the
check holds one layer's batch, not every layer's). The files live in a private folder under the temporary folder
(`TMPDIR`, else /tmp), removed when the object goes (or the process ends). Where /tmp is a tmpfs they stay in
memory, outside the process's RSS: point `TMPDIR` at a disk.

    spilled = SpilledRecords()
    spilled.append(records)           # layer -> (key, value [1, H, n, d], seen)
    spilled.window(0)                 # the same dict, read back
    spilled.batch()[layer]            # (key, value [B, H, n, d], seen): the layer's windows stacked, read on access
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch


class SpilledRecords:
    """Per-window prompt records in files (module docstring)."""

    def __init__(self):
        self._folder = tempfile.TemporaryDirectory(prefix="kvcal-records-")
        self._shapes: list[dict] = []           # per window: layer -> its record with each tensor as (dtype, shape)

    def __len__(self) -> int:
        return len(self._shapes)

    def _path(self, b: int, layer) -> Path:
        return Path(self._folder.name) / f"window-{b}-layer-{layer}.pt"

    def append(self, records: dict) -> None:
        """Add a window's records: layer -> tuple of tensors [1, ...], dicts of them and plain values."""
        records = _each(records, _one_window)
        for layer, record in records.items():
            torch.save(record, self._path(len(self), layer))
        self._shapes.append(_each(records, lambda t: (t.dtype, tuple(t.shape))))

    def window(self, b: int) -> dict:
        """Window b's records, as appended."""
        if not 0 <= b < len(self):
            raise IndexError(f"window {b} of {len(self)}")
        return {layer: self._load(b, layer) for layer in self._shapes[b]}

    def _load(self, b: int, layer):
        return torch.load(self._path(b, layer), weights_only=True)

    def batch(self) -> StackedLayers:
        """Every window's records stacked along the batch, a layer at a time as each is read (layer -> (key, value
        [B, H, n, d], ...)). Every window must hold the same layers, shapes and plain values (tokens seen)."""
        first = self._shapes[0] if self._shapes else {}
        for b, shapes in enumerate(self._shapes[1:], 1):
            if shapes != first:
                layer = next(k for k in {**first, **shapes} if shapes.get(k) != first.get(k))
                raise ValueError(f"window {b} differs from window 0 in layer {layer} ({shapes.get(layer)!r} vs "
                                 f"{first.get(layer)!r}): they cannot be one batch")
        return StackedLayers(self, list(first))


class StackedLayers(Mapping):
    """`SpilledRecords.batch()`: layer -> its record with every window's tensors stacked [B, ...], read from the
    files when the layer is looked up (each lookup reads them again: look each layer up once)."""

    def __init__(self, spilled: SpilledRecords, layers: list):
        self._spilled, self._layers = spilled, layers

    def __getitem__(self, layer):
        if layer not in self._layers:
            raise KeyError(layer)
        spilled = self._spilled
        first = spilled._load(0, layer)
        out = _each(first, lambda t: t.new_empty(len(spilled), *t.shape[1:]))
        for b in range(len(spilled)):
            _fill(out, spilled._load(b, layer) if b else first, b)
        return out

    def __contains__(self, layer) -> bool:
        return layer in self._layers

    def __iter__(self) -> Iterator:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)


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
    """Write window `one`'s tensors [1, ...] at row b of `full`'s (same structure; `batch()` checked the plain
    values agree)."""
    if isinstance(full, torch.Tensor):
        full[b] = one[0]
    elif isinstance(full, dict):
        for k in full:
            _fill(full[k], one[k], b)
    elif isinstance(full, (tuple, list)):
        for f, o in zip(full, one, strict=True):
            _fill(f, o, b)
