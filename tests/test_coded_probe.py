"""The coded probe (kvcal.profile.coded_probe): exact where nothing is coded, and it orders allocations as the
runtime's own stepwise decode measures them."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_bundle, random_text

from kvcal.eval import DecodeProbe
from kvcal.models import adapter_for
from kvcal.profile.allocate import Allocation, base_settings, to_config
from kvcal.profile.coded_probe import CodedProbe
from kvcal.profile.quality_model import BITS, bundle_levels, spearman
from kvcal.profile.ranks import ranks_of
from kvcal.profile.recording import record_search
from kvcal.runtime.storage.bases import served_bases
from kvcal.runtime.storage.layout import TierFormat

pytestmark = pytest.mark.usefixtures("one_thread")


def _sharp_model(L: int = 4, sharpen: float = 30.0):
    """A tiny llama whose query and key projections are scaled up: its attention is peaked enough to have heavy
    hitters at the catalogue's thresholds (a random model's attention is nearly uniform)."""
    model, tok = make_model("llama", num_hidden_layers=L)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(sharpen)
            layer.self_attn.k_proj.weight.mul_(sharpen)
    return model, tok


def _setup(family: str = "llama", L: int = 4, window: int = 8, sharp: bool = False, **model_kwargs):
    model, tok = _sharp_model(L) if sharp else make_model(family, num_hidden_layers=L, **model_kwargs)
    a = adapter_for(model.config)
    bundle = random_bundle(model, tok)
    ids = tok([random_text(400, seed=5)], return_tensors="pt").input_ids[:, :161].repeat(2, 1)
    ids[1] = ids[1].roll(17)                                  # two windows that differ
    base = base_settings(a.layer_types).with_tiering(window=window)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base, None)
    rec = record_search(model, ids[:, :112], ids[:, 112:], served, base, list(a.layer_types), a.head_dim)
    bundle.extras.update(bundle_levels(rec.levels, L, a.num_kv_heads))
    costs, probe = rec.costs, CodedProbe(model, rec, served, base, list(a.layer_types), a.head_dim)
    return model, tok, bundle, ids, base, costs, probe


def test_nothing_coded_is_the_dense_model():
    """A window longer than the whole sequence holds nothing coded: the probe's attention must then be the model's
    own, so every prediction agrees with the dense reference (fp16 copies of the prompt and float order only)."""
    model, tok, bundle, ids, base, costs, _ = _setup(window=8)
    a = adapter_for(model.config)
    wide = base.with_tiering(window=10_000)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, wide), wide, None)
    rec = record_search(model, ids[:, :112], ids[:, 112:], served, wide, list(a.layer_types), a.head_dim)
    probe = CodedProbe(model, rec, served, wide, list(a.layer_types), a.head_dim)
    fid = probe.measure(costs, Allocation.of(costs, torch.full((4, 2), 2)))
    # the recorded prompt K/V are kept in fp16, as the runtime's raw tiers hold them: KL of order 1e-6 on this model
    # (1e-9 with float32 copies)
    assert fid.top1 == 1.0 and fid.kl < 1e-5 and abs(fid.ppl_ratio - 1) < 1e-5, fid


def test_fewer_bits_cost_more_and_bytes_fall():
    model, tok, bundle, ids, base, costs, probe = _setup()
    fids = [probe.measure(costs, Allocation.of(costs, torch.full((4, 2), b))) for b in BITS]
    kls = [f.kl for f in fids]
    ratios = [f.memory["ratio_to_fp16"] for f in fids]
    assert kls[0] < kls[1] < kls[2], kls
    assert 1.0 > ratios[0] > ratios[1] > ratios[2] > 0, ratios
    assert fids[0].predictions == 2 * 48


def test_the_coded_probe_orders_allocations_as_the_runtime_measures_them():
    """Allocations from all 8-bit to all 2-bit, and random ones per KV head (the runtime serves them as `low_heads`),
    measured by the coded probe and stepwise by the runtime's decode probe on the same windows: their KLs rank alike.
    A probe that codes the wrong tokens, sides, heads or layers (or none) breaks the order, and this fails."""
    model, tok, bundle, ids, base, costs, probe = _setup()
    runtime = DecodeProbe(model, bundle, ids[:, :112], ids[:, 112:], tokenizer=tok)
    g = torch.Generator().manual_seed(0)
    allocations = [torch.full((4, 2), b) for b in BITS]
    allocations += [torch.tensor(BITS)[torch.randint(3, (4, 2, 2), generator=g)] for _ in range(7)]
    assert any(to_config(base, costs, Allocation.of(costs, b)).low_heads for b in allocations[3:])
    allocations = [Allocation.of(costs, b) for b in allocations]
    coded = [probe.measure(costs, a).kl for a in allocations]
    served = [runtime.measure(to_config(base, costs, a)).kl for a in allocations]
    assert spearman(coded, served) >= 0.8, list(zip(coded, served))


def test_sliding_layers_are_coded_too():
    """Gemma3's sliding-window layers hold every token in their format: 2 bits there must cost more than 8."""
    model, tok, bundle, ids, base, costs, probe = _setup("gemma3_text", L=4, sliding_window=32,
                                                     layer_types=["sliding_attention"] * 3 + ["full_attention"])
    sliding = [i for i, s in enumerate(probe.sliding) if s]
    assert sliding
    wide = torch.full((4, 2), 8)
    narrow = wide.clone()
    narrow[sliding] = 2
    assert probe.measure(costs, Allocation.of(costs, narrow)).kl > probe.measure(costs, Allocation.of(costs, wide)).kl


