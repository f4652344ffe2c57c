"""Static per-channel key ranges (KVQuant-style), calibrated offline for the runtime's static key tiers (`K4sV4`).

For each (layer, KV head) and each column c of the bundle's rotation R, the clip range [low_c, high_c] of the stored
key coordinate (K·R)[:, c] on calibration text, post-RoPE:

    high_c = the (m + 1)-th largest value, low_c = the (m + 1)-th smallest, m = floor(tail * N)

over N calibration rows, tail = 1 - percentile / 100. So at most m values (a fraction <= tail) lie above high_c and
at most m below low_c: the range never clips more calibration data than the percentile allows. The runtime rounds
the fp16 scale and zero outwards (`quant.static_scale_zero`), so that bound holds for the stored codes too.

Why after the eigendecomposition, not inside the Gram pass: R is known only once the Gram matrices of both passes
are summed and decomposed, and percentiles of K·R cannot be recovered from second moments. So the calibration-text
pass keeps the queries and keys of (a few of) its windows (`passes.QueryKeyTap`: about 0.1 GB per 1k-token window
of a 135M model, 0.2 GB of a 1.5B one) and `KeyRangeCollector` reads them once R is known: the statistics of a pass
over the same windows at the same positions, bit for bit, without running it. A resumed run whose text pass skipped
some of them runs that pass. Calibration text, not the search's recorded K: that is held-out text the search
measures on, and exists only with the search.

Columns, not served coordinates: the runtime serves static keys in R's columns without the mixing rotation
(kvcal.runtime.storage.bases), so a range fitted here holds at every rank (cutting to a rank drops columns).
"""

from __future__ import annotations

import math

import torch

from kvcal.models import ModelAdapter

# min-max over the calibration rows: without a sparse store for the clipped outliers (KVQuant keeps 1% in fp16),
# clipping costs more than the resolution it buys (static key ranges: docs/formats.md, "What this decided").
DEFAULT_PERCENTILE = 100.0
DEFAULT_WINDOWS = 4           # calibration windows of the pass (4 x 1024 tokens: m = 4 rows per tail at 99.9)


def spread_windows(n: int, k: int) -> list[int]:
    """k of n window indices, evenly spread (first and last included): calibration windows sit at increasing position
    offsets, so the pass sees the whole position range, not its start (post-RoPE ranges depend on position)."""
    k = min(k, n)
    return [0] if k == 1 else [round(i * (n - 1) / (k - 1)) for i in range(k)]


def tail_rows(rows: int, percentile: float) -> int:
    """m = floor((1 - percentile / 100) * rows): rows a tail may leave outside the range."""
    if not 50.0 < percentile <= 100.0:
        raise ValueError(f"key range percentile {percentile} must be in (50, 100]; e.g. 99.9 clips 0.1% per tail")
    # the small epsilon keeps e.g. (1 - 0.999) * 1000 = 0.99999... from flooring to 0 when it means 1
    return max(0, math.floor((100.0 - percentile) / 100.0 * rows + 1e-9))


def clip_range(x: torch.Tensor, percentile: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [..., N, n] -> (low, high) float32 [..., n]: the (m + 1)-th smallest and largest of each channel over
    the N rows (module docstring)."""
    N = x.shape[-2]
    if N == 0:
        raise ValueError("no calibration rows to fit key ranges on")
    k = tail_rows(N, percentile) + 1
    xf = x.float().transpose(-1, -2)                                               # [..., n, N]
    high = xf.topk(k, dim=-1).values[..., -1]
    low = xf.topk(k, dim=-1, largest=False).values[..., -1]
    return low, high


class KeyRangeCollector:
    """Streams K·R per (layer, KV head) and keeps, per column, the m + 1 largest and smallest values seen, for
    `rows` calibration rows per layer in all (known up front, which fixes m). A capture collector
    (kvcal.profile.capture); `ranges()` gives (low, high) float32 [L, H, d].

    rotation: [L, H, d, d] float32, the bundle's `qk.rotation` (columns = stored key coordinates)."""

    def __init__(self, adapter: ModelAdapter, rotation: torch.Tensor, rows: int, percentile: float):
        L, H, d = adapter.num_layers, adapter.num_kv_heads, adapter.head_dim
        self.rotation = rotation.float()
        self.keep = tail_rows(rows, percentile) + 1
        self.rows_expected = rows
        self.top = torch.full((L, H, d, self.keep), -math.inf)
        self.bottom = torch.full((L, H, d, self.keep), math.inf)
        self.rows = torch.zeros(L, dtype=torch.int64)

    @torch.no_grad()
    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        B, H, S, d = key.shape
        k = torch.einsum("bhsd,hde->hebs", key.to("cpu", torch.float32), self.rotation[layer]).reshape(H, d, B * S)
        self.top[layer] = torch.cat([self.top[layer], k], -1).topk(self.keep, dim=-1).values
        self.bottom[layer] = torch.cat([self.bottom[layer], k], -1).topk(self.keep, dim=-1, largest=False).values
        self.rows[layer] += B * S

    def ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(low, high) float32 [L, H, d]; every layer must have seen the rows it was built for."""
        short = [int(i) for i in torch.nonzero(self.rows != self.rows_expected).flatten()]
        if short:
            raise ValueError(f"key ranges: layer {short[0]} saw {int(self.rows[short[0]])} rows, expected "
                             f"{self.rows_expected}")
        return self.bottom[..., -1].clone(), self.top[..., -1].clone()

    def absmax(self) -> torch.Tensor:
        """float32 [L, H, d]: each column's largest |K·R| seen (the kept extremes hold the maximum and minimum)."""
        return torch.maximum(self.top[..., 0].abs(), self.bottom[..., 0].abs())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"top": self.top, "bottom": self.bottom, "rows": self.rows}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name in ("top", "bottom", "rows"):
            getattr(self, name).copy_(state[name])
