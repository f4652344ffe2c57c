"""The bits stage's one-pass sensitivity (kvcal.profile.sensitivity) on real tiny models."""

from __future__ import annotations

import torch
from conftest import make_model, random_bundle

from kvcal.models import adapter_for
from kvcal.profile.sensitivity import fisher_sensitivity, halved
from kvcal.runtime.bases import served_bases
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.layout import TierFormat


def _estimate(model, tok, fmt: str, config=None, smoothing=None, seed=0):
    config = config or CompressionConfig()
    bundle = random_bundle(model, tok)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, bundle.qk_rank, bundle.v_rank, config, smoothing)
    ids = torch.randint(3, len(tok), (2, 96), generator=torch.Generator().manual_seed(seed))
    formats = dict.fromkeys(range(bundle.shape[0]), TierFormat.parse(fmt))
    return fisher_sensitivity(model, adapter_for(model.config), ids, served, formats, config.page_size(bundle.shape[2]))


def test_halving_four_bits_costs_more_than_halving_eight_and_leaves_the_model_as_it_was():
    model, tok = make_model()
    with torch.inference_mode():              # as the search calls it: the pass needs gradients all the same
        eight = _estimate(model, tok, "K8V4")
    four = _estimate(model, tok, "K4cV4")
    L = model.config.num_hidden_layers
    assert set(eight) == {(layer, side) for layer in range(L) for side in ("k_bits", "v_bits")}
    assert all(torch.isfinite(torch.tensor(v)) and v > 0 for v in [*eight.values(), *four.values()])
    for layer in range(L):                      # keys 8 -> 4 bits against 4 -> 2 bits, the same gradients
        assert four[(layer, "k_bits")] > eight[(layer, "k_bits")]
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    assert _estimate(model, tok, "K2cV2") == {}                      # nothing halves below 2 bits


def test_smoothing_moves_the_gradient_with_the_keys():
    """Keys coded in R·D⁻¹·M and their gradient read through the query rotation R·D·M: with D = 2 everywhere the
    codes scale exactly (a power of two), δ halves and g doubles, so the estimate does not move. Reading the gradient
    through the key rotation instead would divide it by 16."""
    model, tok = make_model()
    L, H, d = model.config.num_hidden_layers, model.config.num_key_value_heads, 16
    plain = _estimate(model, tok, "K4V4")
    smooth = _estimate(model, tok, "K4V4", CompressionConfig(smooth=True), torch.full((L, H, d), 2.0))
    for key, value in plain.items():
        assert abs(smooth[key] - value) <= 1e-4 * value, key


def test_sliding_window_layers_get_estimates_and_halved_formats_keep_modes_and_groups():
    model, tok = make_model("gemma3_text")             # layers: sliding, sliding, full; window 16
    got = _estimate(model, tok, "K8V4")
    assert {layer for layer, _ in got} == set(range(model.config.num_hidden_layers))
    assert halved(TierFormat.parse("K4sV4"), "k_bits") is None and halved(TierFormat.parse("K16V16"), "v_bits") is None
    assert halved(TierFormat.parse("K8V4g16"), "v_bits") == TierFormat.parse("K8V2g16")
