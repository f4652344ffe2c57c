"""Token policies x attention backends: every policy the runtime serves (none, DiffKV tiers with per-token or
per-channel low keys, the residual family's fp16 high tier over per-channel low pages, FastGen alone and on top of
tiers, the H2O / SnapKV / StreamingLLM eviction baselines) runs end to end through `KvcalCache` on the torch backend,
on the fused cpu backend and on the CUDA backend's CPU emulation (the kernels' plans, descriptor tables and page
writes, run on the CPU), and all give the same tiers and logits."""

import copy
import functools

import pytest
import torch
from conftest import make_model, needs_gpu, random_bundle

from kvcal.runtime import backends as attention
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies.fastgen import FastGenConfig
from kvcal.runtime.policies.h2o import H2OConfig
from kvcal.runtime.policies.snapkv import SnapKVConfig
from kvcal.runtime.policies.streamingllm import StreamingLLMConfig
from kvcal.runtime.storage.layout import TierFormat

TIERS = dict(window=8, alpha_high=2.0, alpha_low=1.5)
POLICIES = {
    "none": CompressionConfig(),
    "diffkv, per-token low": CompressionConfig(low=TierFormat.parse("K4V2")).with_tiering(**TIERS),
    "diffkv, per-channel low": CompressionConfig().with_tiering(**{**TIERS, "alpha_low": 0.8}),
    "residual: fp16 window, per-channel low": CompressionConfig(
        high=TierFormat.parse("K16V16"), low=TierFormat.parse("K4cV4"), page_tokens=8).with_tiering(
        window=8, alpha_high=1e9, alpha_low=0.5),
    # no pruning and no eviction: the low tier keeps no score or position (untracked); heavy hitters stay fp16
    "residual, untracked low": CompressionConfig(
        high=TierFormat.parse("K16V16"), low=TierFormat.parse("K4cV4"), page_tokens=8).with_tiering(
        window=8, alpha_high=2.0),
    # bits where they matter: layer 1's low tier at 2-bit keys and values, layer 0's at 4 (`low_layers`)
    "residual, untracked low, bits per layer": CompressionConfig(
        high=TierFormat.parse("K16V16"), low=TierFormat.parse("K4cV4"), page_tokens=8,
        low_layers=((1, TierFormat.parse("K2cV2")),)).with_tiering(window=8, alpha_high=2.0),
    # and per KV head (`low_heads`): layer 0's head 1 at 2 bits, layer 1's head 0 at 8-bit keys
    "residual, untracked low, bits per KV head": CompressionConfig(
        high=TierFormat.parse("K16V16"), low=TierFormat.parse("K4cV4"), page_tokens=8,
        low_layers=((1, TierFormat.parse("K2cV2")),),
        low_heads=((0, 1, TierFormat.parse("K2cV2")), (1, 0, TierFormat.parse("K8cV4")))).with_tiering(
        window=8, alpha_high=2.0),
    "fastgen": CompressionConfig(fastgen=FastGenConfig(0.6)).with_tiering(window=8),
    "fastgen + diffkv": CompressionConfig(low=TierFormat.parse("K4V2"), fastgen=FastGenConfig(0.6)).with_tiering(
        **TIERS),
    # the eviction baselines: as `kvcal bench` serves them (fp16 store, model basis), and on top of tiers
    "h2o": CompressionConfig(high=TierFormat(16, 16), use_ranks=False, rotate=False, mix=False,
                             h2o=H2OConfig(0.4)),
    "snapkv": CompressionConfig(snapkv=SnapKVConfig(0.4, window=8, reserve=12)),
    "streamingllm + diffkv": CompressionConfig(low=TierFormat.parse("K4V2"),
                                               streamingllm=StreamingLLMConfig(0.5)).with_tiering(**TIERS),
}
BACKENDS = ("torch", "cpu", "cuda-emulated")
PAGE_BYTES = {"diffkv, per-channel low": 512}     # small pages: some low pages get sealed


@pytest.fixture(autouse=True)
def emulated_cuda(monkeypatch):
    """Make the CUDA emulation selectable by name for these tests only (it is never chosen by `auto`)."""
    monkeypatch.setitem(attention.BACKENDS, "cuda-emulated", "kvcal.runtime.backends.cuda.emulate:EmulatedCudaBackend")
    attention.select_backend.cache_clear()
    yield
    attention.select_backend.cache_clear()


