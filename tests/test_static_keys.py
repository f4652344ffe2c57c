"""Static calibrated per-channel key tiers (`K4sV4`): the clip ranges, the calibration pass, the store's bytes, the
backends that cannot read them, and the bundle tensors that carry them."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, random_bundle

from kvcal.profile.calibrate import CalibrationConfig, calibrate
from kvcal.profile.capture import capturing
from kvcal.profile.key_ranges import KeyRangeCollector, clip_range, spread_windows, tail_rows
from kvcal.runtime.backends import TorchBackend, select_backend
from kvcal.runtime.backends.cpu.backend import CpuBackend
from kvcal.runtime.backends.cuda.emulate import EmulatedCudaBackend
from kvcal.runtime.bundle import BundleError, load_bundle, save_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.storage import quant
from kvcal.runtime.storage.bases import served_bases
from kvcal.runtime.storage.layout import PageLayout, TierFormat
from kvcal.runtime.storage.pages import HIGH, LOW
from kvcal.runtime.storage.store import CompressedStore

STATIC = ("K8sV4", "K4sV4", "K2sV2", "K4sV4g8")


def heavy_tailed(shape, seed=0) -> torch.Tensor:
    """Student-t-like keys with one outlier channel, as qwen2.5's keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) / torch.rand(shape, generator=g).clamp(min=0.05).sqrt()
    x[..., 1] = x[..., 1] * 30 + 40
    return x


# ---------------------------------------------------------------------------------------------- ranges


@pytest.mark.parametrize("percentile", [99.9, 99.0, 95.0, 100.0])
def test_ranges_clip_no_more_than_the_percentile(percentile):
    x = heavy_tailed((3, 4000, 8))                                               # [heads, N, channels]
    low, high = clip_range(x, percentile)
    allowed = tail_rows(4000, percentile)
    assert allowed == math.floor((100 - percentile) / 100 * 4000 + 1e-9)
    above, below = (x > high[:, None]).sum(1), (x < low[:, None]).sum(1)         # [heads, channels]
    assert int(above.max()) <= allowed and int(below.max()) <= allowed
    assert int(above.min()) == allowed or percentile == 100.0                   # ties aside, exactly the tail
    for bits in (2, 4, 8):
        scale, zero = quant.static_scale_zero(low, high, bits)
        s = scale.float()[:, None]
        x_hat = quant.dequantize_static(quant.quantize_static(x, scale[:, None], zero[:, None], bits),
                                        scale[:, None], zero[:, None])
        clipped = (x_hat - x).abs() > s / 2 * (1 + 1e-5) + 1e-6                  # error beyond rounding
        inside = (x >= low[:, None]) & (x <= high[:, None])
        assert not bool((clipped & inside).any()), "the fp16 scale and zero clipped a value inside the range"
        assert int(clipped.sum(1).max()) <= 2 * allowed


def test_static_scale_zero_rounds_outwards():
    low = torch.tensor([1.0001, -3.3333, 0.1, 5.0])
    high = torch.tensor([2.7777, 7.1234, 0.1, 5.0])
    for bits in (2, 4, 8):
        scale, zero = quant.static_scale_zero(low, high, bits)
        assert bool((zero.float() <= low).all())
        assert bool((zero.float() + ((1 << bits) - 1) * scale.float() >= high).all())
    with pytest.raises(ValueError, match="low <= high"):
        quant.static_scale_zero(high, low, 4)
    with pytest.raises(ValueError, match="float16 range"):
        quant.static_scale_zero(torch.tensor([-1e6]), torch.tensor([1.0]), 4)


def test_streaming_collector_equals_the_batch_ranges():
    model, _ = make_model("llama")
    from kvcal.models import adapter_for

    a = adapter_for(model.config)
    L, H, d = a.num_layers, a.num_kv_heads, a.head_dim
    R = torch.linalg.qr(torch.randn(L, H, d, d, dtype=torch.float64))[0].float()
    keys = heavy_tailed((5, L, H, 37, d), seed=1)                               # 5 batches of 37 tokens
    col = KeyRangeCollector(a, R, 5 * 37, 99.0)
    for chunk in keys:
        for layer in range(L):
            col.add(layer, None, chunk[layer][None], None)
    low, high = col.ranges()
    rotated = torch.einsum("nlhsd,lhde->lhnse", keys, R).reshape(L, H, 5 * 37, d)
    want_low, want_high = clip_range(rotated, 99.0)
    torch.testing.assert_close(low, want_low, rtol=0, atol=1e-5)
    torch.testing.assert_close(high, want_high, rtol=0, atol=1e-5)
    short = KeyRangeCollector(a, R, 1000, 99.0)
    with pytest.raises(ValueError, match="saw 0 rows, expected 1000"):
        short.ranges()


