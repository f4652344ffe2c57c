"""KVTuner-style baseline: key and value bits chosen per layer, on KIVI's layout, from a one-pass sensitivity estimate
(after Li et al., "KVTuner", ICML 2025, arXiv 2502.04420; their offline search is replaced by the estimate below).

Layout of every compressed layer: the kvcal store of the `kivi-*` methods (a raw fp16 high tier holding the recent
`KIVI_WINDOW` tokens plus fewer than `KIVI_GROUP` waiting, a low tier with per-channel keys in groups of `KIVI_GROUP`
tokens and per-token values, no rotation, full rank), but the low tier's (key bits, value bits) differ by layer. The
layers sharing one format are served by one `KvcalCache`; `LayerwiseKvcalCache` interleaves their layers.

Sensitivity, from one dense prefill of calibration windows (`capturing`): for every compressed layer l and
candidate pair p, the relative error of the attention outputs of the last `QUERIES` queries when the keys and values
older than the fp16 window are quantized and dequantized with p, as the low tier would store them:

    e[l, p] = sum_windows ||softmax(s q K_p^T) V_p - softmax(s q K^T) V||^2 / sum_windows ||softmax(s q K^T) V||^2

with s = d^-1/2 (a model with another attention scale is estimated at this one; the bench then measures it).
Allocation: the pairs minimising sum_l e[l, p_l] + lambda * bits(p_l), with lambda the smallest (bisected) that brings
the mean low-tier bits per element, (k + v) / 2 averaged over layers, within the budget. Each budget is one method,
to be compared with the uniform `kivi-*` row of the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from kvcal.bench.caches import dense_bytes, memory_dict
from kvcal.bench.methods import Method, kivi_config
from kvcal.profile.capture import capturing
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.storage.quant import (
    dequantize_per_channel,
    dequantize_per_token,
    quantize_per_channel,
    quantize_per_token,
)

PAIRS = ((8, 8), (8, 4), (4, 8), (4, 4), (4, 2), (2, 4), (2, 2))   # (key bits, value bits), KVTuner's candidates
BUDGETS = (4.0, 3.0, 2.5)        # mean low-tier bits per element: K4V4's, K4V2's, and between K4V2 and K2V2
QUERIES = 32                     # last queries of each window whose attention outputs the estimate compares


# --------------------------------------------------------------------------------------------- sensitivity


def _kivi_round_trip(x: torch.Tensor, bits: int, per_channel: bool, group: int) -> torch.Tensor:
    """x [B, H, n, d] with n a multiple of `group` -> x quantized and dequantized as KIVI's low tier stores it:
    per channel over groups of `group` tokens (keys) or per token (values)."""
    if not per_channel:
        return dequantize_per_token(*quantize_per_token(x, bits))
    B, H, n, d = x.shape
    blocks = x.reshape(B, H, n // group, group, d)
    return dequantize_per_channel(*quantize_per_channel(blocks, bits)).reshape(B, H, n, d)


class SensitivityCollector:
    """`capturing` collector: accumulates the numerator and denominator of e[l, p] (module docstring)."""

    def __init__(self, num_layers: int, compressed: list[bool], window: int, group: int):
        self.compressed, self.window, self.group = compressed, window, group
        self.err = torch.zeros(num_layers, len(PAIRS), dtype=torch.float64)
        self.norm = torch.zeros(num_layers, dtype=torch.float64)

    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """query [B, Hq, S, d], key and value [B, H, S, d], post-RoPE."""
        if not self.compressed[layer]:
            return
        B, Hq, S, d = query.shape
        H = key.shape[1]
        old = max(0, (S - self.window) // self.group * self.group)    # tokens in whole groups behind the window
        n = min(QUERIES, S)
        if old == 0:
            return
        q = query[:, :, S - n:].float().reshape(B, H, Hq // H, n, d) * d ** -0.5
        k, v = key.float(), value.float()
        causal = torch.arange(S - n, S).unsqueeze(1) >= torch.arange(S).unsqueeze(0)          # [n, S]

        def attend(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            scores = torch.einsum("bhgnd,bhsd->bhgns", q, keys).masked_fill(~causal, float("-inf"))
            return torch.einsum("bhgns,bhsd->bhgnd", scores.softmax(-1), values)

        exact = attend(k, v)
        self.norm[layer] += exact.pow(2).sum().double()
        for j, (kb, vb) in enumerate(PAIRS):
            kq = torch.cat([_kivi_round_trip(k[:, :, :old], kb, True, self.group), k[:, :, old:]], dim=2)
            vq = torch.cat([_kivi_round_trip(v[:, :, :old], vb, False, self.group), v[:, :, old:]], dim=2)
            self.err[layer, j] += (attend(kq, vq) - exact).pow(2).sum().double()

    def relative_error(self) -> torch.Tensor:
        """e [L, len(PAIRS)] (0 for layers that are not compressed)."""
        return self.err / self.norm.clamp_min(1e-30).unsqueeze(1)


@torch.inference_mode()
def layer_sensitivity(model, adapter, windows: torch.Tensor, window: int, group: int) -> torch.Tensor:
    """windows [n, S] calibration token ids -> e [L, len(PAIRS)], one window per forward pass."""
    compressed = [not adapter.is_sliding(i) for i in range(adapter.num_layers)]
    collector = SensitivityCollector(adapter.num_layers, compressed, window, group)
    with capturing(model, collector):
        for row in windows:
            model(input_ids=row.unsqueeze(0), use_cache=False, logits_to_keep=1)
    return collector.relative_error()


# --------------------------------------------------------------------------------------------- allocation


def allocate(error: torch.Tensor, compressed: list[bool], budget: float, iters: int = 60) -> list[tuple[int, int]]:
    """error [L, len(PAIRS)] -> a pair per layer (None-free; uncompressed layers get the first pair, unused) whose mean
    bits (k + v) / 2 over compressed layers is at most `budget`, minimising the summed error on that constraint's
    Lagrangian hull. ValueError if the budget is below the cheapest pair."""
    bits = torch.tensor([(k + v) / 2 for k, v in PAIRS], dtype=torch.float64)
    if budget < bits.min():
        raise ValueError(f"budget {budget:g} bits is below the cheapest pair ({bits.min().item():g} bits)")
    rows = [i for i, c in enumerate(compressed) if c]
    e = error[rows].double()

    def pick(lam: float) -> torch.Tensor:           # index per compressed layer; ties go to fewer bits
        cost = e + lam * bits
        return (cost + 1e-12 * bits).argmin(dim=1)

    def mean_bits(choice: torch.Tensor) -> float:
        return bits[choice].mean().item()

    lo, hi = 0.0, 1.0
    while mean_bits(pick(hi)) > budget:
        hi *= 4
    if mean_bits(pick(lo)) <= budget:
        hi = lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if mean_bits(pick(mid)) <= budget else (mid, hi)
    choice = pick(hi)
    out = [PAIRS[0]] * len(compressed)
    for i, j in zip(rows, choice.tolist()):
        out[i] = PAIRS[j]
    return out


# --------------------------------------------------------------------------------------------- cache


class LayerwiseKvcalCache(Cache):
    """A transformers `Cache` whose compressed layers each have their own `CompressionConfig`: one `KvcalCache` per
    distinct config (compressing only its layers), their layers interleaved; sliding layers stay dense."""

    def __init__(self, bundle, adapter, configs: list[CompressionConfig | None], serve: ServeOptions | None = None):
        from kvcal.runtime.hf import KvcalCache

        serve = serve or ServeOptions()
        self.adapter, self.configs = adapter, configs
        placeholder = adapter.sliding_window or 1          # other groups' layers: never filled in this group's cache
        self.groups = []
        for config in dict.fromkeys(c for c in configs if c is not None):
            types = [t if c == config else "sliding_attention" for t, c in zip(adapter.layer_types, configs)]
            self.groups.append(KvcalCache(bundle, config, layer_types=types, sliding_window=placeholder, serve=serve))
        super().__init__(layers=self._layers())

    def _layers(self) -> list:
        out = []
        for i, config in enumerate(self.configs):
            if config is None:
                out.append(DynamicSlidingWindowLayer(self.adapter.sliding_window))
            else:
                out.append(next(g for g in self.groups if g.config == config).layers[i])
        return out

    def memory(self) -> dict[str, float]:
        """As `KvcalCache.memory()`: every group's pages, plus the dense sliding layers, against fp16."""
        total = fp16 = 0
        for g in self.groups:
            m = g.memory()
            if m["fp16_bytes"] == m["fp16_bytes"]:        # a group with nothing written yet reports nan
                total, fp16 = total + m["total_bytes"], fp16 + m["fp16_bytes"]
        for layer, config in zip(self.layers, self.configs):
            if config is None and layer.is_initialized:
                total += dense_bytes(layer.keys, layer.values)
                fp16 += layer.keys.numel() * 2 * 2
        return memory_dict(total, fp16)

    def release(self) -> int:
        freed = sum(g.release() for g in self.groups)
        self.layers = self._layers()
        return freed