def test_sliding_layers_bytes_are_modelled_as_the_runtime_holds_them():
    """A sliding layer keeps its window (its fp16 share is the window's, not the context's), its newest tokens wait
    unquantized and its per-channel keys are held in whole blocks. Moving the sliding layers from 8 to 2 bits with
    the global layer unchanged (its page slack cancels) changes the modelled ratio as much as the runtime's."""
    model, tok, bundle, ids, base, costs, probe = _setup("gemma3_text", L=4, sliding_window=96,
                                                         layer_types=["sliding_attention"] * 3 + ["full_attention"])
    runtime = DecodeProbe(model, bundle, ids[:, :112], ids[:, 112:], tokenizer=tok)
    wide = torch.full((4, 2), 8)
    narrow = wide.clone()
    narrow[:3] = 2
    modelled, served = [], []
    for bits in (wide, narrow):
        allocation = Allocation.of(costs, bits)
        modelled.append(probe.modelled_ratio(costs, allocation))
        served.append(runtime.measure(to_config(base, costs, allocation)).memory["ratio_to_fp16"])
    assert modelled[0] - modelled[1] == pytest.approx(served[0] - served[1], rel=0.02), (modelled, served)


def test_flash_bulk_equals_the_plain_softmax():
    """The coded attention runs flash attention over the bulk keys (older than every query's window) and merges the
    band in by log-sum-exp. A mask of 1e-30 on the bulk (far below float32's resolution at logits of order 1) sends
    the same inputs through the plain softmax over all keys: both outputs agree to float order (1e-5)."""
    from types import SimpleNamespace

    from kvcal.profile.coded_probe import _STATE, _coded_attention, _Coding

    model, tok, bundle, ids, base, costs, probe = _setup()
    a = adapter_for(model.config)
    B, n, prompt = 2, 48, probe.prompt.shape[1]
    S = prompt + n
    g = a.num_q_heads // a.num_kv_heads
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(B, a.num_kv_heads * g, n, a.head_dim, generator=gen)
    key, value = (torch.randn(B, a.num_kv_heads, S, a.head_dim, generator=gen) for _ in range(2))
    causal = torch.zeros(B, 1, n, S).masked_fill(torch.arange(S)[None] > torch.arange(prompt, S)[:, None], -1e30)
    token = _STATE.set(_Coding(probe, Allocation.of(costs, torch.full((4, 2), 4)), slice(None)))
    try:
        module = SimpleNamespace(layer_idx=0)
        flash, _ = _coded_attention(module, query, key, value, causal, scaling=0.125)
        plain, _ = _coded_attention(module, query, key, value, causal + 1e-30, scaling=0.125)
    finally:
        _STATE.reset(token)
    torch.testing.assert_close(flash, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exact_window", [True, False])
def test_the_window_is_read_as_the_runtime_serves_it(exact_window):
    """With the window held exact (the search's frame, `exact_window`), a query reads it exactly; otherwise the
    runtime writes every new token to its high tier, so with an 8-bit high tier a query reads the keys of its window
    at 8 bits. The coded attention against a query-by-query reference of each rule: its own key exact, the rest of
    the window exact or in the high tier's format, older keys in their held format. Each fails with the other rule."""
    from types import SimpleNamespace

    from kvcal.profile.coded_probe import _STATE, _coded_attention, _Coding

    model, tok, bundle, ids, base, costs, probe = _setup()
    assert probe.base.exact_window
    probe.base = probe.base.with_(exact_window=exact_window)
    a = adapter_for(model.config)
    B, n, prompt, window = 2, 24, probe.prompt.shape[1], base.tiering.window
    S, g = prompt + n, a.num_q_heads // a.num_kv_heads
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(B, a.num_kv_heads * g, n, a.head_dim, generator=gen)
    key, value = (torch.randn(B, a.num_kv_heads, S, a.head_dim, generator=gen) for _ in range(2))
    causal = torch.zeros(B, 1, n, S).masked_fill(torch.arange(S)[None] > torch.arange(prompt, S)[:, None], -1e30)
    coding = _Coding(probe, Allocation.of(costs, torch.full((4, 2), 4), 1), slice(None))
    assert coding.high.name == "K8V8"
    token = _STATE.set(coding)
    try:
        got, _ = _coded_attention(SimpleNamespace(layer_idx=1), query, key, value, causal, scaling=0.125)
        low, high = coding.held_tokens(1, B, a.num_kv_heads, S)
        kc, vc = coding.coded_kv(1, key, value, low, high)
        every = torch.ones_like(low)
        kh, vh = coding.coded_kv(1, key, value, ~every, every)
    finally:
        _STATE.reset(token)
    assert not torch.equal(kh, key) and not torch.equal(kc, kh)
    want = torch.zeros(B, n, a.num_q_heads, a.head_dim)
    for t in range(n):
        i = prompt + t
        j = torch.arange(i + 1)
        aged, recent = j <= i - window, (j > i - window) & (j < i) & (not exact_window)
        for b in range(B):
            for hq in range(a.num_q_heads):
                h = hq // g
                k = torch.where(aged[:, None], kc[b, h, :i + 1], torch.where(recent[:, None], kh[b, h, :i + 1],
                                                                              key[b, h, :i + 1]))
                v = torch.where(aged[:, None], vc[b, h, :i + 1], torch.where(recent[:, None], vh[b, h, :i + 1],
                                                                              value[b, h, :i + 1]))
                want[b, t, hq] = ((query[b, hq, t] @ k.T) * 0.125).softmax(-1) @ v
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_an_8_bit_high_tier_is_priced_and_coded():
    """With heavy hitters (the lowest threshold of the catalogue), the 8-bit high tier is predicted to cost loss, the
    probe codes it and models fewer bytes."""
    from kvcal.profile.quality_model import HIGH

    model, tok, bundle, ids, base, costs, probe = _setup(sharp=True)
    assert HIGH[1] == "K8V8" and costs.high_tokens[:, 0].min() > 0
    assert costs.high_costs[..., 0, :].abs().max() == 0 and costs.high_costs[..., 1, 0].sum() > 0
    bits = torch.full((4, 2), 4)
    assert costs.held_bytes(bits, 1, 0) < costs.held_bytes(bits, 0, 0)
    wide = probe.measure(costs, Allocation.of(costs, bits, 0, 0))
    narrow = probe.measure(costs, Allocation.of(costs, bits, 1, 0))
    # coding the heavy hitters at 8 bits changes what the queries read (a KL of order 1e-7 here, either side of the
    # 16-bit tier's), and the modelled bytes fall
    assert narrow.kl != wide.kl and narrow.memory["ratio_to_fp16"] < wide.memory["ratio_to_fp16"]
    assert to_config(base, costs, Allocation.of(costs, bits, 1)).high.name == "K8V8"


def test_a_higher_threshold_holds_more_tokens_in_the_allocated_formats():
    """The thresholds of the catalogue are nested: every token held below alpha is held below a higher one, so the
    tokens held grow, the high tier's shrink, and 2-bit values cost at least as much loss."""
    from kvcal.profile.quality_model import ALPHAS

    model, tok, bundle, ids, base, costs, probe = _setup(sharp=True)
    for layer, held in probe.held.items():
        assert held.shape[0] == len(ALPHAS) and (held[:-1] <= held[1:]).all(), layer
    assert (costs.tokens[:, 1:] >= costs.tokens[:, :-1]).all() and costs.tokens[:, -1].sum() > costs.tokens[:, 0].sum()
    assert (costs.high_tokens[:, 1:] <= costs.high_tokens[:, :-1]).all()
    values = costs.costs[:, :, 1, 2]              # per token: nested masks sum more (per-channel keys regroup pages)
    assert (values[..., 1:] >= values[..., :-1] - 1e-12).all()


@pytest.mark.parametrize("alpha", [0, 1])
def test_the_held_tokens_are_those_the_runtime_holds_low_after_the_continuation(alpha):
    """The recording classifies tokens by the runtime's own rule: its count of tokens held in the allocated format
    equals the runtime's low tier after the prefill and the continuation, decoded a token at a time with the same
    threshold, up to the tokens that wait in the high tier for a low page. The prefill's heavy hitters that the
    continuation demotes count too (`python experiments/held_tokens.py` measures both rules on a packaged model)."""
    from kvcal.profile.quality_model import ALPHAS
    from kvcal.runtime.hf import KvcalCache

    model, tok = _sharp_model()
    a = adapter_for(model.config)
    bundle = random_bundle(model, tok)
    ids = tok([random_text(400, seed=5)], return_tensors="pt").input_ids[:, :161]
    P, window, page = 112, 8, 4
    base = base_settings(a.layer_types).with_tiering(window=window).with_(low=TierFormat.parse("K4cV4"),
                                                                          page_tokens=page)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base, None)
    rec = record_search(model, ids[:, :P], ids[:, P:], served, base, list(a.layer_types), a.head_dim)
    predicted = sum(int(held[alpha, 0].sum()) for held in rec.held.values())
    cache = KvcalCache.from_bundle(bundle, model, base.with_tiering(alpha_high=ALPHAS[alpha]), tokenizer=tok)
    with torch.inference_mode():
        model(input_ids=ids[:, :P], cache=cache, use_cache=True)
        placed = cache.kv.tier_counts()["low"]
        for t in range(P, ids.shape[1] - 1):
            model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    low = cache.kv.tier_counts()["low"]
    waiting = len(rec.held) * a.num_kv_heads * (page - 1)
    # the end state is modelled: tokens wait in the high tier for a page (fewer than a page per layer and head), and
    # the runtime keeps low a token it demoted while its mean dipped below the threshold and then recovered (here 18
    # of 1120 at alpha 8). With the prefill's placement alone for prompt tokens, the count was 32 short
    assert 0 < placed < low and abs(predicted - low) <= waiting             # placed < low: the continuation demoted