def test_calibration_ranges_clip_no_more_than_the_percentile(tiny_dir, text_file, tmp_path):
    """The bundle's ranges, checked against the calibration keys they were fitted on, captured afresh."""
    out = tmp_path / "static.kvcal.safetensors"
    cfg = CalibrationConfig(model=str(tiny_dir), out=out, random_tokens=128, text_tokens=512, seq_len=64,
                            dataset=str(text_file), dtype="float32", search=False, key_percentile=99.0,
                            key_range_windows=3)
    res = calibrate(cfg)
    bundle = load_bundle(out)
    low, high = bundle.extras["k.range_low"], bundle.extras["k.range_high"]
    info = bundle.calibration["key_ranges"]
    assert info["percentile"] == 99.0 and info["rows"] == 3 * 64 and info["tail_rows"] == 1
    from kvcal.data import load_corpus, token_windows
    from kvcal.models import load_model

    lm = load_model(str(tiny_dir), dtype="float32")
    ids = token_windows(lm.tokenizer, load_corpus(str(text_file), "calib"), 8, 64, 0)[spread_windows(8, 3)]
    assert spread_windows(8, 3) == [0, 4, 7] and spread_windows(8, 1) == [0] and spread_windows(2, 4) == [0, 1]
    seen = []

    class Keys:
        def add(self, layer, query, key, value):
            seen.append((layer, torch.einsum("bhsd,hde->hbse", key.float(), bundle.qk_rotation[layer])))

    offsets = info["text_offsets"]
    with torch.no_grad(), capturing(lm.model, Keys()):
        for i in range(3):
            lm.model(input_ids=ids[i][None], position_ids=torch.arange(offsets[i], offsets[i] + 64)[None])
    for layer in range(bundle.shape[0]):
        k = torch.cat([kr.reshape(kr.shape[0], -1, kr.shape[-1]) for li, kr in seen if li == layer], 1)   # [H, N, d]
        assert k.shape[1] == 3 * 64
        above = (k > high[layer][:, None] + 1e-5).sum(1)
        below = (k < low[layer][:, None] - 1e-5).sum(1)
        assert int(above.max()) <= 1 and int(below.max()) <= 1
    assert res.bundle.extras["k.range_low"].shape == bundle.qk_spectrum.shape


def test_ranges_from_the_text_pass_captures_equal_those_of_their_own_pass(tiny_dir, text_file):
    """`calibrate` reads the key-range windows' queries and keys from the text pass (`QueryKeyTap`) instead of
    running them again: the ranges and smoothing factors are those of the pass, bit for bit. A tap that missed a
    window (a resumed text pass) gives nothing, so the pass runs."""
    from kvcal.data import load_corpus, position_offsets, token_windows
    from kvcal.models import load_model
    from kvcal.profile.capture import GramCollector
    from kvcal.profile.passes import QueryKeyTap, key_range_pass, run_pass

    lm = load_model(str(tiny_dir), dtype="float32")
    ids = token_windows(lm.tokenizer, load_corpus(str(text_file), "calib"), 5, 64, 0)
    offsets = position_offsets(5, 64, 512)
    picked = spread_windows(5, 3)
    tap = QueryKeyTap(picked)
    run_pass(lm, "calibration-text", ids, offsets, GramCollector(lm.adapter), tap=tap)
    captured = tap.captured(picked)
    assert captured is not None and len(captured) == 3 and all(len(c) == lm.adapter.num_layers for c in captured)
    R = torch.linalg.qr(torch.randn(lm.adapter.num_layers, lm.adapter.num_kv_heads, 16, 16,
                                    generator=torch.Generator().manual_seed(0)))[0]
    args = (lm, R, ids[picked], [offsets[i] for i in picked], 99.0)
    for own, tapped in zip(key_range_pass(*args), key_range_pass(*args, captured=captured), strict=True):
        assert torch.equal(own, tapped)
    assert tap.captured([*picked, 1]) is None                  # window 1 was not kept
    resumed = QueryKeyTap(picked)
    resumed.start(picked[0])                                 # a text pass that ran only its first window
    resumed.add(0, *captured[0][0], None)
    assert resumed.captured(picked) is None


# ---------------------------------------------------------------------------------------------- store


def _ranges(L, H, d, seed=0):
    keys = heavy_tailed((L, H, 2000, d), seed=seed)
    return clip_range(keys, 99.9), keys


