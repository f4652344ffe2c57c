"""The configurations `kvcal bench` compares, each a `Method`: what it is, how to build a fresh cache for it.

Methods that are special cases of the kvcal store run on `KvcalCache` with a `CompressionConfig`:

* uniform per-token quantization K8V8 / K4V4 / K2V2: the high tier only, no tiers, full rank, no rotation (plain
  per-token asymmetric min-max in the model's basis, one fp16 scale/zero per token and head);
* KIVI-style K4V4 / K4V2 / K2V2 (Liu et al., ICML 2024, arXiv 2402.02750): keys per channel, values per token,
  recent tokens in fp16. High tier = `K16V16` (the fp16 residual), low tier = `K4cV4` / `K4cV2` / `K2cV2`, and a
  token policy that sends every token leaving the 64-token window low (alpha_high = 1e9, nothing pruned). Pages are
  sized to hold 32 low tokens, so keys are quantized per channel in groups of 32 tokens (KIVI's G = 32); a group is
  written once 32 tokens wait, so the fp16 residual holds the last 64 tokens plus fewer than 32 waiting (KIVI:
  R = 128, flushed whole). No rotation. kvcal's search tries the same layout (its residual family, with heavy
  hitters on top), so a bundle searched at the bench's context is never worse than these on the search text;
* each seed method alone, as the bundle's calibration search measured it (`bundle.calibration["search"]
  ["families"]`, rebuilt with `CompressionConfig.from_dict`): FDC ranks only (a `K16V16` store with the
  searched removal rates), DiffKV tiers only (full rank; the runtime's rotation and mixing are on, as in the
  search), FastGen's patterns only (a `K16V16` store). Where the search kept no point for a family, a stated default;
* kvcal joint: `CompressionConfig.from_dict(bundle.settings)` with the bundle's ranks; and a sweep of alpha_high x
  {0.5, 1, 2} and alpha_low around it (alpha_low x {0, 1, 2}, or {0, 0.25, 0.5} when the joint prunes nothing).

KVQuant-style K4V4 / K3V3 / K2V2 (Hooper et al., NeurIPS 2024, arXiv 2401.18079) are a cache of their own,
`kvcal.bench.kvquant`: pre-RoPE per-channel keys and per-token values on per-layer non-uniform codebooks, 1% outliers
and the first token exact, all calibrated on the corpus's calib split (`kvquant_methods`, added by `run_bench`).

The eviction baselines StreamingLLM, H2O and SnapKV are runtime token policies (`kvcal.runtime.policies.streamingllm`,
`h2o`, `snapkv`) on a `K16V16` store at full rank without rotation, so their bytes are the pages they really hold.
The others are caches of their own (`kvcal.bench.caches`, `kvcal.bench.lowrank`, `kvcal.bench.turboquant`): dense
(model dtype), transformers' `QuantizedCache` for each backend that runs offline, Palu, and TurboQuant-style
quantization (Zandieh et al. 2025, arXiv 2504.19874; no calibration): a fixed random rotation, an fp16 norm per
vector and b-bit Lloyd-Max codes per coordinate, K4V4 / K4V2 / K2V2, and K2V2 with the recent 64 tokens in fp16.
Eviction and Palu are "matched": built once kvcal joint's bytes ratio is measured, with that ratio as their memory
budget (`eviction_fraction`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvcal.bench import caches
from kvcal.bench.lowrank import PaluCache, unsupported_reason
from kvcal.bench.method import Method
from kvcal.bench.turboquant import turboquant_methods
from kvcal.profile.ranks import ranks_of
from kvcal.runtime.bundle import Bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies.diffkv import EVERY_TOKEN_LOW, TieringConfig
from kvcal.runtime.policies.fastgen import FastGenConfig
from kvcal.runtime.policies.h2o import H2OConfig
from kvcal.runtime.policies.snapkv import SnapKVConfig
from kvcal.runtime.policies.streamingllm import StreamingLLMConfig
from kvcal.runtime.storage.layout import PageLayout, TierFormat, default_page_bytes

KIVI_WINDOW = 64          # recent tokens always fp16
KIVI_GROUP = 32           # tokens per per-channel key group (KIVI's G)
KIVI_ALPHA = EVERY_TOKEN_LOW   # alpha_high: every token that leaves the window goes to the low tier
KIVI_BITS = ((8, 4), (4, 4), (4, 2), (2, 2))   # (key, value) bits of the low tier: the paper's K2V2 and K4V2, and wider

FAMILY_DEFAULTS = {       # used when the bundle's search kept no point for a family (window: the bundle's)
    "rank-only (FDC)": CompressionConfig(high=TierFormat(16, 16), qk_removal_rate=0.04, v_removal_rate=0.04),
    "tiers-only (DiffKV)": CompressionConfig(tiering=TieringConfig(alpha_high=2.0, alpha_low=0.5)),
    "policies-only (FastGen)": CompressionConfig(high=TierFormat(16, 16), fastgen=FastGenConfig(0.95, 0.3, 0.3)),
}


def kivi_config(k_bits: int, v_bits: int, window: int = KIVI_WINDOW, group: int = KIVI_GROUP) -> CompressionConfig:
    """KIVI's layout in the kvcal store, in the model's basis at full rank: an fp16 residual of `window` tokens (plus
    fewer than `group` waiting), every older token in the low tier K{k}cV{v}, keys per channel over `group` tokens."""
    return CompressionConfig(high=TierFormat(16, 16), low=TierFormat(k_bits, v_bits, "channel"), page_tokens=group,
                             use_ranks=False, rotate=False, mix=False,
                             tiering=TieringConfig(window=window, alpha_high=KIVI_ALPHA, alpha_low=0.0))


def with_ranks(bundle: Bundle, config: CompressionConfig) -> Bundle:
    """`bundle` with the ranks of `config`'s removal rates (0: full rank), as the search measured them."""
    qk_rank, v_rank = ranks_of(bundle, config)
    return dataclasses.replace(bundle, qk_rank=qk_rank, v_rank=v_rank)


