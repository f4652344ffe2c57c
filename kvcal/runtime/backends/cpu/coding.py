"""Quantize-and-dequantize round trips by the CPU kernels (`kvcal_round_trip` in csrc/paged_attention.cpp).

The calibration's quality model and coded probe code every candidate format of every (layer, KV head) at the
deployment context: tens of millions of entries per measured point. In torch each round trip is some thirty passes
over memory (min, max, scale and zero, a comparison per level, the lookup, the product); the kernel does it in one
pass, with the same float operations as kvcal.runtime.storage.quant: equal codes, and values equal up to the one
rounding a fused multiply-add may save in zero + scale · level.

    coded = round_trip(x, 4, 8, levels, channel=True)            # x [..., T, n]: per-channel blocks of T tokens
    coded = round_trip(x, 2, 8, None, channel=False, group=32)   # per token, groups of 32 channels
    err = round_trip(x, 4, 8, levels, channel=True, g2=g2)       # float64 [..., T]: sum over n of g2 (coded - x)²
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from .build import CpuBuildError, load_library


def available() -> bool:
    """Whether the kernels load here (a failed build is tried once per process)."""
    return os.environ.get("KVCAL_DISABLE_CPU_KERNELS", "") in ("", "0") and _loads()


@functools.cache
def _loads() -> bool:
    try:
        load_library()
    except CpuBuildError:
        return False
    return True


def round_trip(x: torch.Tensor, bits: int, meta_bits: int, levels: torch.Tensor | None, *, channel: bool,
               group: int | None = None, g2: torch.Tensor | None = None) -> torch.Tensor:
    """x float [..., T, n] on the CPU -> as quant.round_trip_per_channel (channel: one (scale, zero) per channel of
    each block of T tokens) or quant.round_trip_per_token (groups of `group` channels, None: all n) gives it back,
    float32 [..., T, n]; with g2 (float64, x's shape) instead each token's Σ_n g2 (coded - x)², float64 [..., T].
    levels: calibrated levels broadcastable to x.shape[:-1] + (2**bits,) and alike over T, or None (uniform)."""
    *lead, T, n = x.shape
    blocks = 1
    for size in lead:
        blocks *= size
    x = x.float().contiguous()
    lut = None
    if levels is not None:
        if levels.dim() < 2 or levels.shape[-2] != 1:
            raise ValueError(f"levels {tuple(levels.shape)} must be alike over a block's tokens (second-last size 1)")
        lut = levels.float()[..., 0, :].expand(*lead, levels.shape[-1]).contiguous()      # [..., K]
    group = n if group is None else group
    if group <= 0 or n % group:
        raise ValueError(f"group must be a positive divisor of n={n}, got {group}")
    out = None if g2 is not None else torch.empty_like(x)
    err = torch.empty(*lead, T, dtype=torch.float64) if g2 is not None else None
    g2 = None if g2 is None else g2.double().contiguous()
    bad = ctypes.c_float(0.0)

    def ptr(t: torch.Tensor | None):
        return None if t is None else t.data_ptr()

    rc = load_library().kvcal_round_trip(ptr(x), blocks, T, n, int(channel), group, bits, int(meta_bits == 8),
                                         ptr(lut), ptr(g2), ptr(err), ptr(out), torch.get_num_threads(),
                                         ctypes.byref(bad))
    if rc == 1:
        raise ValueError("x must be finite, got NaN or inf")
    if rc == 2:
        raise ValueError(f"x has max abs value {bad.value:g}, beyond the float16 range (max 65504) of scale/zero")
    return err if g2 is not None else out
