"""Channel smoothing (SmoothAttention, QServe §4.2), calibrated offline into the bundle (`qk.smoothing`).

One positive factor D_c per stored key coordinate c of each (layer, KV head): keys are stored divided by it and
queries multiplied by it, which leaves every attention logit unchanged,

    k' = (K R)_c / D_c,   q' = (Q R)_c · D_c   =>   q' · k' = (Q R) · (K R) = Q · K      (R orthogonal)

while moving range from the key coordinates to the query coordinates. A coordinate where keys are large and queries
small (the outlier key channels of the Qwen2.5 family) is shrunk in the cache, so a per-token key scale no longer
spends its range on it; the query, which is never quantized, carries the factor back.

    D_c = sqrt(max|K R|_c / max|Q R|_c)      (migration strength 1/2: both sides end at sqrt(max|K| · max|Q|))

over calibration text, post-RoPE, per column of the bundle's rotation R (max over the group's query heads), then
divided by its geometric mean over the head's columns, so the keys' overall scale is unchanged. The runtime folds D
into the bases (runtime.storage.bases): keys through R·diag(1/D)·M, queries through R·diag(D)·M, with M kvcal's fixed
orthogonal mixing, so the mixing spreads what smoothing leaves. Per-channel key scales are indifferent to a
per-coordinate factor on their own; after the mixing they are not.
"""

from __future__ import annotations

import torch

from kvcal.models import ModelAdapter

STRENGTH = 0.5           # SmoothQuant's alpha: the share of each coordinate's range moved from keys to queries
FLOOR = 1e-6             # a coordinate no calibration row reached (all zeros) keeps D = 1 after normalisation


class QueryAbsMax:
    """Streams Q·R per (layer, KV head) and keeps each column's largest |value| over the group's query heads (a
    capture collector, kvcal.profile.capture). q: float32 [L, H, d]. rotation: [L, H, d, d] float32, the bundle's
    `qk.rotation`. The keys' side comes from the same pass's `KeyRangeCollector.absmax`, which projects them already."""

    def __init__(self, adapter: ModelAdapter, rotation: torch.Tensor):
        L, H, d = adapter.num_layers, adapter.num_kv_heads, adapter.head_dim
        self.rotation = rotation.float()
        self.group = adapter.group_size
        self.q = torch.zeros(L, H, d)

    @torch.no_grad()
    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        B, H, S, d = key.shape
        q = query.to("cpu", torch.float32).reshape(B, H, self.group * S, d)       # query heads grouped by KV head
        q = torch.einsum("bhsd,hde->bhse", q, self.rotation[layer]).abs().amax(dim=(0, 2))
        self.q[layer] = torch.maximum(self.q[layer], q)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"q": self.q}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.q.copy_(state["q"])


def smoothing_factors(k_absmax: torch.Tensor, q_absmax: torch.Tensor, strength: float = STRENGTH) -> torch.Tensor:
    """D [..., d] float32 > 0 from the per-column max |K R| and |Q R| [..., d] (module docstring): k^s / q^(1-s),
    divided by its geometric mean over the last dim."""
    k, q = k_absmax.double().clamp_min(FLOOR), q_absmax.double().clamp_min(FLOOR)
    log_d = strength * k.log() - (1 - strength) * q.log()
    return (log_d - log_d.mean(-1, keepdim=True)).exp().float()
