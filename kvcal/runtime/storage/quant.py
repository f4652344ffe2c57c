"""Asymmetric min-max quantization of KV-cache tensors, plus bit packing.

Three layouts, the first two following KIVI:

* per-token (values): each token's vector ``x: [..., n]`` is split into groups of ``group_size`` consecutive channels;
  each group gets one ``scale`` and ``zero`` -> ``codes: [..., n]``, ``scale, zero: [..., n // group_size]``.
* per-channel (keys): a block of ``T`` tokens ``x: [..., T, n]`` gets one ``scale`` / ``zero`` per channel, computed
  over the tokens -> ``codes: [..., T, n]``, ``scale, zero: [..., n]``. This isolates outlier channels, which dominate
  the key cache, so they do not blow up the step size of every other channel.
* static per-channel (keys, KVQuant-style): ``scale, zero: [..., n]`` come from a clip range calibrated offline
  (:func:`static_scale_zero`), so each token is quantized alone (:func:`quantize_static`) and values outside the
  range saturate.

Quantization is ``codes = clamp(round((x - zero) / scale), 0, 2**bits - 1)`` with
``scale = (max - min) / (2**bits - 1)`` and ``zero = min``. Scale and zero are stored as float16 and rounded to float16
*before* the codes are computed, so ``codes * scale + zero`` reproduces exactly what the quantizer aimed at. All
arithmetic is float32. Where ``max == min`` (scale 0) the codes are 0 and dequantization returns ``zero``.
The round-trip error is at most ``scale / 2`` plus the fp16 rounding of zero (relative 2**-11 of ``|min|``), which
dominates only for data far from 0 relative to its spread (e.g. values in [1000, 1001]).

8-bit metadata (tier formats ending in ``m8``): a (scale, zero) pair in two bytes instead of four. The scale is
``LOG_SCALES[c]`` for a byte c, a log grid of 16 steps per octave from 2**-10 up to 61.3 whose mantissas are fp16
numbers; the zero is a signed byte z in units of 1/32 of the code range, ``zero = z * scale * 2**bits / 32``, so it
reaches 4 code ranges either side of 0 at every width. :func:`meta8_encode` picks the smallest scale on the grid
whose grid covers [min, max] from such a zero: about 1/32 of a range plus one grid step (4.4 %) coarser than min-max
at worst. Every product and sum in decoding is exact in float32, so every backend decodes the same floats. Data
further from 0 than 4 ranges gets a coarser scale; beyond what the largest scale covers it saturates.

Calibrated levels (tier formats with an ``n`` after a side's bits): ``levels: [..., 2**bits]`` float32, sorted, in
``[0, 2**bits - 1]`` with the endpoints exactly 0 and ``2**bits - 1`` (so min-max normalisation keeps them exact),
constants of the bundle per (layer, KV head, side, bits). A code then means ``zero + scale * levels[code]``, and
encoding picks the level nearest to ``u = (x - zero) / scale`` (ties to the lower one, as
``kvcal.profile.codebooks``). Every function below that takes ``levels=None`` keeps the uniform grid (round half to
even); given levels, they broadcast (numpy rules) against the code tensor's leading dims plus ``(2**bits,)``, e.g.
``[H, 1, K]`` per KV head for ``x: [H, S, n]``.

Codes are uint8 with one code per byte; ``pack`` / ``unpack`` squeeze them to ``bits`` bits each into one
little-endian bit stream: code i holds bits ``[i*bits, (i+1)*bits)``, bit j of the stream being bit ``j % 8`` of byte
``j // 8``. At 2, 4 and 8 bits no code straddles a byte; at 3 bits eight codes fill three bytes, and codes 2 and 5 of
each eight straddle one.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (2, 3, 4, 8)
# 1-bit is accepted too (handy for ablations) but is not part of the advertised set.
_VALID_BITS = (1, *SUPPORTED_BITS)
_FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504


def _check_bits(bits: int) -> int:
    if bits not in _VALID_BITS:
        raise ValueError(f"bits must be one of {_VALID_BITS}, got {bits!r}")
    return bits


def _check_uint8(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.uint8:
        raise ValueError(f"{name} must have dtype torch.uint8, got {t.dtype}")


def packed_size(n: int, bits: int) -> int:
    """Bytes needed to pack ``n`` codes of ``bits`` bits: ``ceil(n * bits / 8)``."""
    _check_bits(bits)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return (n * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes ``uint8 [..., n]`` (values < 2**bits) into ``uint8 [..., packed_size(n, bits)]``: code i in bits
    ``[i*bits, (i+1)*bits)`` of the little-endian bit stream (module docstring); a trailing partial byte is
    zero-padded."""
    _check_bits(bits)
    _check_uint8(codes, "codes")
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes must be < 2**bits = {1 << bits} for bits={bits}, got max {int(codes.max())}")
    *lead, n = codes.shape
    nbytes = packed_size(n, bits)
    if 8 % bits:                                     # codes straddle bytes: through the stream's single bits
        stream = (codes.unsqueeze(-1) >> torch.arange(bits, dtype=torch.uint8, device=codes.device)) & 1
        stream = torch.nn.functional.pad(stream.reshape(*lead, n * bits), (0, nbytes * 8 - n * bits))
        weights = torch.arange(8, dtype=torch.int32, device=codes.device)
        return (stream.reshape(*lead, nbytes, 8).to(torch.int32) << weights).sum(dim=-1).to(torch.uint8)
    per = 8 // bits
    if nbytes * per != n:
        codes = torch.nn.functional.pad(codes, (0, nbytes * per - n))
    groups = codes.reshape(*lead, nbytes, per).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    # Fields are disjoint, so summing the shifted codes is the same as OR-ing them.
    return (groups << shifts).sum(dim=-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``uint8 [..., packed_size(n, bits)]`` -> ``uint8 [..., n]``."""
    _check_bits(bits)
    _check_uint8(packed, "packed")
    nbytes = packed_size(n, bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(f"packed last dim must be packed_size({n}, {bits}) = {nbytes}, got {packed.shape[-1]}")
    if 8 % bits:
        stream = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
        stream = stream.reshape(*packed.shape[:-1], nbytes * 8)[..., :n * bits]
        weights = torch.arange(bits, dtype=torch.int32, device=packed.device)
        fields = stream.reshape(*packed.shape[:-1], n, bits).to(torch.int32) << weights
        return fields.sum(dim=-1).to(torch.uint8)
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., nbytes, per]
    return fields.reshape(*packed.shape[:-1], nbytes * per)[..., :n]


def _check_values(x: torch.Tensor, keep: torch.Tensor | None = None) -> None:
    """Raise ValueError if x (restricted to ``keep`` positions) has NaN/inf or exceeds the fp16 range of scale/zero."""
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.numel() == 0:
        return
    mag = x.abs()
    if keep is not None:
        mag = mag.masked_fill(~keep, 0)  # ignored slots may hold garbage (e.g. an unfilled buffer)
    m = float(mag.amax())  # NaN propagates through amax, so one reduction checks both conditions
    if not math.isfinite(m):
        raise ValueError("x must be finite, got NaN or inf")
    if m > _FP16_MAX:
        raise ValueError(f"x has max abs value {m:g}, beyond the float16 range (max {_FP16_MAX:g}) of scale/zero")


def _scale_zero(mn: torch.Tensor, mx: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 min/max -> fp16 (scale, zero)."""
    scale = ((mx - mn) / ((1 << bits) - 1)).to(torch.float16)
    zero = mn.to(torch.float16)
    if not bool(torch.isfinite(scale).all()):
        # Only reachable at bits=1, where max - min of in-range values can still exceed 65504.
        m = float(torch.maximum(mn.abs(), mx.abs()).max())
        raise ValueError(f"x has max abs value {m:g}; its range overflows a float16 scale at bits={bits}")
    return scale, zero


# ----------------------------------------------------------------------------------------------- 8-bit metadata

META8_STEPS = 16        # scale codes per octave
META8_MIN_EXP = -10     # LOG_SCALES[0] = 2**META8_MIN_EXP
META8_Z = (-128, 127)   # zero code range (int8)
META8_ZERO_UNITS = 32   # zero codes per code range (2**bits steps)


def _log_scales() -> torch.Tensor:
    c = torch.arange(256)
    mantissa = torch.exp2((c % META8_STEPS).double() / META8_STEPS).to(torch.float16).float()
    return mantissa * torch.exp2((c // META8_STEPS + META8_MIN_EXP).float())        # exact: power-of-two factor


LOG_SCALES = _log_scales()   # float32 [256]; the kernels hold its 16 mantissas, LOG_SCALES[:16] * 2**10


def _zero_unit(bits: int) -> float:
    """Zero code unit in steps: 2**bits / META8_ZERO_UNITS (a power of two, so z * scale * unit is exact)."""
    return float(1 << bits) / META8_ZERO_UNITS


def meta8_encode(mn: torch.Tensor, mx: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 min/max [...] -> (scale code uint8, zero code int8) [...]: the smallest grid scale s with a zero code z
    such that [z * u, z * u + (2**bits - 1) * s] covers [min, max], u = s * _zero_unit(bits) (saturating where no
    scale does)."""
    top, unit = (1 << bits) - 1, _zero_unit(bits)
    table = LOG_SCALES.to(mn.device)
    c = torch.searchsorted(table, ((mx - mn) / top).contiguous()).clamp_(max=255)
    while True:
        s = table[c]
        z = torch.floor(mn / (s * unit))
        short = ((z * (s * unit) + top * s < mx) | (z < META8_Z[0]) | (z > META8_Z[1])) & (c < 255)
        if not bool(short.any()):
            return c.to(torch.uint8), z.clamp_(*META8_Z).to(torch.int8)
        c = c + short


def meta8_decode(code: torch.Tensor, z: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale code uint8, zero code int8) -> fp32 (scale, zero), both exact."""
    s = LOG_SCALES.to(code.device)[code.long()]
    return s, z.float() * (s * _zero_unit(bits))


def meta_to_bytes(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """A quantizer's stored (scale, zero) [...] (fp16 pair, or uint8 and int8 codes) -> their bytes uint8
    [..., 2 * pair bytes], scale first: what a page or a sliding layer holds."""
    return torch.stack([scale, zero.view(scale.dtype)], -1).contiguous().view(torch.uint8).flatten(-2)


def meta_from_bytes(raw: torch.Tensor, meta_bits: int, bits: int, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of (scale, zero) pairs (`meta_to_bytes`), contiguous -> (scale, zero) of `shape` as the dequantizers
    take them, for `bits`-bit codes."""
    if meta_bits == 8:
        pairs = raw.view(*shape, 2)
        return meta8_decode(pairs[..., 0], pairs[..., 1].view(torch.int8), bits)
    pairs = raw.view(torch.float16).view(*shape, 2)
    return pairs[..., 0], pairs[..., 1]


def decode_meta(scale: torch.Tensor, zero: torch.Tensor, meta_bits: int,
                bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantizer's stored (scale, zero) -> as the dequantizers take them (fp16 pairs pass through)."""
    return meta8_decode(scale, zero, bits) if meta_bits == 8 else (scale, zero)


def _scale_zero_meta(mn: torch.Tensor, mx: torch.Tensor, bits: int, meta_bits: int):
    """-> (scale, zero) as the quantizer uses them (float) and as stored (fp16 pair or (uint8, int8) pair)."""
    if meta_bits == 8:
        stored = meta8_encode(mn, mx, bits)
        return meta8_decode(*stored, bits), stored
    scale, zero = _scale_zero(mn, mx, bits)
    return (scale, zero), (scale, zero)


# ----------------------------------------------------------------------------------------------- calibrated levels

def nearest_level(u: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """u float32 [..., n], sorted levels [..., K] broadcastable to u.shape[:-1] + (K,) -> codes uint8 [..., n]: the
    nearest level (ties to the lower: the decision boundaries are the midpoints, and u on one goes below), i.e. the
    number of midpoints below u, as the CPU kernel counts them (paged_attention.cpp)."""
    mid = ((levels[..., 1:] + levels[..., :-1]) / 2).float()                       # [..., K - 1]
    if mid.shape[-1] > 15:          # 8-bit codes: one binary search per entry beats 255 passes over u
        mid = mid.expand(*u.shape[:-1], mid.shape[-1]).contiguous()
        return torch.searchsorted(mid, u.contiguous(), right=False).to(torch.uint8)
    # up to 4-bit codes: K - 1 vectorised comparisons, several times faster than searchsorted's per-entry search
    codes = torch.zeros(u.shape, dtype=torch.uint8, device=u.device)
    for k in range(mid.shape[-1]):
        codes += u > mid[..., k:k + 1]
    return codes


def level_values(codes: torch.Tensor, levels: torch.Tensor | None) -> torch.Tensor:
    """codes uint8 [..., n] -> float32 [..., n]: the codes themselves (uniform, levels None) or levels[..., code]
    (levels [..., K] broadcastable to codes.shape[:-1] + (K,))."""
    if levels is None:
        return codes.to(torch.float32)
    lut = levels.float().expand(*codes.shape[:-1], levels.shape[-1])
    return lut.gather(-1, codes.long())


def levels_problems(levels: torch.Tensor, bits: int) -> list[str]:
    """What is wrong with calibrated levels [..., 2**bits] (empty when they are usable): the width, finite values,
    sorted, endpoints pinned at exactly 0 and 2**bits - 1."""
    K = 1 << bits
    if levels.shape[-1:] != (K,):
        return [f"has {levels.shape[-1] if levels.dim() else 0} levels per row, {bits}-bit codes need {K}"]
    if not levels.is_floating_point() or not bool(torch.isfinite(levels).all()):
        return ["has non-finite levels"]
    problems = []
    if levels.numel() and bool((levels[..., 1:] < levels[..., :-1]).any()):
        problems.append("has levels that are not sorted ascending")
    if levels.numel() and not (bool((levels[..., 0] == 0).all()) and bool((levels[..., -1] == K - 1).all())):
        problems.append(f"has levels whose first is not 0 or last not {K - 1} (endpoints must be pinned)")
    return problems


def _encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
            levels: torch.Tensor | None = None) -> torch.Tensor:
    """x float32, scale/zero fp16 broadcastable to x -> uint8 codes; 0 wherever scale == 0. levels: calibrated levels
    broadcastable to x.shape[:-1] + (2**bits,) (module docstring), None: the uniform grid."""
    s, z = scale.float(), zero.float()
    degenerate = s == 0
    u = (x - z) / torch.where(degenerate, 1.0, s)
    if levels is not None:
        return nearest_level(u, levels).masked_fill_(degenerate.expand_as(u), 0)
    q = torch.round(u).clamp_(0, (1 << bits) - 1)
    return torch.where(degenerate, 0.0, q).to(torch.uint8)


def _groups(n: int, group_size: int | None) -> tuple[int, int]:
    """-> (number of groups, group size). None = one group spanning the whole vector (even when n == 0)."""
    if group_size is None:
        return 1, n
    if not isinstance(group_size, int) or group_size <= 0 or n % group_size:
        raise ValueError(f"group_size must be None or a positive divisor of n={n}, got {group_size!r}")
    return n // group_size, group_size


def quantize_per_token(
    x: torch.Tensor, bits: int, group_size: int | None = None, meta_bits: int = 16,
    levels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (grouped) quantization.

    x: float [..., n] -> codes uint8 [..., n], scale float16 [..., G], zero float16 [..., G], where
    G = n // group_size, or 1 if group_size is None. meta_bits 8: scale uint8 and zero int8 codes instead
    (:func:`meta8_decode` reads them). levels: calibrated levels broadcastable to x.shape[:-1] + (2**bits,).
    """
    _check_bits(bits)
    _check_values(x)
    *lead, n = x.shape
    ng, g = _groups(n, group_size)
    xg = x.to(torch.float32).reshape(*lead, ng, g)  # [..., G, g]
    if g == 0:
        zeros = torch.zeros(*lead, ng, dtype=torch.float32, device=x.device)
        mn = mx = zeros
    else:
        mn, mx = torch.aminmax(xg, dim=-1)
    (scale, zero), stored = _scale_zero_meta(mn, mx, bits, meta_bits)
    lut = None if levels is None else levels.unsqueeze(-2)                          # [..., 1, K] over the groups
    codes = _encode(xg, scale.unsqueeze(-1), zero.unsqueeze(-1), bits, lut)
    return codes.reshape(*lead, n), *stored


def quantize_per_channel(
    x: torch.Tensor, bits: int, valid: torch.Tensor | None = None, meta_bits: int = 16,
    levels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel (KIVI keys) quantization over a block of T tokens.

    x: float [..., T, n]; valid: optional bool [..., T] -- invalid tokens (unfilled slots of a partial block) are
    ignored entirely: excluded from min/max, not checked for NaN, and given code 0. A channel with no valid token gets
    scale = zero = 0 (meta_bits 8: the codes of [0, 0]).
    Returns codes uint8 [..., T, n], scale float16 [..., n], zero float16 [..., n] (meta_bits 8: uint8 and int8
    codes, as :func:`quantize_per_token`). levels: calibrated levels broadcastable to x.shape[:-1] + (2**bits,),
    e.g. [..., 1, K] per block.
    """
    _check_bits(bits)
    if x.dim() < 2:
        raise ValueError(f"x must have shape [..., T, n] (at least 2 dims), got shape {tuple(x.shape)}")
    keep = None
    if valid is not None:
        if valid.dtype != torch.bool or valid.shape != x.shape[:-1]:
            raise ValueError(
                f"valid must be a bool tensor of shape {tuple(x.shape[:-1])}, got {valid.dtype} {tuple(valid.shape)}"
            )
        keep = valid.unsqueeze(-1)  # [..., T, 1]
    _check_values(x, keep)
    xf = x.to(torch.float32)
    if x.shape[-2] == 0:
        mn = mx = torch.zeros(*x.shape[:-2], x.shape[-1], dtype=torch.float32, device=x.device)
    elif keep is None:
        mn, mx = torch.aminmax(xf, dim=-2)
    else:
        mn = xf.masked_fill(~keep, float("inf")).amin(dim=-2)
        mx = xf.masked_fill(~keep, float("-inf")).amax(dim=-2)
        any_valid = valid.any(dim=-1, keepdim=True)  # [..., 1]
        mn = torch.where(any_valid, mn, 0.0)
        mx = torch.where(any_valid, mx, 0.0)
    (scale, zero), stored = _scale_zero_meta(mn, mx, bits, meta_bits)
    if keep is not None:
        xf = xf.masked_fill(~keep, 0.0)  # keep garbage (NaN) out of the arithmetic; code forced to 0 below
    codes = _encode(xf, scale.unsqueeze(-2), zero.unsqueeze(-2), bits, levels)
    if keep is not None:
        codes = codes.masked_fill(~keep, 0)
    return codes, *stored


def _check_params(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, shape: tuple[int, ...]) -> None:
    _check_uint8(codes, "codes")
    if scale.shape != shape or zero.shape != shape:
        raise ValueError(f"scale and zero must have shape {shape}, got {tuple(scale.shape)} and {tuple(zero.shape)}")


def dequantize_per_token(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    levels: torch.Tensor | None = None,
) -> torch.Tensor:
    """codes uint8 [..., n], scale/zero [..., G] (G as in :func:`quantize_per_token`) -> dtype [..., n]. levels: as
    :func:`quantize_per_token` took them."""
    *lead, n = codes.shape
    ng, g = _groups(n, group_size)
    _check_params(codes, scale, zero, (*lead, ng))
    cg = level_values(codes, levels).reshape(*lead, ng, g)
    x_hat = cg * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return x_hat.reshape(*lead, n).to(dtype)


def round_trip_per_token(x: torch.Tensor, bits: int, group_size: int | None = None,
                         meta_bits: int = 16, levels: torch.Tensor | None = None) -> torch.Tensor:
    """x float [..., n] -> float32 [..., n] as per-token storage gives it back (quantize, then dequantize): what the
    store reads back for a per-token side. levels: calibrated levels broadcastable to x.shape[:-1] + (2**bits,), e.g.
    a (layer, side, bits) bundle tensor's row per KV head as [H, 1, K] for x [H, S, n]; None: uniform."""
    codes, scale, zero = quantize_per_token(x, bits, group_size, meta_bits, levels)
    return dequantize_per_token(codes, *decode_meta(scale, zero, meta_bits, bits), group_size, levels=levels)


def normalised_per_token(x: torch.Tensor, bits: int, group_size: int | None = None,
                         meta_bits: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [..., n] -> (u, step) float32 [..., n]: u = (x - zero) / scale with the (scale, zero) per-token storage
    takes (0 where scale is 0), the samples calibrated levels are fitted on (`kvcal.profile.codebooks.fit_levels`),
    and step = scale, what one unit of u is worth in x (an error in u costs step² times as much in x). u is in
    [0, 2**bits - 1] up to the fp16 rounding of scale and zero; m8's coarser grid may leave room at either end."""
    *lead, n = x.shape
    ng, g = _groups(n, group_size)
    _, scale, zero = quantize_per_token(x, bits, group_size, meta_bits)
    s, z = (t.float().unsqueeze(-1) for t in decode_meta(scale, zero, meta_bits, bits))      # [..., G, 1]
    u = (x.float().reshape(*lead, ng, g) - z) / torch.where(s == 0, 1.0, s)
    return torch.where(s == 0, 0.0, u).reshape(*lead, n), s.expand(*lead, ng, g).reshape(*lead, n)


def normalised_per_channel(x: torch.Tensor, bits: int, meta_bits: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [..., T, n] -> (u, step) float32 [..., T, n] with each block's per-channel (scale, zero), as
    per-channel key pages take them (see `normalised_per_token`)."""
    _, scale, zero = quantize_per_channel(x, bits, meta_bits=meta_bits)
    s, z = (t.float().unsqueeze(-2) for t in decode_meta(scale, zero, meta_bits, bits))      # [..., 1, n]
    return torch.where(s == 0, 0.0, (x.float() - z) / torch.where(s == 0, 1.0, s)), s.expand_as(x).float()


def dequantize_per_channel(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype = torch.float32,
    levels: torch.Tensor | None = None,
) -> torch.Tensor:
    """codes uint8 [..., T, n], scale/zero [..., n] -> dtype [..., T, n]. levels: as :func:`quantize_per_channel`
    took them."""
    if codes.dim() < 2:
        raise ValueError(f"codes must have shape [..., T, n] (at least 2 dims), got shape {tuple(codes.shape)}")
    _check_params(codes, scale, zero, (*codes.shape[:-2], codes.shape[-1]))
    x_hat = level_values(codes, levels) * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)
    return x_hat.to(dtype)


def round_trip_per_channel(x: torch.Tensor, bits: int, meta_bits: int = 16,
                           levels: torch.Tensor | None = None) -> torch.Tensor:
    """x float [..., T, n] (blocks of T tokens, e.g. [H, pages, T, r]) -> float32 [..., T, n] as per-channel key
    pages give it back: one (scale, zero) per channel over each block's T tokens. levels: calibrated levels
    broadcastable to x.shape[:-1] + (2**bits,), e.g. [H, 1, 1, K] per KV head; None: uniform."""
    codes, scale, zero = quantize_per_channel(x, bits, meta_bits=meta_bits, levels=levels)
    return dequantize_per_channel(codes, *decode_meta(scale, zero, meta_bits, bits), levels=levels)


# ---------------------------------------------------------------------------------------------- static per-channel

def static_scale_zero(low: torch.Tensor, high: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel clip range [low, high] (float32 [..., n], calibrated offline) -> fp16 (scale, zero) [..., n].

    Rounded outwards: zero is ``low`` rounded down to fp16 and scale is rounded up, so the codes cover
    ``[zero, zero + (2**bits - 1) * scale] ⊇ [low, high]``; the fp16 rounding never clips a value the range admits
    (round to nearest could pull the grid in by up to half an fp16 ulp at each end).
    """
    _check_bits(bits)
    low, high = low.float(), high.float()
    if low.shape != high.shape or bool((low > high).any()):
        raise ValueError("static key ranges need low <= high of the same shape")
    m = float(torch.maximum(low.abs(), high.abs()).amax()) if low.numel() else 0.0
    if not math.isfinite(m) or m > _FP16_MAX:
        raise ValueError(f"static key range reaches {m:g}, beyond the float16 range (max {_FP16_MAX:g}) of scale/zero")
    zero = low.to(torch.float16)
    zero = torch.where(zero.float() > low, torch.nextafter(zero, torch.full_like(zero, -math.inf)), zero)
    step = (high - zero.float()) / ((1 << bits) - 1)
    scale = step.to(torch.float16)
    scale = torch.where(scale.float() < step, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"static key range {m:g} overflows a float16 scale at bits={bits}")
    return scale, zero


def quantize_static(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    levels: torch.Tensor | None = None) -> torch.Tensor:
    """x float [..., n], fp16 scale/zero broadcastable to x (`static_scale_zero`) -> codes uint8 [..., n]. Values
    outside the calibrated range saturate at code 0 or 2**bits - 1. levels: broadcastable to x.shape[:-1] + (K,)."""
    _check_bits(bits)
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("x must be finite, got NaN or inf")
    return _encode(x.to(torch.float32), scale, zero, bits, levels)


def dequantize_static(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      dtype: torch.dtype = torch.float32, levels: torch.Tensor | None = None) -> torch.Tensor:
    """codes uint8 [..., n], scale/zero fp16 broadcastable to codes -> dtype [..., n]."""
    _check_uint8(codes, "codes")
    return (level_values(codes, levels) * scale.float() + zero.float()).to(dtype)
