"""Attention over a compressed store: the backend interface (`AttentionBackend`) and the prompt softmax every backend
shares. The torch reference is `reference.py`, the registry and selector `registry.py`.

Contract (shapes; g = query heads per KV head, n = new tokens, r = stored key rank, r_v = stored value rank):

    prefill(query [B, H, g, n, d], keys [B, H, n, d], values [B, H, n, d], mask [B, n, n] bool causal, scale)
        -> out [B, H, g, n, d], score [B, H, n]
    attend(store, layer, query [B, H, g, n, r], exact_keys [B, H, m, r], exact_values [B, H, m, r_v], scale,
           track_scores=True, exact_from=None)
        -> out [B, H, g, n, r_v], exact_score [B, H, m]

`prefill` runs on uncompressed K/V (compression happens when the cache is written, as in DiffKV). `score` is each
key's significance: the sum over queries of the attention probability it received, max over the g query heads. It
computes the probabilities in row blocks (`prompt_rows`, `prompt_probs`), each only as wide as its rows can see: the
mask is causal, so the keys after a block's last row get nothing.
`attend` runs one softmax over every token the store retains (both tiers) plus the m tokens of the exact block: the
tokens held exact outside the pages (m - n of them, the exact window: kvcal.runtime.exact_window), then the n new
tokens. Exact token j is visible to new token i when exact_from[b] <= j <= m - n + i (exact_from int64 [B], the left
padding of each sequence; None: 0). It adds the probabilities the stored tokens received to their scores in the
store, and returns the exact tokens' own (summed over the new tokens, max over g; with `track_scores=False`, when no
token policy reads them, it does neither). The
softmax scale is the model's (1/sqrt(d) of the original head dim), because the rotated, truncated product
approximates the original logits.

    sliding_decode(window, query [B, H, g, d], tail_keys [B, H, r, d], tail_values [B, H, r, d], scale,
                   visible [B, n + r] bool or None) -> out [B, H, g, d]

`sliding_decode` is a sliding-window layer's decode step over its coded window (kvcal.runtime.hf.sliding), in the
window's stored bases; the default is torch's.

A backend with `writes_cache = True` also writes the cache (the store does the bookkeeping, the backend the bytes):

    write(store, layer, side, b [n], h [n], slot [n], keys [n, >= r_k], values [n, >= r_v], pos [n], score [n])
    write_pages(store, layer, b [n], h [n], keys [n, T, >= r_k], values [n, T, >= r_v], pos [n, T], score [n, T])

Backends declare what they support, up front: `supports(device)` and `supports_formats(formats, head_dim)` return
the reasons they cannot serve (empty when they can). `select_backend("auto")` takes the first that supports the
request; naming a backend that cannot run raises a one-line ValueError with its reasons.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

# prefill probability block [B, H, g, rows, n]: 16 MB in float32, whatever the context. The passes over a block
# (subtract, max, mask, exp, sum) are memory-bound, so a smaller block is faster until Python per block dominates.
_BLOCK_ELEMENTS = 1 << 22


def prefill_rows(B: int, H: int, g: int, n: int) -> int:
    """Query rows per prefill block, so that one [B, H, g, rows, n] block stays near `_BLOCK_ELEMENTS` (a fixed row
    count would make the block, and its softmax copies, grow with the context: GBs at 16k)."""
    return max(16, min(n, _BLOCK_ELEMENTS // max(B * H * g * n, 1)))


def prompt_rows(query: torch.Tensor) -> list[slice]:
    """The query-row blocks of a prefill, in order: query [B, H, g, n, d]."""
    B, H, g, n, _ = query.shape
    step = prefill_rows(B, H, g, n)
    return [slice(start, min(start + step, n)) for start in range(0, n, step)]


def prompt_probs(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float,
                 rows: slice | torch.Tensor) -> torch.Tensor:
    """Prompt attention probabilities of the query rows `rows` (a slice, or increasing int64 indices [c]): query
    [B, H, g, n, d] float32, keys [B, H, n, d] float32, mask bool [B, n, n] causal -> float32 [B, H, g, c, w] over the
    first w = last row + 1 keys, the only ones these rows can see (a row with nothing allowed is all zero). The one
    blocked softmax of a prompt: `prefill` computes it, a policy that must see rows again recomputes them here."""
    w = rows.stop if isinstance(rows, slice) else int(rows[-1]) + 1
    return _probs(query[:, :, :, rows], keys[:, :, :w], mask[:, None, None, rows, :w], scale)


class AttentionBackend(ABC):
    """A namespace of static methods, never instantiated (vLLM style)."""

    writes_cache: ClassVar[bool] = False     # True: implements `write` / `write_pages` (module docstring)

    @classmethod
    @abstractmethod
    def name(cls) -> str: ...

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device) -> list[str]:
        """Reasons this backend cannot run on `device`; empty when it can."""

    @classmethod
    def supports_formats(cls, formats: tuple, head_dim: int) -> list[str]:
        """Reasons this backend cannot serve tiers in `formats` (TierFormat) at ranks up to `head_dim`; empty when
        it can. The default serves every format the store can hold."""
        return []

    @staticmethod
    @abstractmethod
    def prefill(query, keys, values, mask, scale): ...

    @staticmethod
    @abstractmethod
    def attend(store, layer, query, exact_keys, exact_values, scale, track_scores=True, exact_from=None): ...

    @staticmethod
    def sliding_decode(window, query, tail_keys, tail_values, scale, visible=None):
        """A sliding layer's decode step (kvcal.runtime.hf.sliding.SlidingWindow): query float32 [B, H, g, d] in the
        window's key basis; tail_keys, tail_values float32 [B, H, r, d], its exact tokens in the stored bases;
        visible bool [B, n + r] or None: the window's tokens each sequence sees (not its left padding) -> out
        float32 [B, H, g, d] in the value basis: one softmax over the window's coded tokens, then the tail. The
        default dequantizes the codes with torch."""
        keys = torch.cat([window.coded_keys(), tail_keys], 2)
        values = torch.cat([window.coded_values(), tail_values], 2)
        logits = torch.einsum("bhgd,bhnd->bhgn", query, keys) * scale
        if visible is not None:
            logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
        return torch.einsum("bhgn,bhnd->bhgd", torch.softmax(logits, -1), values)

    @staticmethod
    def low_pages_due(store, layer: int, n_pad: torch.Tensor, length: int, tiering) -> bool:
        """Whether some entry of `layer` may hold a whole per-channel low page of pending high tokens (the check of
        `DiffKVTiers._seal_pending`, n_pad [B], length: the cache length, tiering: its `TieringConfig`). False only
        when none does, so the policy skips its check; the default cannot tell without that check."""
        return True


def exact_visible(B: int, n: int, m: int, exact_from: torch.Tensor | None, device) -> torch.Tensor:
    """Which exact tokens each new token sees (the `attend` contract): bool [B, n, m]."""
    j = torch.arange(m, device=device)
    seen = j[None, :] <= (m - n + torch.arange(n, device=device))[:, None]                   # [n, m]
    if exact_from is None:
        return seen[None].expand(B, n, m)
    return seen[None] & (j[None, None, :] >= exact_from.to(device)[:, None, None])


def _probs(query, keys, allowed, scale):
    """query [B, H, g, n, r]; keys [B, H, S, r]; allowed bool broadcastable to [B, H, g, n, S] -> probabilities
    [B, H, g, n, S] (float32 softmax, like eager attention)."""
    logits = torch.einsum("bhgnr,bhsr->bhgns", query.float(), keys.float()) * scale
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)         # a query with nothing allowed (padding rows) gets zeros


def _softmax_attend(query, keys, values, allowed, scale):
    """`_probs`, then out [B, H, g, n, r_v] (values [B, H, S, r_v]) and the probabilities max over g [B, H, n, S]."""
    probs = _probs(query, keys, allowed, scale)
    out = torch.einsum("bhgns,bhsr->bhgnr", probs, values.float())
    return out, probs.amax(dim=2)