def test_prompts_the_runtime_recorded_serve_the_coded_probe_as_the_search_recording_does():
    """The confirmation gauges points by the coded probe on the evaluation windows that its checks recorded
    (`recorded_prompts`, no backward). On the same windows it must hold the same tokens in the allocated formats as
    the search's recording and measure the same quality; a rule that reads the wrong significance, queries or layers
    changes the held tokens, and this fails."""
    from kvcal.profile.recording import HeldTokens, recorded_prompts

    model, tok, bundle, ids, base, costs, probe = _setup(sharp=True)
    a = adapter_for(model.config)
    held = HeldTokens(model, base, list(a.layer_types), len(ids))
    runtime = DecodeProbe(model, bundle, ids[:, :112], ids[:, 112:], tokenizer=tok, on_reference=held.capture)
    rec = recorded_prompts(runtime.prompt, runtime.continuation, runtime.records, runtime.ref, held,
                           probe.recording.levels)
    assert rec.held.keys() == probe.held.keys()
    for layer, held in rec.held.items():
        assert held.shape == probe.held[layer].shape and 0 < int(held.sum()) < held.numel()
        # the two recordings run the continuation through different attention code (SDPA in one pass, the search's
        # own in chunks with gradients): a token whose mean sits on a threshold may fall either side in float order
        assert (held != probe.held[layer]).float().mean() < 1e-3, layer
    gauge = CodedProbe(model, rec, probe.served, base, list(a.layer_types), a.head_dim)
    g = torch.Generator().manual_seed(1)
    for bits in (torch.full((4, 2), 4), torch.tensor(BITS)[torch.randint(3, (4, 2, 2), generator=g)]):
        allocation = Allocation.of(costs, bits)
        there, here = probe.measure(costs, allocation), gauge.measure(costs, allocation)
        assert here.top1 == there.top1 and here.kl == pytest.approx(there.kl, rel=1e-3, abs=1e-7)
        assert here.memory["ratio_to_fp16"] == pytest.approx(there.memory["ratio_to_fp16"], rel=1e-3)


