"""The KVTuner-style baseline (kvcal.bench.kvtuner): the sensitivity estimate, the per-layer allocation, and the
layer-wise cache on tiny random models."""

import pytest
import torch
from conftest import decode_logits, make_model, random_bundle

from kvcal.bench import methods as M
from kvcal.bench.kvtuner import PAIRS, LayerwiseKvcalCache, allocate, layer_sensitivity
from kvcal.models import adapter_for
from kvcal.runtime.hf import KvcalCache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def tiny(request):
    model, tok = make_model(request.param)
    return model, tok, adapter_for(model.config)


def _bits(pair):
    return (pair[0] + pair[1]) / 2


def test_sensitivity_falls_as_bits_grow(tiny):
    model, tok, a = tiny
    windows = torch.randint(3, len(tok), (2, 200), generator=torch.Generator().manual_seed(0))
    e = layer_sensitivity(model, a, windows, window=16, group=8)
    assert e.shape == (a.num_layers, len(PAIRS))
    j = {p: i for i, p in enumerate(PAIRS)}
    for layer in range(a.num_layers):
        if a.is_sliding(layer):
            assert (e[layer] == 0).all()
            continue
        assert 0 < e[layer, j[(8, 8)]] < e[layer, j[(4, 4)]] < e[layer, j[(2, 2)]]
        # fewer key bits alone, fewer value bits alone (a random tiny model attends almost uniformly, so its key
        # errors are small and 2- and 4-bit keys come out within noise of each other: only 8 -> 4 is compared)
        assert e[layer, j[(8, 8)]] < e[layer, j[(4, 8)]] and e[layer, j[(4, 4)]] < e[layer, j[(4, 2)]]


def test_allocation_meets_the_budget_and_gives_bits_to_the_sensitive_layer():
    L = 4
    error = torch.tensor([[2.0 ** -(k + v) for k, v in PAIRS]] * L)
    error[2] *= 100                                                  # one layer far more sensitive than the rest
    compressed = [True] * L
    for budget in (2.0, 2.5, 3.0, 4.0, 6.0, 8.0):
        pairs = allocate(error, compressed, budget)
        assert sum(_bits(p) for p in pairs) / L <= budget + 1e-9
    pairs = allocate(error, compressed, 3.0)
    assert _bits(pairs[2]) > max(_bits(p) for i, p in enumerate(pairs) if i != 2)
    assert allocate(error, compressed, 8.0) == [(8, 8)] * L
    assert allocate(error, compressed, 2.0) == [(2, 2)] * L
    totals = [sum(error[i, PAIRS.index(p)] for i, p in enumerate(allocate(error, compressed, b))) for b in (2.5, 3, 4)]
    assert totals[0] >= totals[1] >= totals[2]                      # more bits never cost more error
    with pytest.raises(ValueError, match="below the cheapest pair"):
        allocate(error, compressed, 1.5)


PROMPT = 110     # decode_logits: prefill this many tokens, then one per step


@pytest.mark.float_order
def test_layerwise_cache_with_one_format_is_the_kvcal_cache(tiny):
    model, tok, a = tiny
    bundle = random_bundle(model, tok)
    ids = torch.randint(3, len(tok), (2, 116), generator=torch.Generator().manual_seed(1))
    config = M.kivi_config(4, 2, window=16, group=8)
    plain = KvcalCache.from_bundle(bundle, model, config)
    want = decode_logits(model, plain, ids, PROMPT)
    configs = [None if a.is_sliding(i) else config for i in range(a.num_layers)]
    layerwise = LayerwiseKvcalCache(bundle, a, configs)
    torch.testing.assert_close(decode_logits(model, layerwise, ids, PROMPT), want, rtol=0, atol=0)
    assert layerwise.memory()["total_bytes"] == plain.memory()["total_bytes"]
    assert layerwise.memory()["fp16_bytes"] == plain.memory()["fp16_bytes"]


def test_layerwise_cache_holds_each_layers_format(tiny):
    """Mixed formats: the bytes are the sum of what each format's layers hold alone, and the output lies between
    the all-precise and all-cheap caches' outputs in error."""
    model, tok, a = tiny
    bundle = random_bundle(model, tok)
    ids = torch.randint(3, len(tok), (1, 116), generator=torch.Generator().manual_seed(2))
    full = [i for i in range(a.num_layers) if not a.is_sliding(i)]
    if len(full) < 2:
        pytest.skip(f"{a.family}'s tiny model has {len(full)} full-attention layer: nothing to mix")
    precise, cheap = M.kivi_config(8, 8, window=16, group=8), M.kivi_config(2, 2, window=16, group=8)
    mixed = [None if a.is_sliding(i) else (precise if i == full[0] else cheap) for i in range(a.num_layers)]
    cache = LayerwiseKvcalCache(bundle, a, mixed)
    got = decode_logits(model, cache, ids, PROMPT)
    assert len(cache.groups) == 2
    paged = sum(g.kv.store.bytes_in_use() for g in cache.groups)
    mem = cache.memory()
    sliding = mem["total_bytes"] - paged
    assert sliding >= 0 and (sliding > 0) == any(a.is_sliding(i) for i in range(a.num_layers))
    for g, fmt in zip(cache.groups, ("K8cV8", "K2cV2")):
        assert g.kv.store.low.name == fmt
    with torch.no_grad():
        dense = torch.stack([model(input_ids=ids[:, :t]).logits[:, -1] for t in range(PROMPT, ids.shape[1] + 1)], 1)

    def err(x):
        return (x - dense).pow(2).sum().item()

    all_precise = decode_logits(model, LayerwiseKvcalCache(bundle, a, [c and precise for c in mixed]), ids, PROMPT)
    all_cheap = decode_logits(model, LayerwiseKvcalCache(bundle, a, [c and cheap for c in mixed]), ids, PROMPT)
    assert err(all_precise) < err(got) < err(all_cheap)
    assert cache.release() > 0 and cache.memory()["total_bytes"] == 0