def _tiers(config: CompressionConfig) -> str:
    p = config.tiering
    if not p.tiered:
        return f"{config.high.name}, no tiers"
    return f"{config.high.name} / {config.low.name}, W={p.window}, a=({p.alpha_high:g},{p.alpha_low:g})"


# --------------------------------------------------------------------------------------------- store methods


def store_methods(bundle: Bundle, serve: ServeOptions | None = None) -> list[Method]:
    """Uniform and KIVI-style quantization, each seed family alone, and kvcal joint (all on the kvcal store, served
    with `serve`, default options when None)."""
    serve = serve or ServeOptions()
    plain = CompressionConfig(use_ranks=False, rotate=False, mix=False)   # model basis, full rank
    out = []
    for bits in (8, 4, 2):
        out.append(Method(f"uniform-k{bits}v{bits}", f"K{bits}V{bits} per-token", "quantization",
                          "uniform per-token", f"every token K{bits}V{bits}, per-token min-max in the model basis",
                          {"high": f"K{bits}V{bits}"}, plain.with_(high=TierFormat(bits, bits)), bundle,
                          serve=serve))
    for k_bits, v_bits in KIVI_BITS:
        cfg = kivi_config(k_bits, v_bits)
        low = cfg.low
        out.append(Method(f"kivi-k{k_bits}v{v_bits}", f"KIVI K{k_bits}V{v_bits}", "quantization", "KIVI-style",
                          f"keys per channel (groups of {KIVI_GROUP} tokens), values per token, fp16 residual of "
                          f"{KIVI_WINDOW} + <{KIVI_GROUP} tokens",
                          {"high": "K16V16", "low": low.name, "window": KIVI_WINDOW, "group": KIVI_GROUP}, cfg, bundle,
                          serve=serve))
    families = (bundle.calibration.get("search") or {}).get("families") or {}
    for name, key, label, series in (("rank-only (FDC)", "fdc-ranks", "FDC ranks only", "FDC ranks"),
                                     ("tiers-only (DiffKV)", "diffkv-tiers", "DiffKV tiers only", "DiffKV tiers"),
                                     ("policies-only (FastGen)", "fastgen", "FastGen policies only", "FastGen")):
        point = families.get(name)
        note = None
        if point is None:
            window = CompressionConfig.from_dict(bundle.settings).tiering.window
            cfg = FAMILY_DEFAULTS[name].with_tiering(window=window)
            settings = cfg.to_dict()
            note = (f"the bundle's calibration search kept no `{name}` point (none met its target or saved bytes); "
                    f"default settings {settings}")
        else:
            settings = dict(point["settings"])
            cfg = CompressionConfig.from_dict(settings)
        desc = _tiers(cfg)
        if cfg.qk_removal_rate or cfg.v_removal_rate:
            desc += f", FDC removal rates qk {cfg.qk_removal_rate:g} / v {cfg.v_removal_rate:g}"
        if cfg.fastgen:
            desc += f", FastGen T={cfg.fastgen.recovery:g}"
        out.append(Method(key, label, "seed", series, desc, settings, cfg, with_ranks(bundle, cfg), note=note,
                          serve=serve))
    out.append(joint_method(bundle, serve))
    return out