@pytest.mark.parametrize("fmt", STATIC)
@pytest.mark.parametrize("side", [HIGH, LOW])
def test_static_formats_round_trip_through_the_store(fmt, side):
    """Bytes written by the torch store and read back by `gather` and `read` are the static quantizer's, exactly,
    for both rank groups; pages hold no key meta, so a token costs its codes only."""
    H, d = 2, 16
    ranks_k, ranks_v = torch.tensor([[16, 8]]), torch.tensor([[16, 8]])
    (low, high), keys_all = _ranges(1, H, d)
    f = TierFormat.parse(fmt)
    high_fmt, low_fmt = (f, TierFormat.parse("K4V2")) if side == HIGH else (TierFormat.parse("K8V4"), f)
    store = CompressedStore(ranks_k, ranks_v, [0], high=high_fmt, low=low_fmt, head_dim=d, batch=2, page_bytes=512,
                            initial_pages=2, initial_tokens=8, key_ranges=(low, high))
    lay = store.groups[0][1].layouts[side]                                      # the full-rank group
    assert lay.k_groups == 0 and lay.v_off - lay.k_off == -(-lay.tokens * lay.k_bytes // 16) * 16
    n = 45
    b, h = torch.arange(2).repeat_interleave(H * n), torch.arange(H).repeat_interleave(n).repeat(2)
    keys = torch.cat([keys_all[0, hi, :n] for hi in range(H)]).repeat(2, 1)      # [2 * H * n, d], outliers included
    values = torch.randn(len(b), d)
    store.append(0, side, b, h, keys, values, torch.arange(n).repeat(2 * H), torch.rand(len(b)))
    got = store.gather(0)
    for bi in range(2):
        for hi in range(H):
            sel = (b == bi) & (h == hi)
            r = int(ranks_k[0, hi])
            scale, zero = quant.static_scale_zero(low[0, hi, :r], high[0, hi, :r], f.k_bits)
            want = quant.dequantize_static(quant.quantize_static(keys[sel, :r], scale, zero, f.k_bits), scale, zero)
            live = got.pos[bi, hi] >= 0
            assert torch.equal(got.keys[bi, hi][live][:, :r], want)
            assert (got.keys[bi, hi, :, r:] == 0).all()
            v_codes, v_s, v_z = quant.quantize_per_token(values[sel, :r], f.v_bits, f.v_group)
            assert torch.equal(got.values[bi, hi][live][:, :r], quant.dequantize_per_token(v_codes, v_s, v_z,
                                                                                           f.v_group))
            k, _, _, pos = store.read(0, side, torch.tensor([bi, bi]), torch.tensor([hi, hi]), torch.tensor([0, 7]))
            assert torch.equal(k[:, :r], want[[0, 7]]) and pos.tolist() == [0, 7]
    assert store.static_key_bytes() == 4 * (16 + 8)         # fp16 scale + zero per stored key channel, one tier


def test_static_low_tier_keeps_outlier_channels_where_per_token_keys_lose_them():
    H, d = 1, 16
    (low, high), keys_all = _ranges(1, H, d, seed=2)
    keys = keys_all[0, 0, :200]
    err = {}
    for fmt in ("K4V4", "K4sV4"):
        store = CompressedStore(torch.tensor([[d]]), torch.tensor([[d]]), [0], high=TierFormat.parse(fmt),
                                low=TierFormat.parse("K4V2"), head_dim=d, batch=1, key_ranges=(low, high))
        store.append(0, HIGH, torch.zeros(200, dtype=torch.long), torch.zeros(200, dtype=torch.long), keys,
                     torch.randn(200, d), torch.arange(200), torch.zeros(200))
        normal = [c for c in range(d) if c != 1]
        err[fmt] = float((store.gather(0).keys[0, 0, :200, normal] - keys[:, normal]).abs().mean())
    assert err["K4sV4"] < 0.5 * err["K4V4"]


def test_missing_or_wrong_ranges_are_refused_in_one_line():
    f = TierFormat.parse("K4sV4")
    with pytest.raises(ValueError, match=r"K4sV4 needs calibrated static key ranges.*kvcal calibrate") as e:
        CompressedStore(torch.tensor([[8]]), torch.tensor([[8]]), [0], high=f, low=f, head_dim=8, batch=1)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"needs two of \[1, 1, >= 8\]"):
        CompressedStore(torch.tensor([[8]]), torch.tensor([[8]]), [0], high=f, low=f, head_dim=8, batch=1,
                        key_ranges=(torch.zeros(1, 1, 4), torch.ones(1, 1, 4)))


