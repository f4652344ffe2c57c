"""RoPE from the model's own rotary embedding, for baselines that store keys before RoPE (Palu, KVQuant).

transformers hands a cache post-RoPE keys k' = k·cos + rotate_half(k)·sin at each token's position. Since
rotate_half(rotate_half(k)) = -k and cos / sin repeat over the two halves, k'·cos - rotate_half(k')·sin = k·(cos² +
sin²): dividing by cos² + sin² (1, or the rope scaling's attention factor squared) recovers k exactly, up to float
rounding. Positions are 0 .. n-1 per sequence (no left padding), as every bench prompt is.
"""

from __future__ import annotations

import inspect

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """k [..., n, d] pre-RoPE, cos / sin [n, d] -> post-RoPE keys (transformers' `apply_rotary_pos_emb`)."""
    return k * cos + rotate_half(k) * sin


def undo_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """k [..., n, d] post-RoPE, cos / sin [n, d] of the same positions -> pre-RoPE keys (module docstring)."""
    return (k * cos - rotate_half(k) * sin) / (cos * cos + sin * sin)


class RopeTable:
    """cos, sin float32 [n, d] of positions 0 .. n-1 from `rotary` (a model's `rotary_emb`), grown by doubling.
    `layer_type`: passed to rotary embeddings that keep one table per layer type (Gemma3: "full_attention")."""

    def __init__(self, rotary, layer_type: str = "full_attention"):
        self.rotary = rotary
        takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self.kwargs = {"layer_type": layer_type} if takes_type else {}
        self._cos = self._sin = None

    def __call__(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < n:
            size = max(n, 2 * (self._cos.shape[0] if self._cos is not None else 0), 64)
            pos = torch.arange(size, device=device)[None]
            cos, sin = self.rotary(torch.zeros(1, dtype=torch.float32, device=device), pos, **self.kwargs)
            self._cos, self._sin = cos[0].float(), sin[0].float()
        return self._cos[:n], self._sin[:n]