def joint_method(bundle: Bundle, serve: ServeOptions | None = None) -> Method:
    serve = serve or ServeOptions()
    cfg = CompressionConfig.from_dict(bundle.settings)
    searched = "search" in bundle.calibration
    note = None if searched else ("the bundle records no searched settings (`kvcal calibrate --no-search`); kvcal "
                                  "joint = the runtime's default settings")
    L, H, d = bundle.shape
    kept = (bundle.qk_rank.sum() + bundle.v_rank.sum()).item() / (2 * L * H * d)
    desc = _tiers(cfg) + (f", FastGen T={cfg.fastgen.recovery:g}" if cfg.fastgen else "") + \
        (f", ranks keep {kept:.3f} of K/V dims" if kept < 1 else "")
    return Method("kvcal-joint", "kvcal joint", "kvcal", "kvcal joint", desc, cfg.to_dict(searched=searched), cfg,
                  bundle, note=note, serve=serve)


def sweep_methods(bundle: Bundle, joint: Method, quick: bool) -> list[Method]:
    """Variants of the joint's tier thresholds (same ranks, tiers and FastGen): more and less aggressive."""
    cfg = joint.config
    p = cfg.tiering
    if p.tiered:
        a_h, a_l = p.alpha_high, p.alpha_low
        highs = {0.5: a_h / 2, 1: a_h, 2: 2 * a_h}
        lows = {0: 0.0, 1: a_l, 2: 2 * a_l} if a_l > 0 else {0: 0.0, 1: 0.25, 2: 0.5}
        grid = [(0.5, 1), (2, 2)] if quick else [(h, lo) for h in highs for lo in lows]
        pairs = [(highs[h], lows[lo]) for h, lo in grid]
    else:     # the joint has no tiers: try tiers at a few thresholds
        pairs = [(1.0, 0.0), (2.0, 0.5)] if quick else [(1.0, 0.0), (2.0, 0.0), (2.0, 0.5), (4.0, 1.0)]
    out, seen = [], {(p.alpha_high, p.alpha_low)}
    for a_h, a_l in pairs:
        a_l = min(a_l, a_h)
        if (a_h, a_l) in seen:
            continue
        seen.add((a_h, a_l))
        variant = cfg.with_tiering(alpha_high=a_h, alpha_low=a_l)
        out.append(Method(f"kvcal-a{a_h:g}-{a_l:g}", f"kvcal a=({a_h:g},{a_l:g})", "kvcal", "kvcal sweep",
                          _tiers(variant), variant.to_dict(), variant, joint.bundle, serve=joint.serve))
    return out


# --------------------------------------------------------------------------------------------- other caches


def cache_methods(model) -> list[Method]:
    """Dense, transformers' QuantizedCache per backend (unavailable ones say why), and TurboQuant-style caches."""
    out = [Method("dense", "dense", "dense", "dense", f"transformers DynamicCache in the model dtype ({model.dtype})",
                  {"dtype": str(model.dtype).removeprefix("torch.")},
                  factory=lambda reserve: caches.DenseCache(config=model.config))]
    for backend, kwargs, label in (("quanto", {"nbits": 4}, "int4"), ("quanto", {"nbits": 2}, "int2"),
                                   ("hqq", {"nbits": 4}, "int4"), ("fp8", {}, "")):
        m = Method(f"hf-{backend}{'-' + label if label else ''}", f"HF QuantizedCache {backend} {label}".strip(),
                   "quantization",
                   "HF QuantizedCache",
                   "transformers QuantizedCache: " + ("per-tensor fp8 (scale frozen at prefill)" if backend == "fp8"
                                                      else "per-channel groups of 64, fp residual of 128 tokens"),
                   {"backend": backend, **kwargs},
                   factory=lambda reserve, b=backend, kw=kwargs: caches.MeasuredQuantizedCache(b, model.config, **kw))
        try:
            m.factory(0)
        except (ImportError, ValueError) as e:
            m.unavailable = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        out.append(m)
    return out + turboquant_methods(model)


EVICTION_STORE = CompressionConfig(high=TierFormat(16, 16), use_ranks=False, rotate=False, mix=False)   # fp16, as is
EVICTION_PAGE_TOKENS = 8  # small pages: a budgeted entry holds at most one partly filled page of slack


def eviction_page_bytes(head_dim: int) -> int:
    return default_page_bytes(head_dim, EVICTION_STORE.high, EVICTION_PAGE_TOKENS)


def eviction_fraction(ratio: float, head_dim: int) -> float:
    """Share of tokens an eviction baseline keeps so that its store holds `ratio` of the fp16 bytes of every token
    seen: an fp16 token is 4 * head_dim bytes, a stored one its page slot (K, V, score and position). Page rounding
    comes on top (a partly filled page per sequence, layer and KV head, plus the slot the newest token takes before
    the policy evicts) and is measured, not budgeted."""
    fmt = EVICTION_STORE.high
    slot = PageLayout.build(fmt, head_dim, head_dim, eviction_page_bytes(head_dim)).bytes_per_token
    return min(1.0, ratio * 4 * head_dim / slot)


