"""The TurboQuant-style bench baseline (kvcal.bench.turboquant): its Lloyd-Max codebook, the quantizer's round trip,
the cache's bytes and its generation on tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model

from kvcal.bench.turboquant import (
    TURBOQUANT_BITS,
    TurboQuantCache,
    TurboQuantizer,
    lloyd_max,
    random_rotation,
    turboquant_methods,
)
from kvcal.runtime.storage.quant import packed_size

# --------------------------------------------------------------------------------------------- codebook


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_codebook_is_sorted_symmetric_and_improves_with_bits(dim):
    mses = {}
    for bits in TURBOQUANT_BITS:
        cb = lloyd_max(dim, bits)
        assert cb.levels.shape == (1 << bits,) and cb.thresholds.shape == ((1 << bits) - 1,)
        assert bool((cb.levels.diff() > 0).all())
        assert torch.allclose(cb.levels, -cb.levels.flip(0), atol=1e-12)
        assert torch.allclose(cb.thresholds, (cb.levels[1:] + cb.levels[:-1]) / 2)
        assert float(cb.levels.abs().max()) < 1                     # inside the support of a unit vector's coordinate
        mses[bits] = cb.mse
    errors = [mses[b] for b in sorted(mses)]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    # each extra bit removes at least ~6 dB of error once past 1 bit (Lloyd-Max on a smooth density)
    assert mses[3] < mses[2] / 4 * 1.5 and mses[4] < mses[2] / 4 ** 2 * 1.5 and mses[8] < mses[4] / 4 ** 4 * 1.5


def test_codebook_at_dim_3_is_the_uniform_quantizer():
    """In 3 dimensions a unit vector's coordinate is uniform on [-1, 1] (Archimedes), whose Lloyd-Max quantizer is
    the uniform one: levels at the centres of 2^b equal cells, error (2 / 2^b)^2 / 12."""
    for bits in (1, 2, 4):
        n = 1 << bits
        cb = lloyd_max(3, bits)
        want = -1 + (2 * torch.arange(n, dtype=torch.float64) + 1) / n
        assert torch.allclose(cb.levels, want, atol=1e-4)
        assert cb.mse == pytest.approx((2 / n) ** 2 / 12, rel=1e-3)


def test_codebook_scaled_by_sqrt_dim_tends_to_the_gaussian_lloyd_max():
    """sqrt(d) times the coordinate tends to N(0, 1): 2-bit Lloyd-Max for N(0, 1) has levels ±0.4528, ±1.510 and
    error 0.1175; 1-bit ±0.7979 and 0.3634. Small d sits visibly away from them, large d on them."""
    gauss = {1: ([0.7979], 0.3634), 2: ([0.4528, 1.5104], 0.1175)}
    for bits, (levels, mse) in gauss.items():
        big = lloyd_max(4096, bits)
        half = big.levels[1 << (bits - 1):] * math.sqrt(4096)
        assert torch.allclose(half, torch.tensor(levels, dtype=torch.float64), atol=2e-3)
        assert big.mse * 4096 == pytest.approx(mse, rel=5e-3)
        small = lloyd_max(16, bits)
        assert abs(small.mse * 16 - mse) > 5 * abs(big.mse * 4096 - mse)


def test_codebook_rejects_bits_the_packer_cannot_store():
    with pytest.raises(ValueError, match="must be one of"):
        lloyd_max(64, 5)


# --------------------------------------------------------------------------------------------- quantizer


def test_rotation_is_orthogonal_and_seeded():
    r = random_rotation(32, seed=1)
    assert torch.allclose(r @ r.T, torch.eye(32), atol=1e-5)
    assert torch.equal(r, random_rotation(32, seed=1))
    assert not torch.allclose(r, random_rotation(32, seed=2))


def _anisotropic(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Vectors like real keys: channel scales spread over 3 decades, one outlier channel, a mean offset."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1.5, 1.5, d)
    x = torch.randn(n, d, generator=g) * scale + 0.5
    x[:, 3] += 40
    return x


@pytest.mark.parametrize("bits,bound", [(1, 0.85), (2, 0.55), (4, 0.25), (8, 0.025)])
def test_round_trip_error_shrinks_with_bits_and_matches_the_codebook(bits, bound):
    d = 64
    q = TurboQuantizer(d)
    x = _anisotropic(2000, d)
    codes, norm = q.quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (2000, packed_size(d, bits))
    assert norm.dtype == torch.float16 and norm.shape == (2000, 1)
    rel = (q.dequantize(codes, norm, bits) - x).norm(dim=-1) / x.norm(dim=-1)
    assert float(rel.max()) < bound
    # the rotation makes the error independent of x's shape: its mean square is the codebook's d * mse
    assert float((rel ** 2).mean()) == pytest.approx(lloyd_max(d, bits).mse * d, rel=0.1)


def test_zero_vector_round_trips_to_zero():
    q = TurboQuantizer(16)
    codes, norm = q.quantize(torch.zeros(3, 16), 4)
    assert torch.equal(q.dequantize(codes, norm, 4), torch.zeros(3, 16))


# --------------------------------------------------------------------------------------------- cache


def _run(model, cache, ids, prefill):
    """Prefill ids[:, :prefill], then one token at a time; logits [B, steps, V] of the decode steps."""
    model(input_ids=ids[:, :prefill], cache=cache, use_cache=True)
    out = [model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1]
           for t in range(prefill, ids.shape[1])]
    return torch.stack(out, 1)


@torch.inference_mode()
@pytest.mark.parametrize("k_bits,v_bits,window", [(4, 2, 0), (2, 2, 0), (8, 4, 8), (2, 2, 64)])
def test_memory_is_codes_plus_norms_plus_window(k_bits, v_bits, window):
    model, tok = make_model("llama")
    L, H, d, B, n = 2, 2, 16, 2, 40                  # the tiny llama of conftest: 2 layers, 2 KV heads, d = 16
    cache = TurboQuantCache(TurboQuantizer(d), k_bits, v_bits, ["full_attention"] * L, window=window)
    _run(model, cache, torch.randint(3, len(tok), (B, n)), 30)
    assert cache.get_seq_length() == n
    recent = min(n, window)
    per_quantized = packed_size(d, k_bits) + packed_size(d, v_bits) + 2 + 2
    want = L * B * H * ((n - recent) * per_quantized + recent * d * 2 * 2)
    mem = cache.memory()
    assert mem["total_bytes"] == want
    assert mem["fp16_bytes"] == L * B * H * n * d * 2 * 2
    assert mem["ratio_to_fp16"] == pytest.approx(want / mem["fp16_bytes"])
    books = sum(2 * (1 << b) - 1 for b in {k_bits, v_bits})
    assert mem["fixed_bytes"] == d * d * 4 + books * 4                # R and codebooks, float32, not per token
    for layer in cache.layers:                      # nothing else is held: codes uint8, norms fp16, window fp16
        assert {layer.codes_k.dtype, layer.codes_v.dtype} == {torch.uint8}
        assert {layer.norm_k.dtype, layer.norm_v.dtype, layer.tail_k.dtype} == {torch.float16}
        assert layer.codes_k.shape[2] == n - recent and layer.tail_k.shape[2] == recent


@torch.inference_mode()
def test_gemma3_sliding_layers_stay_dense():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model, tok = make_model("gemma3_text")                 # layers: sliding, sliding, full; 1 KV head, d = 32
    (m,) = [m for m in turboquant_methods(model) if m.key == "turboquant-k4v4"]
    cache = m.make_cache(model, tok)
    ids = torch.randint(3, len(tok), (1, 40))
    _run(model, cache, ids, 30)
    assert [isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers] == [True, True, False]
    sliding = cache.layers[0].keys.shape[2]
    assert sliding < 40                                     # the window (16) bounds the dense layers
    dense = 2 * sliding * 32 * 2 * 2                         # two sliding layers, counted at 16 bits as served
    assert cache.memory()["total_bytes"] == dense + 40 * (16 + 16 + 4)
    assert cache.memory()["fp16_bytes"] == 2 * sliding * 32 * 2 * 2 + 40 * 32 * 2 * 2


@torch.inference_mode()
def test_generation_tracks_dense_more_closely_with_more_bits():
    from transformers import DynamicCache

    model, tok = make_model("llama", seed=3)
    ids = torch.randint(3, len(tok), (2, 48))
    dense = _run(model, DynamicCache(config=model.config), ids, 32).log_softmax(-1)
    q = TurboQuantizer(16)
    kl, top1 = {}, {}
    for bits in (8, 4, 2):
        got = _run(model, TurboQuantCache(q, bits, bits, ["full_attention"] * 2), ids, 32).log_softmax(-1)
        kl[bits] = float((dense.exp() * (dense - got)).sum(-1).mean())
        top1[bits] = float((dense.argmax(-1) == got.argmax(-1)).float().mean())
    assert kl[8] < kl[4] < kl[2]
    assert kl[8] < 1e-4 and top1[8] >= 0.95
    # `generate` drives the cache too; a random tiny model's greedy path has near ties, so only the first new
    # token (decided on the dequantised prompt) is compared with dense
    cache = TurboQuantCache(q, 8, 8, ["full_attention"] * 2)
    out = model.generate(ids[:1, :20], cache=cache, max_new_tokens=8, do_sample=False)
    want = model.generate(ids[:1, :20], max_new_tokens=1, do_sample=False)
    assert out.shape == (1, 28) and cache.get_seq_length() == 27 and torch.equal(out[:, :21], want)


def test_methods_are_quantization_baselines_with_no_calibration():
    model, _ = make_model("llama")
    methods = turboquant_methods(model)
    assert [m.key for m in methods] == ["turboquant-k4v4", "turboquant-k3v3", "turboquant-k4v2", "turboquant-k2v2",
                                        "turboquant-k2v2-w64"]
    assert {(m.family, m.series) for m in methods} == {("quantization", "TurboQuant-style")}
    assert all(m.config is None and m.factory is not None and not m.unavailable for m in methods)
    with pytest.raises(ValueError, match="must be one of"):
        TurboQuantCache(TurboQuantizer(16), 5, 2, ["full_attention"])
