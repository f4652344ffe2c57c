"""The exact window (`CompressionConfig.exact_window`, kvcal.runtime.exact_window): each paged layer's newest tokens
held at 16 bits outside the pages, read exactly by every query, entering the high tier when they leave the window."""

import pytest
import torch
from conftest import generate_scored, make_model, padded_batch, random_bundle
from transformers import DynamicCache

from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.storage.layout import TierFormat
from kvcal.runtime.storage.pages import HIGH


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.scores, b.scores))


def cache_for(model, tok, cfg, backend="torch", raw_tokens=0):
    return KvcalCache.from_bundle(random_bundle(model, tok), model, cfg, raw_tokens=raw_tokens,
                                  serve=ServeOptions(backend=backend))


def test_a_window_wider_than_the_sequence_reads_every_token_exactly():
    """With a 2-bit high tier and a window wider than prompt and continuation, nothing is ever coded: the decode
    equals the dense one up to the 16-bit rounding of the window, padding included (the shorter prompt's window holds
    17 padding tokens, which no query may see). Without the exact window the same tier is far off."""
    model, tok = make_model("llama")
    inputs = padded_batch(tok)
    ref = generate_scored(model, inputs, DynamicCache(config=model.config), n=12)
    cfg = CompressionConfig.none().with_(rotate=True, high=TierFormat(2, 2), low=TierFormat(2, 2),
                                         tiering=TieringConfig(window=64))
    exact = generate_scored(model, inputs, cache_for(model, tok, cfg.with_(exact_window=True)), n=12)
    coded = generate_scored(model, inputs, cache_for(model, tok, cfg), n=12)
    # fp16 keeps 11 significant bits: the logits of a 2-layer model move by a few 1e-3 at most
    assert max_diff(ref, exact) < 2e-2
    assert max_diff(ref, coded) > 10 * max_diff(ref, exact)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_window_served_exact_equals_a_16_bit_high_tier(backend):
    """A 16-bit high tier stores what the window holds: with DiffKV's tiers (per-channel 4-bit low pages), the same
    tokens take the same tiers with the window outside the pages as inside them, and the logits agree up to float
    order. Tokens leave a window of 4 during the continuation, so the hand-over to the high tier is exercised."""
    model, tok = make_model("llama")
    inputs = padded_batch(tok)
    cfg = CompressionConfig(high=TierFormat(16, 16), tiering=TieringConfig(window=4, alpha_high=1.6), page_tokens=4)
    paged, exact = cache_for(model, tok, cfg, backend), cache_for(model, tok, cfg.with_(exact_window=True), backend)
    a, b = generate_scored(model, inputs, paged, n=12), generate_scored(model, inputs, exact, n=12)
    assert torch.equal(a.sequences, b.sequences)
    assert max_diff(a, b) < 1e-4
    assert paged.kv.tier_counts() == exact.kv.tier_counts()
    assert exact.kv.tier_counts()["low"] > 0
    kv = exact.kv
    b_, h_ = kv.every_entry()
    for layer in kv.layers:          # the window holds the newest 4 positions, the pages only older ones
        assert int(kv.store.section_meta(layer, HIGH, b_, h_)[1].max()) < kv.length[layer] - 4
        assert kv.windows.layers[layer].count == 4


def test_exact_window_memory_is_counted_and_bounded():
    model, tok = make_model("llama")
    cfg = CompressionConfig(high=TierFormat(8, 8), tiering=TieringConfig(window=8, alpha_high=1.6), page_tokens=4,
                            exact_window=True)
    cache = cache_for(model, tok, cfg)
    generate_scored(model, padded_batch(tok), cache, n=6)
    kv = cache.kv
    window = sum(w.keys.numel() * 2 + w.values.numel() * 2 for w in kv.windows.layers.values())
    assert window == 2 * len(kv.layers) * kv.store.num_kv_heads * 8 * (16 + 16) * 2     # B, layers, H, W, r_k+r_v
    mem = cache.memory()
    assert mem["raw_bytes"] == window
    assert mem["held_bytes"] <= mem["fp16_bytes"] + mem["allowance_bytes"]
    cache.release()
    assert cache.memory()["total_bytes"] == 0


def test_crop_cuts_the_window_then_the_pages():
    model, tok = make_model("llama")
    cfg = CompressionConfig.none().with_(high=TierFormat(8, 8), tiering=TieringConfig(window=6), exact_window=True)
    cache = cache_for(model, tok, cfg)
    generate_scored(model, padded_batch(tok), cache, n=4)
    kv = cache.kv
    n_pad, H, L = kv.n_pad, kv.store.num_kv_heads, len(kv.layers)
    for cut, window in ((3, 3), (10, 0)):          # within the window, then past it into the pages
        keep = kv.length[kv.layers[0]] - cut
        kv.crop(keep)
        assert kv.tier_counts()["high"] == int((keep - n_pad).clamp(min=0).sum()) * H * L
        assert all(w.count == window for w in kv.windows.layers.values())


def test_settings_round_trip_and_refusal_with_eviction():
    cfg = CompressionConfig(exact_window=True)
    assert CompressionConfig.from_dict(cfg.to_dict()) == cfg
    assert "exact_window" not in CompressionConfig().to_dict()
    model, tok = make_model("llama")
    from kvcal.runtime.policies.h2o import H2OConfig

    with pytest.raises(ValueError, match="exact window serves DiffKV"):
        cache = cache_for(model, tok, cfg.with_(h2o=H2OConfig(fraction=0.5)))
        generate_scored(model, padded_batch(tok), cache, n=1)