def matched_methods(model, adapter, ratio: float, palu: Callable[[], Any], bundle: Bundle,
                    serve: ServeOptions | None = None, shortest_prompt: int = 1 << 30) -> list[Method]:
    """StreamingLLM, H2O, SnapKV (runtime policies on `bundle`'s store), Palu and kvpress's presses budgeted to
    `ratio` of fp16 bytes (kvcal joint's measured ratio). `palu()` returns the PaluFactors (computed on first use);
    `shortest_prompt`: the run's shortest prompt, which some presses need to be long enough. The policies are served
    with `serve` (default options when None) on pages of `EVICTION_PAGE_TOKENS` tokens."""
    serve = serve or ServeOptions()
    f = eviction_fraction(ratio, adapter.head_dim)
    store, pages = EVICTION_STORE, serve.with_(page_bytes=eviction_page_bytes(adapter.head_dim))
    out = [
        Method("streamingllm", "StreamingLLM", "eviction", "StreamingLLM",
               f"4 sink tokens + recent window, {ratio:.3f} of fp16 bytes", {"ratio": ratio, "fraction": f, "sinks": 4},
               store.with_(streamingllm=StreamingLLMConfig(f, sinks=4)), bundle, serve=pages),
        Method("h2o", "H2O", "eviction", "H2O",
               f"heavy hitters + recent (half the budget each), {ratio:.3f} of fp16 bytes",
               {"ratio": ratio, "fraction": f, "recent": "half the budget"}, store.with_(h2o=H2OConfig(f)), bundle,
               serve=pages),
        Method("snapkv", "SnapKV", "eviction", "SnapKV",
               f"observation window 32, avg-pool 7, prompt compressed once, {ratio:.3f} of fp16 bytes",
               {"ratio": ratio, "fraction": f, "window": 32, "kernel": 7},
               store.with_(snapkv=SnapKVConfig(f, window=32, kernel=7)), bundle, serve=pages),
    ]
    d = adapter.head_dim
    rank = max(1, min(d, round(ratio * d)))
    palu_method = Method("palu", "Palu low rank", "low-rank", "Palu",
                         f"pre-RoPE whitened-SVD latents, rank {rank}/{d} for K and V (fp16)",
                         {"rank": rank, "ratio": ratio},
                         factory=lambda reserve: PaluCache(model, palu(), rank, list(adapter.layer_types)),
                         unavailable=unsupported_reason(adapter))
    out.append(palu_method)
    return out + press_methods(model, ratio, shortest_prompt)


def press_methods(model, ratio: float, shortest_prompt: int) -> list[Method]:
    """kvpress's own presses (kvcal.press, the opt-in `[bench]` extra) at `ratio` of fp16 bytes: each compresses the
    prompt once so that the bytes held after the run's decode steps match; unavailable rows say why."""
    from kvcal import press as P

    out = []
    for key, (name, _) in P.PRESSES.items():
        def factory(reserve, key=key):
            from transformers import AttentionInterface

            from kvcal.runtime.hf import KVCAL_IMPL, install, kvcal_attention

            press = P.make_press(key)    # importing kvpress patches every registered attention function (AdaKV masks)
            P.install_press_hook(model, press)
            install(model)
            # only AdaKV masks keys; the others get kvcal's attention function (SDPA for a plain cache) unwrapped
            AttentionInterface.register(KVCAL_IMPL, P.masked_attention(kvcal_attention)
                                        if key == "kvpress-adakv" else kvcal_attention)
            return P.PressedCache(press, ratio=ratio, reserve=reserve, config=model.config)

        note = ("kvpress's AdaKV masks pruned keys instead of freeing them: its bytes are the dense cache's plus the "
                "mask" if key == "kvpress-adakv" else None)
        out.append(Method(key, name, "eviction", name, f"kvpress {P.PRESSES[key][0].split(' ', 1)[1]} press, prompt "
                          f"compressed once, {ratio:.3f} of fp16 bytes at the end of the run",
                          {"ratio": ratio, "library": "kvpress"}, factory=factory,
                          unavailable=P.unavailable(key, shortest_prompt), note=note))
    return out


def select(methods: list[Method], wanted: tuple[str, ...] | None) -> list[Method]:
    """Methods whose key, family or series is in `wanted` (all when None); kvcal joint is always kept."""
    if not wanted:
        return methods
    w = {x.lower() for x in wanted}
    return [m for m in methods if m.key == "kvcal-joint" or {m.key, m.family.lower(), m.series.lower()} & w]
