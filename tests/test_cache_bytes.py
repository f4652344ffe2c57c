"""A KvcalCache never holds more than an fp16 dense cache of the same tokens plus the fixed amount docs/runtime.md
states (`allowance_bytes`): the raw phase holds short sequences exactly until their pages pay, and `memory()` counts
every byte (the whole arena, its tables, the raw phase's buffers). The README snippet runs without a warning."""

import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import make_model, random_bundle, random_text, smollm2_or_skip
from transformers import DynamicCache

from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.storage.layout import TierFormat

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "artifacts" / "smollm2-135m.kvcal.safetensors"


def documented_allowance(kv) -> int:
    """docs/runtime.md's fixed amount, from its parts: per (sequence, compressed layer, KV head) one page and 4 bytes
    per raw-phase or exact-window token; the page tables and counters as made; the static key scales and calibrated
    levels."""
    store = kv.store
    entries = kv.batch * len(kv.layers) * store.num_kv_heads
    a = store.arena
    tables = a.slots * a.layers * a.kv_heads * (4 * store.initial_table_width + 8) + 2 * store.fill.numel() * 8
    window = kv.windows.size if kv.windows is not None else 0
    return (entries * (store.page_bytes + 4 * (kv.raw_tokens + window)) + tables + store.static_key_bytes()
            + store.level_bytes())


