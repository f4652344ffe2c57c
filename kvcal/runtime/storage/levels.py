"""Calibrated levels as the store serves them: which bundle tensors a store's formats need, checked once.

A tier format side marked calibrated (`TierFormat.k_levels` / `v_levels`, an `n` after its bits) decodes a code as
`zero + scale * levels[code]` (`quant` module docstring). The levels are constants of the bundle, one row of 2**b
per (layer, KV head), per side and bit width:

    levels.k.{bits}, levels.v.{bits}   float32 [L, H, 2**bits]   (bits 2, 3, 4, 8)

so the pages hold the same bytes as a uniform format and only these constants are added, counted as the bundle's
fixed bytes (`CompressedStore.fixed_bytes`).
"""

from __future__ import annotations

import torch

from kvcal.runtime.storage import quant

LEVEL_BITS = (2, 3, 4, 8)
SIDES = ("k", "v")
KERNEL_ROW = 256      # floats per level row of a kernel's level table (the most levels: 8 bits)


def tensor_name(side: str, bits: int) -> str:
    """The bundle tensor of `side` ("k" or "v") at `bits`: "levels.k.4"."""
    return f"levels.{side}.{bits}"


def needed(fmt) -> list[tuple[str, int]]:
    """(side, bits) of each calibrated side of TierFormat `fmt`."""
    return [(side, bits) for side, bits, kind in (("k", fmt.k_bits, fmt.k_levels), ("v", fmt.v_bits, fmt.v_levels))
            if kind == "calibrated"]


def served_levels(levels: dict[str, torch.Tensor] | None, formats: dict[int, list], L: int, H: int,
                  device) -> dict[tuple[int, str, int], torch.Tensor]:
    """The rows a store needs: levels (bundle tensors by name, `tensor_name`; None: none given), formats (layer ->
    the TierFormats its pages use) -> (layer, side, bits) -> float32 [H, 2**bits] on `device`. Refuses, in one line,
    a calibrated format whose levels are missing, of the wrong shape or unusable (`quant.levels_problems`)."""
    out: dict[tuple[int, str, int], torch.Tensor] = {}
    for layer, fmts in formats.items():
        for fmt in fmts:
            for side, bits in needed(fmt):
                if (layer, side, bits) in out:
                    continue
                name = tensor_name(side, bits)
                t = (levels or {}).get(name)
                if t is None:
                    raise ValueError(f"tier `{fmt.name}` needs calibrated levels `{name}`, and the bundle has none; "
                                     f"use a bundle that holds `{name}` or drop the `n` from `{fmt.name}`")
                want = (L, H, 1 << bits)
                if tuple(t.shape) != want:
                    raise ValueError(f"levels `{name}` have shape {list(t.shape)}, tier `{fmt.name}` needs "
                                     f"{list(want)} (layers, KV heads, 2**bits)")
                problems = quant.levels_problems(t[layer], bits)
                if problems:
                    raise ValueError(f"levels `{name}` of layer {layer} {problems[0]}; recalibrate the bundle")
                out[layer, side, bits] = t[layer].float().to(device).contiguous()
    return out


def kernel_table(store, layer: int) -> torch.Tensor | None:
    """A layer's levels as the fused cpu kernels read them: float32 [2 tiers, H, 2 (K, V), KERNEL_ROW] on
    the store's device, row (side, h, which) = KV head h's levels of that side's format on tier `side` (zero-padded
    past 2**bits); None when every side of the layer is uniform. Flattened, row (side * H + h) * 2 + which."""
    H = store.num_kv_heads
    table, any_levels = torch.zeros(2, H, 2, KERNEL_ROW), False
    for g in store.groups[layer]:
        for side in (0, 1):
            for which, lut in enumerate(store.level_params(layer, side, g.heads, g.layouts[side].fmt)):
                if lut is not None:
                    table[side, g.heads.cpu(), which, :lut.shape[-1]] = lut.cpu().float()
                    any_levels = True
    return table.to(store.device) if any_levels else None