def test_format_names_parse_and_layout_has_no_key_meta():
    f = TierFormat.parse("K4sV2g8")
    assert (f.k_bits, f.v_bits, f.k_mode, f.v_group) == (4, 2, "static", 8) and f.name == "K4sV2g8"
    assert TierFormat.parse(f.name) == f
    with pytest.raises(ValueError, match="quantized keys"):
        TierFormat(16, 16, "static")
    with pytest.raises(ValueError, match="one scale per channel"):
        TierFormat.parse("K4sV4kg8")
    per_token, static = (PageLayout.build(TierFormat.parse(n), 64, 64, 4096) for n in ("K4V4", "K4sV4"))
    assert static.k_groups == 0 and static.v_off == static.k_meta_off          # no key meta segment
    assert per_token.k_groups == 1 and static.tokens > per_token.tokens        # the same page holds more tokens


# ---------------------------------------------------------------------------------------------- backends


def test_fused_backends_declare_static_keys_unsupported():
    formats = (TierFormat.parse("K4sV4"), TierFormat.parse("K4cV2"))
    for backend in (CpuBackend, EmulatedCudaBackend):
        reasons = backend.supports_formats(formats, 64)
        assert len(reasons) == 1 and "K4sV4" in reasons[0] and "static" in reasons[0]
        assert backend.supports_formats((TierFormat.parse("K4V4"), TierFormat.parse("K4cV2")), 64) == []
    select_backend.cache_clear()
    assert select_backend("auto", "cpu", formats, 64) is TorchBackend
    with pytest.raises(ValueError, match="attention backend `cpu` cannot run on cpu: K4sV4"):
        select_backend("cpu", "cpu", formats, 64)


# ---------------------------------------------------------------------------------------------- serving


def _bundle_with_ranges(model, tok, percentile=99.9):
    """A random bundle whose key ranges are fitted on the model's own keys (random words) in R's columns."""
    from kvcal.models import adapter_for

    bundle = random_bundle(model, tok, seed=1)
    a = adapter_for(model.config)
    ids = torch.randint(3, len(tok), (4, 64), generator=torch.Generator().manual_seed(0))
    col = KeyRangeCollector(a, bundle.qk_rotation, ids.numel(), percentile)
    with torch.no_grad(), capturing(model, col):
        model(input_ids=ids)
    low, high = col.ranges()
    bundle.extras.update({"k.range_low": low, "k.range_high": high})
    return bundle


def test_static_keys_serve_close_to_dense_and_bytes_are_counted_apart():
    model, tok = make_model("llama")
    bundle = _bundle_with_ranges(model, tok)
    ids = torch.randint(3, len(tok), (2, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    out = {}
    for name in ("K8sV8", "K8V8"):
        config = CompressionConfig(high=TierFormat.parse(name), use_ranks=False).with_tiering(alpha_high=None)
        # raw_tokens=0: 48 tokens would stay in the raw phase, and the bytes compared are the pages'
        cache = KvcalCache.from_bundle(bundle, model, config, tokenizer=tok, raw_tokens=0)
        with torch.no_grad():
            logits = [model(input_ids=ids[:, :32], cache=cache, use_cache=True).logits]
            for t in range(32, 48):
                logits.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits)
        out[name] = (torch.cat(logits, 1), cache.memory(), cache.kv.backend)
    logits, mem, backend = out["K8sV8"]
    assert backend is TorchBackend
    assert (logits - dense).abs().max() < 0.05
    H, d = bundle.model.num_kv_heads, bundle.model.head_dim
    assert mem["fixed_bytes"] == 4 * bundle.model.num_layers * H * d
    assert mem["total_bytes"] == mem["paged_bytes"] < out["K8V8"][1]["total_bytes"]   # no per-token key meta
    assert out["K8V8"][1]["fixed_bytes"] == 0


def test_static_keys_need_ranges_and_the_rotated_basis():
    model, tok = make_model("llama")
    ids = torch.randint(3, len(tok), (1, 8))
    config = CompressionConfig(high=TierFormat.parse("K4sV4"))
    cache = KvcalCache.from_bundle(random_bundle(model, tok), model, config)
    with pytest.raises(ValueError, match="K4sV4 needs calibrated static key ranges"), torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    cache = KvcalCache.from_bundle(_bundle_with_ranges(model, tok), model, config.with_(rotate=False))
    with pytest.raises(ValueError, match="rotated basis"), torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)