@functools.cache
def _model():
    model, tok = make_model("llama", seed=0)
    ranks_k = torch.tensor([[12, 16], [16, 8]], dtype=torch.int32)
    ranks_v = torch.tensor([[16, 8], [12, 16]], dtype=torch.int32)
    return model, tok, random_bundle(model, tok, ranks_k, ranks_v, seed=5)


@functools.cache
def _gpu_model():
    model, tok, bundle = _model()
    return copy.deepcopy(model).cuda(), tok, bundle


def _serve(config: CompressionConfig, serve: ServeOptions, prompt: int = 40, steps: int = 12, device: str = "cpu"):
    model, tok, bundle = _model() if device == "cpu" else _gpu_model()
    ids = torch.randint(3, len(tok), (2, prompt + steps), generator=torch.Generator().manual_seed(7)).to(device)
    with torch.inference_mode():
        cache = KvcalCache.from_bundle(bundle, model, config, tokenizer=tok, serve=serve)
        logits = [model(input_ids=ids[:, :prompt], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(prompt, prompt + steps):
            logits.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    counts = cache.kv.tier_counts()
    total = 2 * (prompt + steps) * len(cache.kv.layers) * cache.kv.store.num_kv_heads
    tiers = {"high": counts["high"], "low": counts["low"], "pruned": total - counts["high"] - counts["low"]}
    return torch.stack(logits, 1), tiers, cache.kv.backend.name(), cache.memory()["total_bytes"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_policy_serves_the_same_on_each_backend(policy, backend):
    config = POLICIES[policy]
    logits, tiers, served_by, _ = _serve(config, ServeOptions(backend, PAGE_BYTES.get(policy)))
    assert served_by == backend
    # each policy does what it is for on this input (so the comparison below covers its decisions)
    if policy == "none":
        assert tiers["low"] == tiers["pruned"] == 0
    if "diffkv" in policy:
        assert tiers["low"] > 0                 # per-channel: whole low pages were sealed
    if policy.startswith("residual:"):          # fp16 holds the window and tokens waiting for a low page, no more
        assert tiers["low"] > tiers["high"] > 0
    if "untracked" in policy:                   # fp16 also holds the heavy hitters
        assert tiers["low"] > 0 and tiers["high"] > 0
    if policy != "none" and "per-channel" not in policy and "untracked" not in policy:
        assert tiers["pruned"] > 0
    ref_logits, ref_tiers, _, _ = _serve(POLICIES[policy], ServeOptions("torch", PAGE_BYTES.get(policy)))
    assert tiers == ref_tiers
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-4)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "none"])
def test_policy_serves_the_same_through_the_cuda_kernels(policy):
    """On the GPU, the CUDA kernels (decode, fused scores, page writes) and the torch reference give the same tiers
    and, to fp32 summation order across a 2-layer model, the same logits."""
    page_bytes = PAGE_BYTES.get(policy)
    logits, tiers, served_by, _ = _serve(POLICIES[policy], ServeOptions("cuda", page_bytes), device="cuda")
    ref_logits, ref_tiers, _, _ = _serve(POLICIES[policy], ServeOptions("torch", page_bytes), device="cuda")
    assert served_by == "cuda"
    assert tiers == ref_tiers
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_untracked_low_tier_serves_the_same_tokens_in_fewer_bytes(backend, monkeypatch):
    """Dropping the score and position of low tokens that can never move changes no logit and no tier, only the
    bytes (the layouts' sizes: tests/test_config.py). Full rank: a page sized for 8 full-rank low tokens holds more
    lower-rank ones, and how many more depends on the bytes a token takes, so ragged ranks would group differently."""
    config = POLICIES["residual, untracked low"].with_(use_ranks=False)
    assert not config.low_tracked
    logits, tiers, _, held = _serve(config, ServeOptions(backend))
    monkeypatch.setattr(CompressionConfig, "low_tracked", property(lambda self: True))
    ref_logits, ref_tiers, _, ref_held = _serve(config, ServeOptions(backend))
    assert tiers == ref_tiers and tiers["low"] > 0
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)     # summation order only (page widths)
    assert held < ref_held


