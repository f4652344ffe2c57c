"""One-pass sensitivity of each layer's keys and values to fewer bits, for the search's bits stage (KVTuner's
question, answered with KVQuant's Fisher weighting).

One forward and backward pass of the model over a few windows of text gives g = dL/dK and dL/dV for every layer
(L: the next-token loss; K post-RoPE, V as the cache holds them). Coding a tensor x as x + δ adds about
½ Σ g² δ² to the loss (second order, diagonal empirical Fisher). For every layer and side (K or V) the bits stage
may halve, δ is the store's own coding error, in the served bases (g and x rotate with them), at the layer's current
format and at the halved one; the step's cost is the difference:

    added[(layer, side)] = Σ g² (δ_halved² − δ_current²)        (summed over windows, heads, tokens, coordinates)

Every token is coded at the format here (no fp16 window, no tiers): the estimate ranks steps, it does not predict
quality. The search measures each candidate it keeps (kvcal.profile.search, stage "bits"), so one pass replaces one
decode probe per (layer, K|V); docs/calibration.md ("One-pass sensitivity") compares the two rankings.

    added = fisher_sensitivity(model, adapter, windows, served, {layer: TierFormat}, page_bytes, tracked)
"""

from __future__ import annotations

import dataclasses

import torch

from kvcal.profile.capture import capturing
from kvcal.runtime import quant
from kvcal.runtime.adapters import ModelAdapter
from kvcal.runtime.bases import ServedBases
from kvcal.runtime.layout import QUANT_BITS, RAW_BITS, PageLayout, TierFormat

SIDES = ("k_bits", "v_bits")


def halved(fmt: TierFormat, side: str) -> TierFormat | None:
    """`fmt` with `side`'s bits halved, or None where that is no quantized width (2 bits, raw, static keys)."""
    bits = getattr(fmt, side) // 2
    if bits not in QUANT_BITS or getattr(fmt, side) in RAW_BITS or (side == "k_bits" and fmt.k_mode == "static"):
        return None
    return dataclasses.replace(fmt, **{side: bits})


def coded_keys(k: torch.Tensor, fmt: TierFormat, page_tokens: int) -> torch.Tensor:
    """k float32 [H, S, r] in the served basis -> as `fmt` stores it: per-channel over whole pages of `page_tokens`
    tokens (a last partial page stays raw, as its tokens would wait in the high tier), or per token."""
    if fmt.k_bits in RAW_BITS:
        return k
    if fmt.k_mode == "channel":
        H, S, r = k.shape
        n = S - S % page_tokens
        pages = k[:, :n].reshape(H, n // page_tokens, page_tokens, r)
        codes, scale, zero = quant.quantize_per_channel(pages, fmt.k_bits, meta_bits=fmt.meta_bits)
        out = quant.dequantize_per_channel(codes, *quant.decode_meta(scale, zero, fmt.meta_bits, fmt.k_bits))
        return torch.cat([out.reshape(H, n, r), k[:, n:]], dim=1)
    if fmt.k_mode == "token":
        return quant.round_trip_per_token(k, fmt.k_bits, fmt.k_group, fmt.meta_bits)
    raise ValueError(f"no one-pass estimate for {fmt.k_mode} keys")


def coded_values(v: torch.Tensor, fmt: TierFormat) -> torch.Tensor:
    """v float32 [H, S, r] in the served basis -> as `fmt` stores it (per token, groups of `v_group` channels)."""
    if fmt.v_bits in RAW_BITS:
        return v
    return quant.round_trip_per_token(v, fmt.v_bits, fmt.v_group, fmt.meta_bits)


class _KeepKV:
    """A capture collector that keeps each layer's key and value tensors (with their autograd history)."""

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.kv[layer] = (key, value)


def fisher_sensitivity(model, adapter: ModelAdapter, windows: torch.Tensor, served: ServedBases,
                       formats: dict[int, TierFormat], page_bytes: int,
                       tracked: bool = True) -> dict[tuple[int, str], float]:
    """windows long [B, S] token ids; served: the bases the runtime applies for the configuration the stage starts
    from (kvcal.runtime.bases.served_bases); formats: {layer: its current format} (the low tier of a compressed
    layer, the format of a sliding one); page_bytes, tracked: the arena's page size and whether low pages keep
    scores (`CompressionConfig.page_size`, `low_tracked`), which set each format's tokens per page, the per-channel
    key group -> {(layer, side): loss the halving adds} for every side `halved` allows. The model's parameters get
    no gradient (their requires_grad is restored)."""
    steps = {(layer, side): halved(fmt, side) for layer, fmt in formats.items() for side in SIDES}
    steps = {key: half for key, half in steps.items() if half is not None}
    added = dict.fromkeys(steps, 0.0)
    if not steps:
        return added
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    keep = _KeepKV()
    layers = sorted({layer for layer, _ in steps})

    def page_tokens(fmt: TierFormat) -> int:
        return PageLayout.build(fmt, adapter.head_dim, adapter.head_dim, page_bytes, tracked).tokens

    try:
        for ids in windows:
            with torch.inference_mode(False), torch.enable_grad(), capturing(model, keep):
                embeds = model.get_input_embeddings()(ids[None]).detach().requires_grad_(True)
                loss = model(inputs_embeds=embeds, labels=ids[None]).loss
                grads = torch.autograd.grad(loss, [t for layer in layers for t in keep.kv[layer]])
            for i, layer in enumerate(layers):
                _add_layer(added, steps, layer, keep.kv[layer], grads[2 * i:2 * i + 2], served, formats[layer],
                           page_tokens)
            keep.kv.clear()
    finally:
        for p in params:
            p.requires_grad_(True)
    return added


@torch.no_grad()
def _add_layer(added: dict, steps: dict, layer: int, kv: tuple, grads: tuple, served: ServedBases,
               fmt: TierFormat, page_tokens) -> None:
    """Accumulate Σ g² (δ_halved² − δ_current²) of one window into `added` for `layer`'s steps. kv, grads: key and
    value [1, H, S, d] and their gradients; page_tokens(format) -> tokens per page."""
    # x -> x A in the served basis, so dL/d(x A) = g A^-T: for keys A = R D^-1 M (smoothed) and A^-T = R D M, the
    # query rotation; values' basis is orthogonal
    bases = {"k_bits": (served.rotation[layer], served.query_rotation[layer]),
             "v_bits": (served.basis[layer], served.basis[layer])}                                  # [H, d, d] each
    for side, (x, g) in zip(SIDES, zip(kv, grads)):
        half = steps.get((layer, side))
        if half is None:
            continue
        x = torch.einsum("hsd,hde->hse", x[0].detach().float().cpu(), bases[side][0])
        g2 = torch.einsum("hsd,hde->hse", g[0].float().cpu(), bases[side][1]).double() ** 2
        code = (lambda x, f: coded_keys(x, f, page_tokens(f))) if side == "k_bits" else coded_values
        err = [(code(x, f) - x).double() ** 2 for f in (fmt, half)]
        added[(layer, side)] += float((g2 * (err[1] - err[0])).sum())