def test_static_keys_are_served_in_the_unmixed_rotation():
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok, rank_k=torch.tensor([[16, 8], [12, 16]], dtype=torch.int32))
    static = CompressionConfig(high=TierFormat.parse("K4sV4"))
    _, _, rot, basis, _ = served_bases(bundle.qk_rotation, bundle.v_basis, bundle.qk_rank, bundle.v_rank, static)
    _, _, rot_mixed, basis_mixed, _ = served_bases(bundle.qk_rotation, bundle.v_basis, bundle.qk_rank, bundle.v_rank,
                                                CompressionConfig())
    assert torch.equal(rot[0, 1, :, :8], bundle.qk_rotation[0, 1, :, :8]) and (rot[0, 1, :, 8:] == 0).all()
    assert not torch.allclose(rot_mixed[0, 1, :, :8], bundle.qk_rotation[0, 1, :, :8])
    assert torch.equal(basis, basis_mixed)                                     # values are mixed as before


def test_tiered_static_low_tier_serves():
    """Per-token high tier over a static low tier: tokens leave the window one at a time (no page grouping)."""
    model, tok = make_model("llama")
    bundle = _bundle_with_ranges(model, tok)
    config = CompressionConfig(high=TierFormat.parse("K8V4"), low=TierFormat.parse("K4sV2"),
                               tiering=TieringConfig(window=8, alpha_high=2.0, alpha_low=0.0))
    cache = KvcalCache.from_bundle(bundle, model, config, tokenizer=tok)
    ids = torch.randint(3, len(tok), (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=ids[:, :32], cache=cache, use_cache=True)
        for t in range(32, 40):
            model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    counts = cache.kv.tier_counts()
    assert counts["low"] > 0 and counts["high"] + counts["low"] <= 2 * 40 * 2 * 2
    assert cache.memory()["fixed_bytes"] == 4 * 2 * 2 * 16                     # the low tier only


# ---------------------------------------------------------------------------------------------- bundle


def test_bundle_with_key_ranges_saves_loads_and_validates(tmp_path):
    model, tok = make_model("llama")
    bundle = _bundle_with_ranges(model, tok)
    path = save_bundle(bundle, tmp_path / "v2.kvcal.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.metadata()["schema_version"] == "2"
    again = load_bundle(path)
    for name in ("k.range_low", "k.range_high"):
        assert torch.equal(again.extras[name], bundle.extras[name])
    plain = save_bundle(random_bundle(model, tok), tmp_path / "v1.kvcal.safetensors")
    with safe_open(str(plain), "pt") as f:
        assert f.metadata()["schema_version"] == "1"                          # readable by v1-only kvcal

    def refused(extras, match):
        b = random_bundle(model, tok)
        b.extras.update(extras)
        with pytest.raises(BundleError, match=match) as e:
            save_bundle(b, tmp_path / "bad.kvcal.safetensors")
        assert "\n" not in str(e.value)

    low, high = bundle.extras["k.range_low"], bundle.extras["k.range_high"]
    refused({"k.range_low": low[:, :, :8], "k.range_high": high[:, :, :8]},
            r"tensor `k.range_low` has shape \[2, 2, 8\], expected \[2, 2, 16\] \[L, H, d\]")
    refused({"k.range_low": low}, "`k.range_low` without `k.range_high`")
    refused({"k.range_low": high + 1, "k.range_high": high}, "exceeds `k.range_high`")
    refused({"k.range_low": low, "k.range_high": high.double()}, "dtype")
    refused({"k.range_low": low, "k.range_high": high * 1e6}, "outside")


def test_bundle_file_with_bad_key_ranges_is_refused_on_load(tmp_path):
    """The reader's checks, on a file written around save_bundle's: a wrong shape, and ranges in a schema-1 file."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model, tok = make_model("llama")
    good = save_bundle(_bundle_with_ranges(model, tok), tmp_path / "good.kvcal.safetensors")
    with safe_open(str(good), "pt") as f:
        meta = f.metadata()
    tensors = load_file(good)
    bad = dict(tensors, **{"k.range_low": tensors["k.range_low"][..., :4].contiguous()})
    save_file(bad, str(tmp_path / "shape.kvcal.safetensors"), metadata=meta)
    with pytest.raises(BundleError, match=r"`k.range_low` has shape \[2, 2, 4\].*recalibrate") as e:
        load_bundle(tmp_path / "shape.kvcal.safetensors")
    assert "\n" not in str(e.value)
    from kvcal.runtime.bundle import METADATA_HASH, _metadata_hash

    v1 = dict(meta, schema_version="1")
    v1[METADATA_HASH] = _metadata_hash(v1)                     # a consistent file, only its version is wrong
    save_file(tensors, str(tmp_path / "v1.kvcal.safetensors"), metadata=v1)
    with pytest.raises(BundleError, match="schema version 1 cannot hold static key ranges"):
        load_bundle(tmp_path / "v1.kvcal.safetensors")