def test_a_layers_own_low_bits_shape_its_pages_and_only_its_pages():
    """`low_layers`: the named layer's low pages have that format's layout, the other layer's are as without it; no
    token is dropped and the cache holds fewer bytes."""
    from kvcal.runtime.storage.pages import LOW

    per_layer = POLICIES["residual, untracked low, bits per layer"]
    model, tok, bundle = _model()
    cache = KvcalCache.from_bundle(bundle, model, per_layer)
    with torch.inference_mode():
        model(input_ids=torch.arange(3, 19)[None], cache=cache, use_cache=True)
    formats = {layer: {g.layouts[LOW].fmt.name for g in groups} for layer, groups in cache.kv.store.groups.items()}
    assert formats == {0: {"K4cV4"}, 1: {"K2cV2"}}
    # a page of the cheaper format holds more low tokens, so more wait in fp16 for it to fill: saving shows over
    # a few pages
    _, tiers, _, held = _serve(per_layer, ServeOptions(), prompt=200)
    _, ref_tiers, _, ref_held = _serve(per_layer.with_(low_layers=()), ServeOptions(), prompt=200)
    assert tiers["pruned"] == ref_tiers["pruned"] == 0 and held < ref_held


@pytest.mark.parametrize("use_ranks", [True, False])
def test_a_kv_heads_own_low_bits_shape_its_pages(use_ranks):
    """`low_heads`: each KV head's low pages have its own format, whether its ranks already set it apart (the tiny
    bundle's heads differ in rank) or it shares them with its layer's other heads (full rank): heads group by format."""
    from kvcal.runtime.storage.pages import LOW

    config = POLICIES["residual, untracked low, bits per KV head"].with_(use_ranks=use_ranks)
    model, tok, bundle = _model()
    cache = KvcalCache.from_bundle(bundle, model, config)
    with torch.inference_mode():
        model(input_ids=torch.arange(3, 19)[None], cache=cache, use_cache=True)
    groups = cache.kv.store.groups
    formats = {(layer, int(h)): g.layouts[LOW].fmt.name for layer, gs in groups.items() for g in gs for h in g.heads}
    assert formats == {(0, 0): "K4cV4", (0, 1): "K2cV2", (1, 0): "K8cV4", (1, 1): "K2cV2"}
    assert all(len(gs) == 2 for gs in groups.values())


def test_a_kv_head_the_model_lacks_is_refused():
    model, tok, bundle = _model()
    config = CompressionConfig(low=TierFormat.parse("K4cV4"), low_heads=((0, 5, TierFormat.parse("K2cV2")),))
    cache = KvcalCache.from_bundle(bundle, model, config)
    with pytest.raises(ValueError, match="KV head 5 of layer 0"), torch.inference_mode():
        model(input_ids=torch.arange(3, 19)[None], cache=cache, use_cache=True)


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "snapkv"])
def test_eviction_budgets_count_the_real_tokens_of_left_padded_prompts(name):
    """With left padding, each sequence keeps the budget of its own real length and never a padding token."""
    from conftest import random_text

    from kvcal.runtime.policies.h2o import H2OConfig

    model, tok, bundle = _model()
    tok.padding_side = "left"
    inputs = tok([random_text(60, seed=1), random_text(30, seed=2)], return_tensors="pt", padding=True)
    settings = {"streamingllm": StreamingLLMConfig(0.5), "h2o": H2OConfig(0.5),
                "snapkv": SnapKVConfig(0.5, window=8)}[name]
    cache = KvcalCache.from_bundle(bundle, model, CompressionConfig(**{name: settings}), tokenizer=tok)
    with torch.inference_mode():
        model(**inputs, cache=cache, use_cache=True)
    kv = cache.kv
    n = inputs.input_ids.shape[1]
    real = inputs.attention_mask.sum(-1)
    budget = [settings.prompt_tokens(int(r)) if name == "snapkv" else settings.tokens(int(r)) for r in real]
    b, h = kv.every_entry()
    for layer in kv.layers:
        pos = kv.store.section_meta(layer, 0, b, h)[1].view(2, kv.store.num_kv_heads, -1)
        for seq in range(2):
            kept = pos[seq][pos[seq] >= 0].view(kv.store.num_kv_heads, -1)
            assert kept.shape[-1] == budget[seq] < int(real[seq])
            assert bool((kept >= n - real[seq]).all())                       # no padding token is held
            if name == "streamingllm":
                first = int(n - real[seq])
                assert set(range(first, first + 4)) <= set(kept[0].tolist())
