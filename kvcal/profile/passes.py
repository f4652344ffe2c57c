"""The statistics passes' forward: each window of token ids through the model at its position offset, its
attention's post-RoPE queries, keys and values shown to capture collectors (kvcal.profile.capture).

`run_pass` streams a pass into a collector and checkpoints it per window; `QueryKeyTap` keeps some windows' queries
and keys from a pass for the statistics that need the rotation the pass helps make, and `key_range_pass` turns those
(or a pass of its own) into the static key ranges and smoothing factors; `FirstWindows` feeds a collector only a
pass's first windows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcal.models import LoadedModel
from kvcal.profile.capture import CollectorSet, GramCollector, capturing
from kvcal.profile.checkpoint import Checkpoint
from kvcal.profile.key_ranges import KeyRangeCollector
from kvcal.profile.smoothing import QueryAbsMax, smoothing_factors

Progress = Callable[[str, int, int], None]   # (pass name, windows done, windows total)


class QueryKeyTap:
    """A capture collector that keeps what attention sees of some of a pass's windows: the post-RoPE queries
    [1, Hq, S, d] and keys [1, H, S, d] of every layer, as the model hands them over (no copy). `run_pass` tells it
    which window runs (`start`). A statistic that needs the bundle's rotation, known only after the pass, then reads
    those windows (`captured`) instead of running the model over them again."""

    def __init__(self, windows: list[int]):
        self.windows, self.window = set(windows), -1
        self.kept: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def start(self, window: int) -> None:
        self.window = window

    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.window in self.windows:
            self.kept.setdefault(self.window, {})[layer] = (query, key)

    def captured(self, windows: list[int]) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]] | None:
        """Each of `windows`' layers' (query, key), or None unless every one of them ran in full (a resumed pass
        skips the windows its checkpoint holds)."""
        layers = {len(self.kept.get(w, {})) for w in windows}
        return [self.kept[w] for w in windows] if len(layers) == 1 and 0 not in layers else None


class FirstWindows:
    """A capture collector fed only by a pass's first `n` windows (`run_pass` tells it which window runs, `start`),
    checkpointed as the collector it wraps. The FastGen statistics need only a couple of windows, and since attention
    depends on positions only through their differences, a window's attention maps are the same at any offset: they
    read the text pass's first windows instead of a pass of their own."""

    def __init__(self, collector, n: int):
        self.collector, self.n, self.window = collector, n, -1

    def start(self, window: int) -> None:
        self.window = window

    def set_tokens(self, token_ids: torch.Tensor) -> None:
        if self.window < self.n and hasattr(self.collector, "set_tokens"):
            self.collector.set_tokens(token_ids)

    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.window < self.n:
            self.collector.add(layer, query, key, value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.collector.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.collector.load_state_dict(state)


@torch.inference_mode()
def run_pass(lm: LoadedModel, name: str, windows: torch.Tensor, offsets: list[int], collector,
             checkpoint: Checkpoint | None = None, progress: Progress | None = None,
             tap: QueryKeyTap | None = None) -> GramCollector:
    """Forward every window [n, S] at its position offset, feeding `collector` (and `tap`, which is not
    checkpointed); resumes from `checkpoint`."""
    done = checkpoint.load(name, collector) if checkpoint else 0
    n, S = windows.shape
    if progress:
        progress(name, done, n)
    device = lm.model.device
    if device.type == "meta":          # everything offloaded to disk: accelerate runs the layers on the CPU
        device = torch.device("cpu")
    for i in range(done, n):
        positions = torch.arange(offsets[i], offsets[i] + S)[None]
        for follower in (collector, tap):             # collectors that follow which window runs
            if hasattr(follower, "start"):
                follower.start(i)
        if hasattr(collector, "set_tokens"):          # collectors that need the token ids (FastGen classes)
            collector.set_tokens(windows[i][None])
        with capturing(lm.model, collector, *([tap] if tap is not None else [])):
            # logits_to_keep=1: only the captured statistics matter, and [S, vocab] logits cost GBs on big vocabularies
            lm.model(input_ids=windows[i][None].to(device), position_ids=positions.to(device), use_cache=False,
                     logits_to_keep=1)
        if checkpoint:
            checkpoint.save(name, collector, i + 1)
        if progress:
            progress(name, i + 1, n)
    return collector


def key_range_pass(lm: LoadedModel, rotation: torch.Tensor, windows: torch.Tensor, offsets: list[int],
                   percentile: float, checkpoint: Checkpoint | None = None, progress: Progress | None = None,
                   captured: list[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Static key ranges (kvcal.profile.key_ranges) and channel smoothing factors (kvcal.profile.smoothing) of
    K @ rotation [L, H, d, d] over calibration `windows` [n, S] at their position `offsets`: (low, high, D) float32
    [L, H, d] each. Both are per column of R, so they come after the eigendecomposition: from the text pass's
    `captured` queries and keys of these windows (`QueryKeyTap.captured`) where it kept them, else from a pass of
    their own."""
    ranges = KeyRangeCollector(lm.adapter, rotation, int(windows.numel()), percentile)
    queries = QueryAbsMax(lm.adapter, rotation)
    both = CollectorSet(ranges=ranges, queries=queries)
    if captured is None:
        run_pass(lm, "key-ranges", windows, offsets, both, checkpoint, progress)
    else:
        for i, layers in enumerate(captured):
            for layer, (query, key) in layers.items():
                both.add(layer, query, key, key)
            if progress:
                progress("key-ranges", i + 1, len(captured))
    return (*ranges.ranges(), smoothing_factors(ranges.absmax(), queries.q))