def test_a_one_pass_dense_cache_is_freed_when_dropped():
    """The probes build a one-pass cache of a window's prompt per window (`dense_cache(keep=False)`); dropping it must
    free its K/V at once. A reference cycle would keep every window's float32 K/V (177 MB a window at 4k on
    smollm2-135m) until the garbage collector happens to run, which raised the calibration's peak."""
    import gc
    import weakref

    from kvcal.eval.fidelity import dense_cache

    model, tok = make_model("llama", num_hidden_layers=2)
    records = {i: (torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16), None) for i in range(2)}
    cache = dense_cache(model, records, keep=False)
    del records                                                  # the cache holds the recorded tensors themselves
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
    assert cache.layers[0].keys.shape[-2] == 16                  # the new tokens passed through, not kept
    held = weakref.ref(cache.layers[0].keys)
    gc.disable()
    try:
        del cache
        assert held() is None
    finally:
        gc.enable()


def test_sliding_recent_tokens_are_read_exact_as_the_runtime_serves_them():
    """With `sliding_recent` at least the sliding window, a sliding layer reads every token exact: 2 bits there must
    change nothing, in the coded probe and in the runtime's stepwise decode alike (the full layer at 8 bits in all);
    with 0 recent tokens both see the 2-bit codes. The quality model holds no token that no query reads coded."""
    from kvcal.profile.quality_model import held_masks

    model, tok, bundle, ids, base, costs, probe = _setup("gemma3_text", L=4, sliding_window=32,
                                                     layer_types=["sliding_attention"] * 3 + ["full_attention"])
    runtime = DecodeProbe(model, bundle, ids[:, :112], ids[:, 112:], tokenizer=tok)
    narrow = torch.full((4, 2), 8)
    narrow[:3] = 2
    allocation = Allocation.of(costs, narrow)
    config = to_config(base, costs, allocation)
    kls = {}
    for recent in (0, 32):
        probe.base = base.with_(sliding_recent=recent)
        kls[recent] = (probe.measure(costs, allocation).kl,
                       runtime.measure(config.with_(sliding_recent=recent, sliding=TierFormat.parse("K2V2kg32m8"),
                                                    sliding_layers=())).kl)
    wide = runtime.measure(config.with_(sliding=TierFormat.parse("K8V8kg32m8"), sliding_layers=(),
                                        sliding_recent=32)).kl
    assert kls[32][0] < 0.1 * kls[0][0] and kls[32][1] < 0.1 * kls[0][1], kls
    assert abs(kls[32][1] - wide) < 1e-4, (kls, wide)
    held = held_masks(None, torch.zeros(1, 100), 33, True)
    assert not held[..., 67:].any() and held[..., :67].all()
