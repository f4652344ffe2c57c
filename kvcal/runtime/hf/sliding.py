"""Sliding-window layers (Gemma3's local layers) held quantized: `QuantizedSlidingLayer`.

A sliding layer sees at most `sliding_window` tokens, so its cache does not grow with the context, but on a model
where most layers slide (Gemma3: 5 of 6) those windows are most of the KV bytes at the contexts a CPU serves. The
layer keeps transformers' `DynamicSlidingWindowLayer` semantics (the last `sliding_window - 1` tokens, the same mask
sizes, crop and batch re-indexing) and changes only what a kept token costs: each one is stored per token in one
tier format of the settings (`CompressionConfig.sliding`, e.g. K8V4), in the bundle's rotated basis with kvcal's
mixing (as the paged tiers store keys: `kvcal.runtime.storage.bases`), at full rank.

Storage, per (sequence, KV head, kept token): one uint8 row per tensor,

    keys   uint8 [B, H, n, k_bytes + pair * k_groups]   packed codes of K·R, then (scale, zero) per channel group
    values uint8 [B, H, n, v_bytes + pair * v_groups]   the same for V·B

(pair: 4 bytes, two fp16; 2 bytes for formats ending in m8, `quant.meta8_encode`). A side with calibrated levels
(an `n` after its bits, `K4cnV4ng32m8`) indexes the bundle's levels of its (layer, KV head), as the paged tiers' do
(`levels` [H, 2**bits] per side; the rows hold the same bytes either way).

so the parent's slicing along tokens and indexing along sequences act on codes and scales together. `update`
quantizes only the new tokens and returns the dequantized window with the new tokens as they came (each token
attends to itself unquantized, as in the paged runtime), rotated back to the model basis (R, B orthogonal).

Per-channel keys (`K4cV4g32`, KIVI's layout in a window): a token waits, unquantized, until `block` of them have
come (`CompressionConfig.page_tokens`), and the block is then coded with one (scale, zero) per channel over its
tokens, its values per token at the same time. Whole blocks are kept while any of their tokens is in the window:

    keys        uint8 [B, H, n_b * block, k_bytes]   codes, n_b blocks, oldest first
    key_scales  uint8 [B, H, n_b, pair * d]          (scale, zero) per channel of each block
    values      uint8 [B, H, n, v_bytes + pair * v_groups]   n <= n_b * block: the coded tokens in the window

With `recent` > 0 (`CompressionConfig.sliding_recent`, KIVI's full-precision residual), the newest `recent` tokens
stay as they came, in the model's dtype and counted at 16 bits, and a token is quantized once it leaves them (with
per-channel keys, once a block of tokens has left them):

    recent_keys, recent_values   [B, H, r, d]   r < recent + block, the newest tokens, oldest first

A local layer's queries put most of their weight on the last few tokens, so these are where quantization error
costs most (docs/calibration.md).

Reads. In a `KvcalCache` (`serve` given), a decode step reads the codes where they lie: `update` keeps the window
as a `SlidingWindow` and returns only the new token, kvcal's attention function calls `attend`, which rotates the
query into the key basis (q · (y Mᵀ) = (q M) · y, M = the query rotation) and runs the backend's `sliding_decode`
(the CPU kernel reads the codes in place; the torch reference dequantizes them), and rotates the output back from
the value basis; a sequence's left padding still in the window is hidden from it. A prefill, or a layer used on its
own, gets the whole window back from `update`, dequantized into the model basis, for transformers' attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvcal.runtime.cache import per_head_matmul
from kvcal.runtime.hf.pending import claim_pending, hand_over
from kvcal.runtime.storage import codec, quant
from kvcal.runtime.storage.layout import TierFormat, check_sliding_format


@dataclass(frozen=True)
class SlidingWindow:
    """What one step's queries of a sliding layer read: the layer's coded tokens before the step, then its exact ones
    (the recent tokens, then the step's own), which the step's new tokens attend to as they came.

        keys         uint8 [B, H, m, k_row]            codes (per-token keys: then their pairs), whole blocks
        key_scales   uint8 [B, H, m / block, pair * d]  per-channel keys' (scale, zero) per block; [B, H, 0, 0] else
        values       uint8 [B, H, n, v_row]            the window's n coded tokens (the last n key rows), then pairs
        tail_keys, tail_values  [B, H, r, d]            the exact tokens, model basis and dtype
        levels       (key levels, value levels)  float32 [H, 2**bits] of a calibrated side, else None
    """

    fmt: TierFormat
    block: int                 # tokens per per-channel key block (1 for per-token keys)
    keys: torch.Tensor
    key_scales: torch.Tensor
    values: torch.Tensor
    tail_keys: torch.Tensor
    tail_values: torch.Tensor
    levels: tuple = (None, None)

    @property
    def coded(self) -> int:
        return self.values.shape[2]

    def coded_keys(self) -> torch.Tensor:
        """The window's coded keys float32 [B, H, n, d] in the stored (rotated) basis."""
        fmt, d = self.fmt, self.tail_keys.shape[-1]
        B, H, m, row = self.keys.shape
        k_levels = self.levels[0]
        if fmt.k_mode != "channel":
            return _decode_rows(self.keys, fmt, fmt.k_bits, fmt.k_group, d, k_levels)[:, :, m - self.coded:]
        blocks = m // self.block
        lut = None if k_levels is None else k_levels[None].expand(B, H, -1).reshape(B * H, -1)     # [B * H, K]
        y = codec.decode_channel_keys(self.keys.reshape(B * H, blocks, self.block, row),
                                      self.key_scales.reshape(B * H, blocks, self.key_scales.shape[-1]), fmt.k_bits,
                                      d, fmt.meta_bits, lut)
        return y.view(B, H, m, d)[:, :, m - self.coded:]

    def coded_values(self) -> torch.Tensor:
        """The window's coded values float32 [B, H, n, d] in the stored basis."""
        return _decode_rows(self.values, self.fmt, self.fmt.v_bits, self.fmt.v_group, self.tail_values.shape[-1],
                            self.levels[1])


def _decode_rows(rows: torch.Tensor, fmt: TierFormat, bits: int, group: int | None, d: int,
                 levels: torch.Tensor | None) -> torch.Tensor:
    """Per-token rows uint8 [B, H, n, row] (codes, then a pair per `group` channels), levels float32 [H, 2**bits]
    or None -> float32 [B, H, n, d]."""
    nbytes = quant.packed_size(d, bits)
    return codec.decode_tokens(rows[..., :nbytes].contiguous(), rows[..., nbytes:].contiguous(), bits, group, d,
                               d // group if group else 1, fmt.meta_bits, levels=_per_row(levels))


def _per_row(levels: torch.Tensor | None) -> torch.Tensor | None:
    """A KV head's levels [H, K] -> [H, 1, K], broadcast over the rows of [B, H, n] (None: uniform)."""
    return None if levels is None else levels[:, None]


class QuantizedSlidingLayer(DynamicSlidingWindowLayer):
    """One sliding-window layer stored in `fmt` (module docstring). rotation, basis: float32 [H, d, d]; basis
    orthogonal, rotation orthogonal unless smoothed. Keys are stored as K @ rotation and read back through
    `query_rotation` transposed, its inverse: with channel smoothing the key rotation is R D⁻¹ M and the query
    rotation R D M (kvcal.runtime.storage.bases), and (R D⁻¹ M)⁻¹ = (R D M)ᵀ. None: the rotation itself.
    block: tokens per per-channel key block (only read when `fmt` has per-channel keys). levels: (key levels, value
    levels) float32 [H, 2**bits] for each side of `fmt` with calibrated levels, else None (`levels.served_levels`)."""

    def __init__(self, sliding_window: int, fmt: TierFormat, rotation: torch.Tensor, basis: torch.Tensor,
                 query_rotation: torch.Tensor | None = None, recent: int = 0, block: int = 32, serve=None,
                 levels: tuple = (None, None)):
        check_sliding_format(fmt)
        for side, kind, lv in (("key", fmt.k_levels, levels[0]), ("value", fmt.v_levels, levels[1])):
            if (kind == "calibrated") != (lv is not None):
                raise ValueError(f"sliding format `{fmt.name}`: its {side}s are {kind}, so pass their levels "
                                 "exactly when they are calibrated")
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"`block={block!r}` must be a positive number of tokens per per-channel key block")
        super().__init__(sliding_window)
        self.fmt, self.rotation, self.basis, self.recent = fmt, rotation, basis, recent
        self.levels = tuple(None if lv is None else lv.float().contiguous() for lv in levels)
        self.key_inverse_t = rotation if query_rotation is None else query_rotation
        self.channel = fmt.k_mode == "channel"
        self.block = block if self.channel else 1            # tokens coded together (a per-token format: each alone)
        d = rotation.shape[-1]
        self.head_dim = d
        self.k_bytes, self.v_bytes = quant.packed_size(d, fmt.k_bits), quant.packed_size(d, fmt.v_bits)
        self.serve, self.backend = serve, None        # ServeOptions; the backend is resolved on the first K/V's device
        self.layer_idx: int | None = None             # set by the KvcalCache that holds the layer
        self.window: SlidingWindow | None = None      # the window a decode step's query reads (handed to `attend`)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype
        self.rotation = self.rotation.to(self.device)
        self.key_inverse_t = self.key_inverse_t.to(self.device)
        self.basis = self.basis.to(self.device)
        self.levels = tuple(None if lv is None else lv.to(self.device) for lv in self.levels)
        B, H = key_states.shape[:2]
        key_row = self.k_bytes if self.channel else self._row(self.k_bytes, self.fmt.k_group)
        scales_row = self.fmt.meta_pair_bytes * self.head_dim if self.channel else 0
        self.keys = torch.empty(B, H, 0, key_row, dtype=torch.uint8, device=self.device)
        self.key_scales = torch.empty(B, H, 0, scales_row, dtype=torch.uint8, device=self.device)
        self.values = torch.empty(B, H, 0, self._row(self.v_bytes, self.fmt.v_group), dtype=torch.uint8,
                                  device=self.device)
        self.recent_keys, self.recent_values = key_states[:, :, :0], value_states[:, :, :0]
        if self.serve is not None:
            self.backend = self.serve.resolve(self.device, (), self.head_dim)

    def activate_past_recording(self):
        raise NotImplementedError("a quantized sliding layer keeps no tokens beyond its window, so it cannot be "
                                  "rolled back (assisted decoding): serve with `sliding` unset")

    def _row(self, nbytes: int, group: int | None) -> int:
        return nbytes + self.fmt.meta_pair_bytes * self._groups(group)

    def _groups(self, group: int | None) -> int:
        return self.head_dim // group if group else 1

    def _encode(self, x: torch.Tensor, basis: torch.Tensor, bits: int, group: int | None,
                levels: torch.Tensor | None) -> torch.Tensor:
        """x [B, H, n, d] (model basis), levels [H, 2**bits] or None -> packed rows uint8 [B, H, n, row]."""
        y = torch.einsum("bhnd,hde->bhne", x.float(), basis)
        codes, scale, zero = quant.quantize_per_token(y, bits, group, self.fmt.meta_bits, _per_row(levels))
        return torch.cat([quant.pack(codes, bits), quant.meta_to_bytes(scale, zero)], -1)

    def _encode_keys(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k [B, H, n, d] (model basis; n a multiple of `block` with per-channel keys) -> (codes or rows uint8
        [B, H, n, ...], per-channel block scales uint8 [B, H, n / block, pair * d], empty for per-token keys)."""
        fmt = self.fmt
        if not self.channel:
            return self._encode(k, self.rotation, fmt.k_bits, fmt.k_group, self.levels[0]), self.key_scales[:, :, :0]
        B, H, n, d = k.shape
        y = torch.einsum("bhnd,hde->bhne", k.float(), self.rotation).reshape(-1, self.block, d)   # a page per block
        lut = self.levels[0]
        if lut is not None:                                                      # [B * H * blocks, K], block order
            lut = lut[None, :, None].expand(B, H, n // self.block, -1).reshape(-1, lut.shape[-1])
        codes, scales = codec.encode_channel_keys(y, fmt.k_bits, fmt.meta_bits, lut)
        return codes.view(B, H, n, self.k_bytes), scales.view(B, H, n // self.block, self.key_scales.shape[-1])

    def update(self, key_states, value_states, *args, **kwargs):
        claim_pending()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        fmt = self.fmt
        window = SlidingWindow(fmt, self.block, self.keys, self.key_scales, self.values,
                               torch.cat([self.recent_keys, key_states], -2),
                               torch.cat([self.recent_values, value_states], -2), self.levels)
        keep = self.sliding_window - 1
        unquantized_k, unquantized_v = window.tail_keys[:, :, -keep:], window.tail_values[:, :, -keep:]
        leaving = max(unquantized_k.shape[-2] - self.recent, 0)       # tokens that leave the recent ones now,
        leaving -= leaving % self.block                               # in whole blocks
        if leaving:                                   # most decode steps with per-channel keys code nothing
            new_k, new_scales = self._encode_keys(unquantized_k[:, :, :leaving])
            new_v = self._encode(unquantized_v[:, :, :leaving], self.basis, fmt.v_bits, fmt.v_group, self.levels[1])
            self.keys, self.key_scales = torch.cat([self.keys, new_k], -2), torch.cat([self.key_scales, new_scales], -2)
            self.values = torch.cat([self.values, new_v], -2)
        self.recent_keys, self.recent_values = unquantized_k[:, :, leaving:], unquantized_v[:, :, leaving:]
        self.cumulative_length += key_states.shape[-2]
        rows = keep - self.recent_keys.shape[-2]          # quantized tokens the window still holds
        blocks = -(-rows // self.block)                   # the blocks that hold them
        self.values, self.keys = _last(self.values, rows), _last(self.keys, blocks * self.block)
        self.key_scales = _last(self.key_scales, blocks if self.channel else 0)
        if self.backend is not None and key_states.shape[-2] == 1:
            self.window = window                          # kvcal's attention reads the codes (`attend`)
            hand_over(self, key_states)
            return key_states, value_states
        return self.model_basis(window)

    def model_basis(self, window: SlidingWindow) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's keys and values [B, H, n + r, d] in the model basis and dtype: the coded tokens dequantized
        and rotated back, then the exact ones."""
        keys = torch.einsum("bhne,hde->bhnd", window.coded_keys(), self.key_inverse_t).to(self.dtype)
        values = torch.einsum("bhne,hde->bhnd", window.coded_values(), self.basis).to(self.dtype)
        return torch.cat([keys, window.tail_keys], -2), torch.cat([values, window.tail_values], -2)

    def attend(self, query: torch.Tensor, scale: float, visible: torch.Tensor | None = None) -> torch.Tensor:
        """The decode step's attention over the window `update` handed over: query [B, Hq, 1, d] (model basis;
        Hq = G * H, query head i reads KV head i // G); visible bool [B, n + r] or None, the window's tokens each
        sequence sees (left padding hidden) -> out [B, Hq, 1, d] in the query's dtype. The query is rotated into the
        key basis and the output back from the value basis, so the window is read as stored."""
        window, self.window = self.window, None
        B, Hq, n, d = query.shape
        H = self.rotation.shape[0]
        q = per_head_matmul(query.float().reshape(B, H, Hq // H, d), self.key_inverse_t)
        if visible is not None:
            visible = visible[:, visible.shape[-1] - window.coded - window.tail_keys.shape[2]:]   # the window's own
        tail_k = per_head_matmul(window.tail_keys.float(), self.rotation)
        tail_v = per_head_matmul(window.tail_values.float(), self.basis)
        out = self.backend.sliding_decode(window, q, tail_k, tail_v, scale, visible)   # [B, H, G, d], value basis
        return per_head_matmul(out, self.basis.transpose(1, 2)).reshape(B, Hq, n, d).to(query.dtype)

    # the block scales and the recent tokens follow the rows through generate's edits of the batch
    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.is_initialized:
            self.key_scales = self.key_scales[indices]
            self.recent_keys, self.recent_values = self.recent_keys[indices], self.recent_values[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.is_initialized:
            self.key_scales = self.key_scales.repeat_interleave(repeats, dim=0)
            self.recent_keys = self.recent_keys.repeat_interleave(repeats, dim=0)
            self.recent_values = self.recent_values.repeat_interleave(repeats, dim=0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest `-tokens_to_remove` tokens (before the window fills; transformers' rules), the recent
        ones first. Per-channel keys are coded a block at a time, so a crop may only remove unquantized tokens."""
        if (self.recent == 0 and not self.channel) or tokens_to_remove >= 0 or not self.is_initialized \
                or self.get_seq_length() >= self.sliding_window:
            super().crop(tokens_to_remove)
            return
        n = min(-tokens_to_remove, self.get_seq_length())
        from_recent = min(n, self.recent_keys.shape[-2])
        if self.channel and n > from_recent:
            raise RuntimeError(f"cannot remove {n} tokens from a sliding layer with per-channel keys ({self.fmt.name}):"
                               f" only its {from_recent} unquantized ones can go; serve a per-token sliding format "
                               "(e.g. K8V8kg32m8) to crop further")
        r = self.recent_keys.shape[-2] - from_recent
        self.recent_keys, self.recent_values = self.recent_keys[:, :, :r], self.recent_values[:, :, :r]
        rows = self.keys.shape[-2] - (n - from_recent)
        self.keys, self.values = self.keys[:, :, :rows], self.values[:, :, :rows]
        self.cumulative_length -= n

    def held_bytes(self) -> int:
        """Bytes of the kept tokens: codes and (scale, zero), block scales of per-channel keys (whole blocks, a
        partly-left one too), and the recent tokens at 16 bits; nothing else."""
        if not self.is_initialized:
            return 0
        coded = self.keys.numel() + self.key_scales.numel() + self.values.numel()
        return coded + 2 * (self.recent_keys.numel() + self.recent_values.numel())

    def level_bytes(self) -> int:
        """Bytes of the calibrated levels it holds (a bundle constant, counted apart from the window's tokens)."""
        return sum(lv.numel() * lv.element_size() for lv in self.levels if lv is not None)

    def tokens_held(self) -> int:
        """B x H x tokens in the window (for the fp16 reference)."""
        if not self.is_initialized:
            return 0
        return self.values.shape[0] * self.values.shape[1] * (self.values.shape[2] + self.recent_values.shape[2])


def _last(x: torch.Tensor, n: int) -> torch.Tensor:
    """The last n tokens of x [B, H, tokens, ...] (all of them if fewer, none if n = 0)."""
    return x[:, :, max(x.shape[2] - n, 0):]