def kvtuner_methods(model, adapter, bundle, sensitivity: Callable[[], torch.Tensor], window: int, group: int,
                    serve: ServeOptions | None = None) -> list[Method]:
    """One `Method` per budget in `BUDGETS`, served with `serve` (default options when None); `sensitivity()`
    returns e [L, len(PAIRS)] (computed on first use). A method's settings gain the allocation (pair per layer) when
    its first cache is made."""
    from kvcal.runtime.hf import install

    compressed = [not adapter.is_sliding(i) for i in range(adapter.num_layers)]
    out = []
    for budget in BUDGETS:
        settings = {"budget_bits": budget, "window": window, "group": group, "pairs": None}

        def factory(reserve, budget=budget, settings=settings):
            pairs = allocate(sensitivity(), compressed, budget)
            settings["pairs"] = [f"K{k}V{v}" if c else None for (k, v), c in zip(pairs, compressed)]
            install(model)
            configs = [kivi_config(k, v, window, group) if c else None for (k, v), c in zip(pairs, compressed)]
            return LayerwiseKvcalCache(bundle, adapter, configs, serve)

        out.append(Method(f"kvtuner-{budget:g}bit", f"KVTuner-style {budget:g} bit", "quantization", "KVTuner-style",
                          f"KIVI layout (fp16 residual of {window} + <{group} tokens), (key, value) bits per layer "
                          f"from a one-pass attention-error estimate, mean {budget:g} bits per element in the low tier",
                          settings, factory=factory))
    return out