def sweep(decoder, cache, ids: torch.Tensor) -> list[dict]:
    """Prefill ids[:, :1], then one token per step: memory() after each length 1 .. S."""
    out = []
    with torch.inference_mode():
        for t in range(ids.shape[1]):
            decoder(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            out.append(cache.memory())
    return out


def check_bound(mems: list[dict], kv) -> None:
    allowance = documented_allowance(kv)
    for n, m in enumerate(mems, 1):
        assert m["allowance_bytes"] == allowance
        assert m["held_bytes"] <= m["fp16_bytes"] + allowance, (n, m)
        assert m["total_bytes"] <= m["held_bytes"]


@pytest.mark.slow
def test_shipped_bundle_holds_at_most_fp16_at_every_length_1_to_300():
    """The acceptance sweep: the shipped bundle, lengths 1 to 300 one decode step at a time (about 40 s on one
    core; the decoder alone, no logits)."""
    from kvcal import load_bundle
    from kvcal.data import load_corpus, token_windows

    lm = smollm2_or_skip()
    bundle = load_bundle(SHIPPED)
    ids = token_windows(lm.tokenizer, load_corpus("default", "eval"), 1, 300, 0)
    cache = KvcalCache.from_bundle(bundle, lm.model, tokenizer=lm.tokenizer)
    mems = sweep(lm.model.get_decoder(), cache, ids)
    kv = cache.kv
    check_bound(mems, kv)
    assert 0 < kv.raw_tokens < 300 and not kv.raw                  # the sweep crossed into the pages
    assert all(m["ratio_to_fp16"] <= 1.0 for m in mems)          # measured: the tokens' storage alone never exceeds
    assert mems[kv.raw_tokens - 1]["ratio_to_fp16"] == 1.0       # raw: exactly fp16
    assert mems[-1]["ratio_to_fp16"] < mems[kv.raw_tokens]["ratio_to_fp16"] < 1.0     # paged: below fp16, falling
    assert mems[-1]["steady_state_ratio"] < mems[-1]["ratio_to_fp16"]


@pytest.fixture(scope="module")
def tiny():
    model, tok = make_model("llama")
    return model, tok, random_bundle(model, tok)


CONFIGS = {
    "per-channel-low": CompressionConfig(low=TierFormat(4, 2, "channel"),
                                         tiering=TieringConfig(window=8, alpha_high=2.0)),
    "per-token-low": CompressionConfig(high=TierFormat(8, 4), low=TierFormat(4, 2),
                                       tiering=TieringConfig(window=8, alpha_high=2.0, alpha_low=0.5)),
    "untiered-k8v4": CompressionConfig(),
    "exact-window": CompressionConfig(high=TierFormat(8, 8), low=TierFormat(4, 2, "channel"), exact_window=True,
                                      tiering=TieringConfig(window=8, alpha_high=2.0)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_model_bound_at_every_length(tiny, name):
    model, tok, bundle = tiny
    ids = tok([random_text(200, seed=3)], return_tensors="pt").input_ids[:, :160]
    cache = KvcalCache.from_bundle(bundle, model, CONFIGS[name])
    mems = sweep(model.get_decoder(), cache, ids)
    kv = cache.kv
    assert 0 < kv.raw_tokens < ids.shape[1] and not kv.raw
    check_bound(mems, kv)
    assert all(m["ratio_to_fp16"] == 1.0 for m in mems[:kv.raw_tokens])


def test_raw_phase_is_exact_and_hands_over_to_the_pages(tiny):
    """While raw, the kvcal cache attends exactly (logits as DynamicCache's); past raw_tokens it decodes compressed,
    and the pages hold what a prefill of that length would have written."""
    model, tok, bundle = tiny
    cfg = CompressionConfig(low=TierFormat(4, 2, "channel"), tiering=TieringConfig(window=8, alpha_high=1e9))
    ids = tok([random_text(160, seed=4)], return_tensors="pt").input_ids[:, :120]
    cache = KvcalCache.from_bundle(bundle, model, cfg)
    dense = DynamicCache(config=model.config)
    raw_tokens = None
    with torch.inference_mode():
        for t in range(ids.shape[1]):
            got = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits
            ref = model(input_ids=ids[:, t:t + 1], cache=dense, use_cache=True).logits
            raw_tokens = cache.kv.raw_tokens
            if t + 1 <= raw_tokens:
                assert cache.kv.raw and torch.allclose(got, ref, atol=1e-5), t
            else:
                assert not cache.kv.raw
    assert 0 < raw_tokens < ids.shape[1] - 1
    counts = cache.kv.tier_counts()
    assert counts["low"] > 0


def test_raw_phase_crop_select_release(tiny):
    model, tok, bundle = tiny
    ids = tok([random_text(40, seed=5)] * 2, return_tensors="pt").input_ids[:, :12]
    cache = KvcalCache.from_bundle(bundle, model, CONFIGS["per-channel-low"])
    with torch.inference_mode():
        model(input_ids=ids[:, :10], cache=cache, use_cache=True)
        assert cache.kv.raw and cache.get_seq_length() == 10
        cache.crop(-3)
        assert cache.get_seq_length() == 7 and all(r.keys.shape[2] == 7 for r in cache.kv.raw.values())
        cache.reorder_cache(torch.tensor([1, 1]))
        model(input_ids=ids[:, 7:8], cache=cache, use_cache=True)
        assert all(r.keys.shape[2] == 8 for r in cache.kv.raw.values())
        m = cache.memory()
        assert m["ratio_to_fp16"] == 1.0 and m["raw_bytes"] == m["fp16_bytes"]
    cache.release()
    assert cache.kv is None


def test_raw_tokens_zero_writes_every_token_to_the_pages(tiny):
    model, tok, bundle = tiny
    ids = tok([random_text(40, seed=6)], return_tensors="pt").input_ids[:, :10]
    cache = KvcalCache.from_bundle(bundle, model, CONFIGS["per-channel-low"], raw_tokens=0)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    assert not cache.kv.raw and cache.memory()["paged_bytes"] > 0


def test_no_raw_phase_where_pages_never_pay_or_a_policy_needs_the_prompt(tiny):
    model, tok, bundle = tiny
    ids = tok([random_text(40, seed=6)], return_tensors="pt").input_ids[:, :10]
    from kvcal.runtime.policies.fastgen import FastGenConfig

    for cfg in (CompressionConfig.none(), CompressionConfig(fastgen=FastGenConfig())):
        cache = KvcalCache.from_bundle(bundle, model, cfg, tokenizer=tok)
        with torch.inference_mode():
            model(input_ids=ids, cache=cache, use_cache=True)
        assert cache.kv.raw_tokens == 0 and not cache.kv.raw


def test_backends_agree_across_the_hand_over(tiny, monkeypatch):
    """A batch of two hands over mid-decode (prompt 10, raw_tokens 30, 56 tokens): the fused CPU backend and the CUDA
    emulation give the torch backend's logits and tier moves, and the tiers hold every token (no pruning)."""
    from kvcal.runtime import backends as attention

    monkeypatch.setitem(attention.BACKENDS, "cuda-emulated", "kvcal.runtime.backends.cuda.emulate:EmulatedCudaBackend")
    attention.select_backend.cache_clear()
    model, tok, bundle = tiny
    cfg = CompressionConfig(high=TierFormat(8, 4), low=TierFormat(4, 2),
                            tiering=TieringConfig(window=4, alpha_high=1.5, alpha_low=0.0))
    ids = tok([random_text(60, seed=1), random_text(60, seed=2)], return_tensors="pt").input_ids[:, :56]
    runs = {}
    try:
        for backend in ("torch", "cpu", "cuda-emulated"):
            cache = KvcalCache.from_bundle(bundle, model, cfg, raw_tokens=30, serve=ServeOptions(backend))
            with torch.inference_mode():
                logits = [model(input_ids=ids[:, :10], cache=cache, use_cache=True).logits[:, -1]]
                logits += [model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1]
                           for t in range(10, 56)]
            assert not cache.kv.raw and cache.kv.backend.name() == backend
            runs[backend] = (torch.stack(logits, 1), cache.kv.tier_counts())
    finally:
        attention.select_backend.cache_clear()
    want, counts = runs["torch"]
    H, L = model.config.num_key_value_heads, model.config.num_hidden_layers
    assert counts["low"] > 0 and counts["high"] + counts["low"] == 2 * 56 * H * L
    for backend in ("cpu", "cuda-emulated"):
        torch.testing.assert_close(runs[backend][0], want, rtol=1e-4, atol=1e-4)
        assert runs[backend][1] == counts


def test_hand_over_keeps_every_token_of_a_left_padded_batch_and_multi_token_steps(tiny):
    """Left padding, then steps of 4 tokens that cross raw_tokens in the middle of a step: the tiers hold every real
    token (no pruning), the padding none, and each row decodes as it does alone while raw."""
    model, tok, bundle = tiny
    tok.padding_side = "left"
    enc = tok([random_text(12, seed=1), random_text(5, seed=2)], return_tensors="pt", padding=True)
    cfg = CONFIGS["per-channel-low"]
    cache = KvcalCache.from_bundle(bundle, model, cfg, raw_tokens=20)
    alone = KvcalCache.from_bundle(bundle, model, cfg, raw_tokens=20)
    H, L = model.config.num_key_value_heads, model.config.num_hidden_layers
    ids, mask = enc.input_ids, enc.attention_mask
    short = ids[1:, mask[1].bool()]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        model(input_ids=short, cache=alone, use_cache=True)
        for _ in range(3):
            new = torch.randint(3, len(tok), (2, 4), generator=g)
            mask = torch.cat([mask, torch.ones_like(new)], 1)
            got = model(input_ids=new, attention_mask=mask, cache=cache, use_cache=True).logits
            ref = model(input_ids=new[1:], cache=alone, use_cache=True).logits
            if cache.kv.raw:
                torch.testing.assert_close(got[1:], ref, rtol=1e-4, atol=1e-4)
            counts = cache.kv.tier_counts()
            assert counts["high"] + counts["low"] == int(mask.sum()) * H * L
    assert not cache.kv.raw and cache.get_seq_length() == ids.shape[1] + 12


def test_raw_tokens_refused_where_a_policy_needs_the_prompt(tiny):
    """An explicit raw phase with FastGen (or a negative count) is refused up front, not at the hand-over."""
    from kvcal.runtime.policies.fastgen import FastGenConfig

    model, tok, bundle = tiny
    ids = tok([random_text(40, seed=6)], return_tensors="pt").input_ids[:, :10]
    for cfg, raw_tokens, says in ((CompressionConfig(fastgen=FastGenConfig()), 20, "fastgen"),
                                  (CONFIGS["per-channel-low"], -1, "give 0")):
        cache = KvcalCache.from_bundle(bundle, model, cfg, tokenizer=tok, raw_tokens=raw_tokens)
        with pytest.raises(ValueError, match=f"raw_tokens={raw_tokens}: .*{says}"), torch.inference_mode():
            model(input_ids=ids, cache=cache, use_cache=True)


def test_probe_with_a_prompt_shorter_than_the_raw_phase(tiny):
    """A prompt the raw phase would hold: the probe replays it into the raw phase and equals decode_fidelity."""
    from kvcal.eval import DecodeProbe, decode_fidelity

    model, tok, bundle = tiny
    cfg = CONFIGS["per-token-low"]
    ids = tok([random_text(120, seed=1), random_text(120, seed=2)], return_tensors="pt").input_ids[:, :80]
    probe = DecodeProbe(model, bundle, ids[:, :20], ids[:, 20:])
    assert 20 < probe.replay(cfg).kv.raw_tokens < 60
    stepwise = probe.measure(cfg)
    live = decode_fidelity(model, ids[:, :20], ids[:, 20:], lambda: KvcalCache.from_bundle(bundle, model, cfg))
    assert stepwise.top1 == live.top1 and stepwise.kl == pytest.approx(live.kl, rel=1e-4, abs=1e-6)


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    snippet = next(b for b in blocks if "KvcalCache.from_bundle" in b)
    return snippet


def test_readme_snippet_uses_cache_keyword():
    snippet = readme_snippet()
    assert "cache=cache" in snippet and "past_key_values" not in snippet


@pytest.mark.slow
def test_readme_snippet_runs_without_warnings_and_holds_at_most_fp16(monkeypatch, caplog, capsys):
    smollm2_or_skip()                     # skips where the packaged model is missing
    monkeypatch.chdir(ROOT)
    snippet = readme_snippet().replace("print(cache.memory())", "memory = cache.memory()")
    scope: dict = {}
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")
        exec(compile(snippet, "README.md", "exec"), scope)
    deprecated = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert not deprecated, deprecated
    memory = scope["memory"]
    assert memory["ratio_to_fp16"] <= 1.0
    assert memory["held_bytes"] <= memory["fp16_bytes"] + memory["allowance_bytes"]
