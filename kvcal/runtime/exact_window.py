"""Each paged layer's newest tokens held exact, outside the pages (KIVI's residual at DiffKV's window): `ExactWindows`.

With `CompressionConfig.exact_window`, the `tiering.window` newest tokens of every compressed layer stay at 16 bits
(the store's `raw16`) in the coordinates the pages hold (rotated keys, projected values), with the significance each
has gathered. Every query reads them exactly, ahead of the new tokens: they are the first tokens of the backends'
exact block (`AttentionBackend.attend`). A token enters the store at the high tier when it leaves the window, with
its significance, and the token policies then place it as DiffKV places the token that leaves its window. Without
this, each new token is written to the high tier's pages at once, and a quantized high tier (K8V8) codes every
query's nearest predecessors, which attention weighs most.

Per layer (c <= window tokens: fewer after a short prompt or a crop; positions length - c .. length - 1):

    keys [B, H, c, r_k], values [B, H, c, r_v]   raw16
    score [B, H, c]                              float32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Tokens:
    """Tokens in the served bases, oldest first: keys [B, H, c, r_k], values [B, H, c, r_v], score [B, H, c]. A
    layer's window (raw16), or the tokens a decode step pushes out of it (float32: the i-th new token of a step of n
    pushes out token i - (n - c), none while the window fills)."""

    keys: torch.Tensor
    values: torch.Tensor
    score: torch.Tensor

    @property
    def count(self) -> int:
        return self.keys.shape[2]


class ExactWindows:
    """The windows of every paged layer of one batch (module docstring)."""

    def __init__(self, size: int, dtype: torch.dtype):
        self.size, self.dtype = size, dtype
        self.layers: dict[int, Tokens] = {}

    def hold(self, layer: int, keys: torch.Tensor, values: torch.Tensor, score: torch.Tensor) -> int:
        """A prompt's newest tokens become the layer's window: keys [B, H, n, r_k], values [B, H, n, r_v], score
        [B, H, n] (its significance from the prefill). Returns how many it holds, min(n, size): the prompt's tokens
        from n minus that go to the store."""
        c = min(self.size, keys.shape[2])
        self.layers[layer] = Tokens(keys[:, :, keys.shape[2] - c:].to(self.dtype),
                                    values[:, :, values.shape[2] - c:].to(self.dtype),
                                    score[..., score.shape[-1] - c:].float().clone())
        return c

    def block(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact block a decode step attends: the window, then the n new tokens (keys [B, H, n, r_k], values
        [B, H, n, r_v]) -> keys [B, H, c + n, r_k], values [B, H, c + n, r_v] float32."""
        w = self.layers[layer]
        return torch.cat([w.keys.float(), keys.float()], 2), torch.cat([w.values.float(), values.float()], 2)

    def exact_from(self, layer: int, n_pad: torch.Tensor, length: int) -> torch.Tensor | None:
        """Per sequence, the first exact token of the block that is not left padding (n_pad [B]; length: the cache
        length before the step): int64 [B], or None when none is padding. The tokens the step pushes out are the
        block's first ones, so it tells which of them are padding too."""
        first = length - self.layers[layer].count                       # the window's oldest position
        if int(n_pad.max()) <= first:
            return None
        return (n_pad.to(torch.int64) - first).clamp(min=0)

    def advance(self, layer: int, keys: torch.Tensor, values: torch.Tensor, score: torch.Tensor) -> Tokens:
        """After the step: block keys [B, H, c + n, r_k], values [B, H, c + n, r_v] and score [B, H, c + n] (the
        window's significance plus what this step added; the new tokens' own): the newest `size` stay, the others
        leave."""
        j = max(0, keys.shape[2] - self.size)
        self.layers[layer] = Tokens(keys[:, :, j:].to(self.dtype), values[:, :, j:].to(self.dtype),
                                    score[..., j:].clone())
        return Tokens(keys[:, :, :j], values[:, :, :j], score[..., :j])

    def score(self, layer: int, n: int) -> torch.Tensor:
        """The window's significance, then n zeros for the new tokens: float32 [B, H, c + n]."""
        s = self.layers[layer].score
        return torch.cat([s, s.new_zeros(*s.shape[:2], n)], -1)

    def crop(self, layer: int, removed: int) -> None:
        """The newest `removed` tokens of the layer go (the store drops those older than the window)."""
        w = self.layers.get(layer)
        if w is not None and removed:
            c = max(0, w.count - removed)
            self.layers[layer] = Tokens(w.keys[:, :, :c], w.values[:, :, :c], w.score[..., :c])

    def select(self, index: torch.Tensor) -> None:
        """Sequence i becomes old sequence index[i] (CompressedKV.select)."""
        for layer, w in self.layers.items():
            self.layers[layer] = Tokens(w.keys[index], w.values[index], w.score[index])

    def clear(self) -> None:
        self.layers.clear()

    def kv_bytes(self) -> int:
        """Bytes of the windows' keys and values, as held (16 bits per element)."""
        return sum(w.keys.numel() * w.keys.element_size() + w.values.numel() * w.values.element_size()
                   for w in self.layers.values())

    def score_bytes(self) -> int:
        """Bytes of the windows' significance (float32, at most `size` per sequence, layer and KV head)."""
        return sum(w.score.numel() * w.score.element_size() for w in self.layers.values())
