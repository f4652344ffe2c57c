"""Keys in the model's own channels (`CompressionConfig.model_basis_keys`): served with an identity rotation, chosen
per (layer, KV head, bits) by the quality model where it predicts less loss, coded so by the coded probe, and served
so by the runtime."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_bundle, random_text

from kvcal.eval import DecodeProbe
from kvcal.models import adapter_for
from kvcal.profile.allocate import Allocation, base_settings, to_config
from kvcal.profile.coded_probe import CodedProbe
from kvcal.profile.quality_model import BITS, LEVELED, bundle_levels, choose_key_basis
from kvcal.profile.ranks import ranks_of
from kvcal.profile.recording import record_search
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.storage.bases import served_bases

pytestmark = pytest.mark.usefixtures("one_thread")


def test_listed_heads_keys_are_served_unrotated_and_the_rest_as_before():
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    L, H, d, _ = bundle.qk_rotation.shape
    full = torch.full((L, H), d, dtype=torch.int32)
    config = CompressionConfig(model_basis_keys=((1, 0),))
    before = served_bases(bundle.qk_rotation, bundle.v_basis, full, full, CompressionConfig(), None)
    after = served_bases(bundle.qk_rotation, bundle.v_basis, full, full, config, None)
    assert torch.equal(after.rotation[1, 0], torch.eye(d)) and torch.equal(after.query_rotation[1, 0], torch.eye(d))
    assert not torch.equal(before.rotation[1, 0], torch.eye(d))
    others = [(0, 0), (0, 1), (1, 1)]
    assert all(torch.equal(after.rotation[i, h], before.rotation[i, h]) for i, h in others)
    assert torch.equal(after.basis, before.basis)
    cut = full.clone()
    cut[1, 0] = d // 2
    with pytest.raises(ValueError, match="full key rank"):
        served_bases(bundle.qk_rotation, bundle.v_basis, cut, full, config, None)
    assert CompressionConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["model_basis_keys"] == {"1": [0]}
    assert "model_basis_keys" not in CompressionConfig().to_dict()
    for bad in (dict(smooth=True), dict(rotate=False), dict(model_basis_keys=((1, 0), (0, 1)))):
        with pytest.raises(ValueError):
            CompressionConfig(**{"model_basis_keys": ((1, 0),), **bad})


def test_each_heads_bits_take_the_basis_of_less_predicted_loss_and_its_levels():
    L, H, A = 2, 2, 5
    g = torch.Generator().manual_seed(0)
    costs, model_costs = (torch.rand(L, H, 2, len(BITS), A, generator=g, dtype=torch.float64) for _ in range(2))
    levels = {i: {(s, b): torch.rand(H, 1 << b, generator=g) for s in "kv" for b in LEVELED} for i in range(L)}
    model_levels = {i: {("k", b): torch.rand(H, 1 << b, generator=g) for b in LEVELED} for i in range(L)}
    table, key_basis, chosen = choose_key_basis(costs, model_costs, levels, model_levels)
    want = model_costs[:, :, 0].sum(-1) < costs[:, :, 0].sum(-1)
    assert torch.equal(key_basis, want) and want.any() and not want.all()
    assert torch.equal(table[:, :, 1], costs[:, :, 1])                                  # values: one basis
    # one basis for every threshold of a (layer, head, bits): the lower sum, not the lower entry per threshold
    assert torch.equal(table[:, :, 0], torch.where(want[..., None], model_costs[:, :, 0], costs[:, :, 0]))
    for i in range(L):
        for b in LEVELED:
            for h in range(H):
                source = model_levels if want[i, h, BITS.index(b)] else levels
                assert torch.equal(chosen[i]["k", b][h], source[i]["k", b][h])
            assert torch.equal(chosen[i]["v", b], levels[i]["v", b])


def _sinusoid_setup():
    """A tiny llama whose keys are mostly a constant before RoPE (a large key bias), so after RoPE each channel pair
    is a sinusoid of its own frequency: over a page a low-frequency pair barely moves and a high-frequency one
    sweeps its range. Per-channel scales in the model's channels fit each pair's own sweep; a rotation sums the
    sweeps of every pair into each channel, whose page range then adds up (docs/formats.md, "The key basis")."""
    model, tok = make_model("llama", num_hidden_layers=2, attention_bias=True)
    a = adapter_for(model.config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.copy_(2.0 * torch.randn(layer.self_attn.k_proj.bias.shape, generator=g))
    bundle = random_bundle(model, tok)
    ids = tok([random_text(400, seed=5)], return_tensors="pt").input_ids[:, :161].repeat(2, 1)
    ids[1] = ids[1].roll(17)
    base = base_settings(list(a.layer_types)).with_tiering(window=8)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base, None)
    rec = record_search(model, ids[:, :112], ids[:, 112:], served, base, list(a.layer_types), a.head_dim)
    bundle.extras.update(bundle_levels(rec.levels, len(a.layer_types), a.num_kv_heads))
    return model, tok, bundle, ids, base, rec, CodedProbe(model, rec, served, base, list(a.layer_types), a.head_dim)


def test_sinusoidal_keys_go_to_the_models_basis_and_the_probe_and_runtime_agree():
    """On keys that RoPE turns into sinusoids, the quality model prices 2-bit keys in the model's basis below the
    rotation's and chooses it for every head; the coded probe and the runtime both measure less KL with those heads'
    keys unrotated than rotated. A basis that did not reach the probe's coding or the runtime's store fails here."""
    model, tok, bundle, ids, base, rec, probe = _sinusoid_setup()
    costs = rec.costs
    two = BITS.index(2)
    assert costs.key_basis[..., two].all()
    bits = torch.tensor([[2, 8], [2, 8]])
    allocation = Allocation.of(costs, bits)
    unrotated = to_config(base, costs, allocation)
    assert unrotated.model_basis_keys == ((0, 0), (0, 1), (1, 0), (1, 1))
    rotated_costs = type(costs)(**{**costs.__dict__, "key_basis": torch.zeros_like(costs.key_basis)})
    rotated = to_config(base, rotated_costs, allocation)
    assert rotated.model_basis_keys == () and rotated.with_(model_basis_keys=unrotated.model_basis_keys) == unrotated
    coded = [probe.measure(c, allocation).kl for c in (costs, rotated_costs)]
    runtime = DecodeProbe(model, bundle, ids[:, :112], ids[:, 112:], tokenizer=tok)
    served = [runtime.measure(c).kl for c in (unrotated, rotated)]
    assert coded[0] < coded[1] and served[0] < served[1], (coded, served)
