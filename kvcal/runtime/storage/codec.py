"""Each storage format's encode/decode pair: tensors to the bytes a page holds, and back (in the spirit of hqq's
`quantize(x) -> (codes, meta)`, `dequantize(codes, meta) -> x`).

    encode_tokens(x [n, r], bits, group)         -> codes uint8 [n, nbytes], meta uint8 [n, groups * pair] | None
    decode_tokens(codes [..., nbytes], meta, ...) -> x float32 [..., r]
    encode_channel_keys(k [n, T, r], bits)        -> codes uint8 [n, T * k_bytes], meta uint8 [n, r * pair]
    decode_channel_keys(codes, meta, ...)        -> k float32 [n, P * T, r]
    encode_static_keys(k [n, r], scale, zero)     -> codes uint8 [n, k_bytes]   (meta: the store's calibrated pair)
    decode_static_keys(codes, scale, zero, ...)  -> k float32 [..., r]

Every quantized pair takes `levels`: a side with calibrated levels (`TierFormat.k_levels` / `v_levels`) passes each
row's levels float32 [n, 2**bits] (its KV head's, `CompressedStore.level_params`); None is the uniform grid.

Per-token vectors (values, and keys of "token" formats) at 16 or 32 bits are stored raw: their meta is None. `meta`
is the (scale, zero) bytes of `quant.meta_to_bytes` (pair = 4 bytes, fp16 scale and zero; 2 for m8 formats). The store
only places these bytes in pages (`store.py`); `decode_pages` reads a page's segments back by its `PageLayout`.
"""

from __future__ import annotations

import torch

from kvcal.runtime.storage import quant
from kvcal.runtime.storage.layout import RAW_BITS, PageLayout

HELD = 2**31 - 1       # the position read from an untracked slot that holds a token: >= 0, but no cache index


def raw_dtype(bits: int, raw16: torch.dtype) -> torch.dtype:
    """The dtype of a raw (unquantized) tier: float32 at 32 bits, else the cache's 16-bit dtype."""
    return torch.float32 if bits == 32 else raw16


# ------------------------------------------------------------------------------------------------ per-token vectors
# assumes asymmetric min-max per token, `group` channels per (scale, zero) (None: the whole vector)

def encode_tokens(x: torch.Tensor, bits: int, group: int | None, meta_bits: int = 16,
                  raw16: torch.dtype = torch.float16,
                  levels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x float32 [n, r], levels [n, 2**bits] or None -> (codes uint8 [n, nbytes], meta uint8 [n, groups * pair];
    None for a raw tier)."""
    if bits in RAW_BITS:
        return x.to(raw_dtype(bits, raw16)).contiguous().view(torch.uint8), None
    codes, scale, zero = quant.quantize_per_token(x, bits, group, meta_bits, levels)
    return quant.pack(codes, bits), quant.meta_to_bytes(scale, zero).reshape(len(x), -1)


def decode_tokens(codes: torch.Tensor, meta: torch.Tensor | None, bits: int, group: int | None, r: int,
                  ngroups: int, meta_bits: int = 16, raw16: torch.dtype = torch.float16,
                  levels: torch.Tensor | None = None) -> torch.Tensor:
    """codes uint8 [..., nbytes], meta uint8 (the pairs of those rows, contiguous; None for a raw tier), levels
    broadcastable to codes.shape[:-1] + (2**bits,) or None -> float32 [..., r]."""
    if bits in RAW_BITS:
        return codes.view(raw_dtype(bits, raw16)).float()
    scale, zero = quant.meta_from_bytes(meta, meta_bits, bits, (*codes.shape[:-1], ngroups))
    return quant.dequantize_per_token(quant.unpack(codes, bits, r), scale, zero, group, levels=levels)


# ------------------------------------------------------------------------------------------------ per-channel keys
# assumes KIVI's per-channel min-max over one page of T tokens: a page's keys are encoded whole

def encode_channel_keys(k: torch.Tensor, bits: int, meta_bits: int = 16,
                        levels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k float32 [n, T, r], levels [n, 2**bits] or None -> (codes uint8 [n, T * k_bytes], meta uint8 [n, r * pair])."""
    lut = None if levels is None else levels[:, None]                                      # [n, 1, K]
    codes, scale, zero = quant.quantize_per_channel(k, bits, meta_bits=meta_bits, levels=lut)   # [n, T, r]
    return quant.pack(codes, bits).flatten(1), quant.meta_to_bytes(scale, zero).flatten(1)    # n = 0 too


def decode_channel_keys(codes: torch.Tensor, meta: torch.Tensor, bits: int, r: int,
                        meta_bits: int = 16, levels: torch.Tensor | None = None) -> torch.Tensor:
    """codes uint8 [n, P, T, k_bytes], meta uint8 [n, P, r * pair], levels [n, 2**bits] or None -> float32
    [n, P * T, r]."""
    n, P, T, _ = codes.shape
    scale, zero = quant.meta_from_bytes(meta, meta_bits, bits, (n, P, r))
    lut = None if levels is None else levels[:, None, None]                                # [n, 1, 1, K]
    return quant.dequantize_per_channel(quant.unpack(codes, bits, r), scale, zero,
                                        levels=lut).reshape(n, P * T, r)


# ------------------------------------------------------------------------------------------------ static keys
# assumes calibrated per-channel fp16 (scale, zero) per (layer, KV head), held by the store, not in the pages

def encode_static_keys(k: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                       levels: torch.Tensor | None = None) -> torch.Tensor:
    """k float32 [n, r], fp16 scale/zero [n, r], levels [n, 2**bits] or None -> codes uint8 [n, k_bytes]."""
    return quant.pack(quant.quantize_static(k, scale, zero, bits, levels), bits)


def decode_static_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                       r: int, levels: torch.Tensor | None = None) -> torch.Tensor:
    """codes uint8 [..., k_bytes], fp16 scale/zero broadcastable to [..., r], levels broadcastable to
    codes.shape[:-1] + (2**bits,) or None -> float32 [..., r]."""
    return quant.dequantize_static(quant.unpack(codes, bits, r), scale, zero, levels=levels)


