"""Channel smoothing (kvcal.profile.smoothing, `CompressionConfig.smooth`): q·k unchanged to fp32 precision through
the served bases, the runtime and sliding layers; the factors balance keys and queries; the bundle tensor and the
settings are validated."""

import dataclasses

import pytest
import torch
from conftest import decode_logits, make_model, random_bundle, random_text

from kvcal.profile.capture import capturing
from kvcal.profile.smoothing import QueryAbsMax, smoothing_factors
from kvcal.runtime.bundle import BundleError, load_bundle, save_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.storage.bases import served_bases
from kvcal.runtime.storage.layout import TierFormat

pytestmark = pytest.mark.usefixtures("one_thread")
RAW = CompressionConfig(high=TierFormat(32, 32), low=TierFormat(32, 32), use_ranks=False)


def _smoothing(L, H, d, seed=0, spread=0.5):
    """Log-normal factors, about e^±1 (e^±2 at the extremes), the range calibration gives on real models."""
    return (spread * torch.randn(L, H, d, generator=torch.Generator().manual_seed(seed))).exp()


@pytest.mark.parametrize("ranks", ["full", "cut"])
def test_qk_is_unchanged_to_fp32_precision_through_the_served_bases(ranks):
    model, tok = make_model("llama")
    rank = torch.tensor([[16, 9], [12, 16]], dtype=torch.int32) if ranks == "cut" else None
    bundle = random_bundle(model, tok, rank_k=rank)
    L, H, d = bundle.shape
    D = _smoothing(L, H, d)
    config = CompressionConfig(smooth=True)
    plain = served_bases(bundle.qk_rotation, bundle.v_basis, bundle.qk_rank, bundle.v_rank, config.with_(smooth=False))
    smooth = served_bases(bundle.qk_rotation, bundle.v_basis, bundle.qk_rank, bundle.v_rank, config, D)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(L, H, 7, d, generator=g), torch.randn(L, H, 11, d, generator=g)
    want = q @ plain.rotation @ (k @ plain.rotation).transpose(-1, -2)      # what the runtime serves unsmoothed
    got = q @ smooth.query_rotation @ (k @ smooth.rotation).transpose(-1, -2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert not torch.allclose(smooth.rotation, plain.rotation)          # the stored keys did change
    if ranks == "full":                                                    # and at full rank that is q·k itself
        torch.testing.assert_close(got, q @ k.transpose(-1, -2), rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert torch.equal(smooth.basis, plain.basis) and torch.equal(smooth.rank_k, plain.rank_k)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_raw_store_with_smoothing_serves_the_dense_logits(model_type):
    """fp32 tiers: smoothing, like the rotation, may change the stored bytes and nothing the model computes
    (on Gemma3 the sliding layers store 8-bit rows, so they keep their own rounding)."""
    model, tok = make_model(model_type)
    bundle = random_bundle(model, tok)
    bundle.extras["qk.smoothing"] = _smoothing(*bundle.shape)
    ids = tok([random_text(40, seed=3)], return_tensors="pt").input_ids[:, :32]
    sliding = TierFormat.parse("K8V8") if model_type == "gemma3_text" else None
    logits = {smooth: decode_logits(model, KvcalCache.from_bundle(bundle, model, RAW.with_(smooth=smooth,
                                                                                           sliding=sliding)), ids, 24)
              for smooth in (False, True)}
    if sliding is None:
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
    else:                      # 8-bit sliding rows round differently in the smoothed basis: near, not equal
        p, q = (torch.log_softmax(logits[s], -1) for s in (False, True))
        assert float((p.exp() * (p - q)).sum(-1).max()) < 1e-3


def test_a_sliding_layer_reads_smoothed_keys_back_in_the_model_basis():
    """Keys stored through R D⁻¹ M come back through (R D M)ᵀ, their inverse."""
    from kvcal.runtime.hf.sliding import QuantizedSlidingLayer

    H, d = 2, 32
    g = torch.Generator().manual_seed(0)
    R = torch.linalg.qr(torch.randn(H, d, d, generator=g))[0]
    D = _smoothing(1, H, d)[0]
    config = CompressionConfig(smooth=True)
    rank = torch.full((1, H), d, dtype=torch.int32)
    _, _, rot, basis, query_rot = served_bases(R[None], R[None], rank, rank, config, D[None])
    layer = QuantizedSlidingLayer(64, TierFormat.parse("K8V8"), rot[0], basis[0], query_rot[0])
    keys = torch.randn(1, H, 10, d, generator=g)
    layer.update(keys, keys.clone())
    back, _ = layer.update(keys[:, :, :1], keys[:, :, :1])
    err = (back[:, :, :10] - keys).norm() / keys.norm()
    assert err < 0.02                     # 8-bit codes; a wrong inverse leaves errors of order 1


def test_factors_balance_each_columns_key_and_query_range():
    g = torch.Generator().manual_seed(0)
    k = torch.rand(3, 2, 16, generator=g) * torch.tensor([50.0] + [1.0] * 15)      # one outlier key channel
    q = torch.rand(3, 2, 16, generator=g) + 0.5
    D = smoothing_factors(k, q)
    assert (D > 0).all()
    torch.testing.assert_close(D.log().mean(-1), torch.zeros(3, 2), atol=1e-5, rtol=0)    # geometric mean 1
    balance = (k / D) / (q * D)                     # after smoothing: the same key/query range ratio everywhere
    torch.testing.assert_close(balance, balance[..., :1].expand_as(balance), rtol=1e-4, atol=0)
    assert bool((D[..., 0] > D[..., 1:].max(-1).values).all())     # the outlier channel is shrunk most


def test_the_collectors_keep_each_columns_largest_rotated_key_and_query():
    """The keys' side from the key-range collector's extremes, the queries' from `QueryAbsMax`, fed by one pass."""
    from kvcal.models import adapter_for
    from kvcal.profile.capture import CollectorSet
    from kvcal.profile.key_ranges import KeyRangeCollector

    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    a = adapter_for(model.config)
    ids = tok([random_text(30, seed=4)], return_tensors="pt").input_ids
    ranges = KeyRangeCollector(a, bundle.qk_rotation, ids.numel(), 99.0)
    queries = QueryAbsMax(a, bundle.qk_rotation)
    seen = []

    class Keep:
        def add(self, layer, query, key, value):
            seen.append((layer, query.clone(), key.clone()))

    with torch.no_grad(), capturing(model, CollectorSet(ranges=ranges, queries=queries), Keep()):
        model(input_ids=ids)
    for layer, query, key in seen:
        B, Hq, S, d = query.shape
        H = key.shape[1]
        R = bundle.qk_rotation[layer]
        k = torch.einsum("bhsd,hde->hbse", key.float(), R).abs().amax(dim=(1, 2))
        q = torch.einsum("bhgsd,hde->hbgse", query.float().reshape(B, H, Hq // H, S, d), R).abs().amax(dim=(1, 2, 3))
        torch.testing.assert_close(ranges.absmax()[layer], k)
        torch.testing.assert_close(queries.q[layer], q)


def test_the_bundle_holds_smoothing_as_schema_2_and_refuses_bad_factors(tmp_path):
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    bundle.extras["qk.smoothing"] = _smoothing(*bundle.shape)
    save_bundle(bundle, tmp_path / "b.kvcal.safetensors")
    back = load_bundle(tmp_path / "b.kvcal.safetensors")
    assert torch.equal(back.extras["qk.smoothing"], bundle.extras["qk.smoothing"])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "b.kvcal.safetensors"), framework="pt") as f:
        assert f.metadata()["schema_version"] == "2"
    bad = dataclasses.replace(bundle, extras={"qk.smoothing": -bundle.extras["qk.smoothing"]})
    with pytest.raises(BundleError, match="qk.smoothing"):
        save_bundle(bad, tmp_path / "bad.kvcal.safetensors")


def test_settings_codec_and_refusals():
    config = CompressionConfig(smooth=True)
    assert config.to_dict()["smooth"] is True and CompressionConfig.from_dict(config.to_dict()) == config
    assert "smooth" not in CompressionConfig().to_dict()
    with pytest.raises(ValueError, match="static"):
        CompressionConfig(high=TierFormat.parse("K8sV4"), smooth=True)
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)                    # made without smoothing
    with pytest.raises(ValueError, match="no `qk.smoothing`"):
        decode_logits(model, KvcalCache.from_bundle(bundle, model, config),
                      tok(["a b c d"], return_tensors="pt").input_ids, 2)


def test_a_collector_set_loads_all_of_its_state_or_none():
    from kvcal.models import adapter_for
    from kvcal.profile.capture import CollectorSet

    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    a = adapter_for(model.config)
    full = CollectorSet(one=QueryAbsMax(a, bundle.qk_rotation), two=QueryAbsMax(a, bundle.qk_rotation))
    for c in full.named.values():
        c.q += 1.0
    fresh = CollectorSet(one=QueryAbsMax(a, bundle.qk_rotation), two=QueryAbsMax(a, bundle.qk_rotation))
    fresh.load_state_dict(full.state_dict())
    assert all(bool((c.q == 1.0).all()) for c in fresh.named.values())
    partial = {k: t for k, t in full.state_dict().items() if k.startswith("one.")}
    empty = CollectorSet(one=QueryAbsMax(a, bundle.qk_rotation), two=QueryAbsMax(a, bundle.qk_rotation))
    with pytest.raises(KeyError, match="two"):
        empty.load_state_dict(partial)
    assert all(bool((c.q == 0).all()) for c in empty.named.values())        # nothing was loaded