# ------------------------------------------------------------------------------------------------ whole pages

def decode_pages(data: torch.Tensor, lay: PageLayout, raw16: torch.dtype = torch.float16, key_scales=None,
                 levels=(None, None)):
    """data uint8 [n, P, page_bytes] -> keys [n, P*T, r_k], values [n, P*T, r_v] float32, score, pos [n, P*T].
    key_scales: static keys' fp16 (scale, zero) [n, r_k] of each row's head (`CompressedStore.static_key_params`).
    levels: (key levels, value levels), each [n, 2**bits] for a calibrated side or None (`store.level_params`).
    An untracked tier reads score 0 and position `HELD`."""
    n, P, _ = data.shape
    T, fmt, pair = lay.tokens, lay.fmt, lay.fmt.meta_pair_bytes
    k_lut, v_lut = (None if t is None else t[:, None] for t in levels)             # [n, 1, K] over the tokens

    def seg(off: int, nbytes: int) -> torch.Tensor:
        return data[..., off:off + nbytes].contiguous()

    def vectors(off, meta_off, nbytes, ngroups, bits, group, r, lut) -> torch.Tensor:
        codes = seg(off, T * nbytes).view(n, P * T, nbytes)
        meta = None if bits in RAW_BITS else seg(meta_off, T * ngroups * pair)
        return decode_tokens(codes, meta, bits, group, r, ngroups, fmt.meta_bits, raw16, lut)

    if fmt.k_mode == "channel":
        keys = decode_channel_keys(seg(lay.k_off, T * lay.k_bytes).view(n, P, T, lay.k_bytes),
                                   seg(lay.k_meta_off, lay.r_k * pair), fmt.k_bits, lay.r_k, fmt.meta_bits,
                                   levels[0])
    elif fmt.k_mode == "static":
        keys = decode_static_keys(seg(lay.k_off, T * lay.k_bytes).view(n, P * T, lay.k_bytes),
                                  key_scales[0][:, None], key_scales[1][:, None], fmt.k_bits, lay.r_k, k_lut)
    else:
        keys = vectors(lay.k_off, lay.k_meta_off, lay.k_bytes, lay.k_groups, fmt.k_bits, fmt.k_group, lay.r_k,
                       k_lut)
    values = vectors(lay.v_off, lay.v_meta_off, lay.v_bytes, lay.v_groups, fmt.v_bits, fmt.v_group, lay.r_v, v_lut)
    if not lay.tracked:
        return keys, values, torch.zeros(n, P * T, device=data.device), \
            torch.full((n, P * T), HELD, dtype=torch.int64, device=data.device)
    score = seg(lay.score_off, 4 * T).view(torch.float32).reshape(n, P * T)
    pos = seg(lay.pos_off, 4 * T).view(torch.int32).reshape(n, P * T).long()
    return keys, values, score, pos
