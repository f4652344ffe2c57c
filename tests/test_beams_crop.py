"""`generate`'s edits of a `KvcalCache`: beam search and batch selection/repetition (page tables re-indexed, pages
shared and copied on write) and `crop` (assisted decoding's rollback). On the real packaged model `smollm2-135m`
(fp32) against transformers' `DynamicCache`; skipped with the reason when the model package is not installed."""

import pytest
import torch
from conftest import smollm2_or_skip
from transformers import DynamicCache

from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.storage.layout import TierFormat

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is a city that", "Once upon a time, in a land far"]
K8V8 = CompressionConfig(high=TierFormat(8, 8), use_ranks=False)         # per-token 8-bit, untiered


@pytest.fixture(scope="module")
def smol():
    from pathlib import Path

    from kvcal import load_bundle

    lm = smollm2_or_skip()

    path = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m.kvcal.safetensors"
    lm.tokenizer.padding_side = "left"
    return lm, load_bundle(path)


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_beam_search_matches_dense(smol):
    lm, bundle = smol
    model = lm.model
    inputs = lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, do_sample=False, num_beams=2, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(**inputs, cache=DynamicCache(config=model.config), **kw)
        cache = KvcalCache.from_bundle(bundle, model, CompressionConfig.none())
        got = model.generate(**inputs, cache=cache, **kw)
    assert torch.equal(ref.sequences, got.sequences)
    assert _max_diff(ref.scores, got.scores) < 1e-4
    arena = cache.kv.store.arena
    arena.check_invariants()                                   # refs count the page-table cells, nothing lost
    assert cache.kv.batch == 4
    # beams share their prompt's pages: fewer pages than 4 unshared sequences would hold
    per_seq = arena.num_pages_used.sum((1, 2, 3))
    assert arena.num_used < int(per_seq.sum())
    assert cache.memory()["paged_bytes"] == arena.num_used * arena.page_bytes
    used = arena.num_used
    assert cache.release() == used and arena.num_free == arena.num_pages      # shared pages freed once each


@pytest.mark.parametrize("config", [CompressionConfig.none(), K8V8], ids=["none", "K8V8"])
def test_select_and_repeat_match_dense(smol, config):
    """batch_repeat_interleave then batch_select_indices on a filled cache, then decoding on: the rows must follow
    the same rows of a DynamicCache given the same edits (K8V8: against itself unedited, row by row)."""
    lm, bundle = smol
    model = lm.model
    inputs = lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        # raw_tokens=0: the short prompts would stay in the raw phase, whose rows are copied, not shared pages
        cache = KvcalCache.from_bundle(bundle, model, config, raw_tokens=0)
        out = model(**inputs, cache=cache)
        nxt = out.logits[:, -1].argmax(-1)                                          # [2]
        cache.batch_repeat_interleave(2)                                            # rows 0 0 1 1
        cache.batch_select_indices(torch.tensor([3, 0, 2]))                         # rows 1 0 1
        assert cache.kv.store.arena.shared
        ids = torch.stack([nxt[1], nxt[0], torch.tensor(17)])[:, None]            # row 2 diverges from row 0
        mask = torch.cat([inputs.attention_mask[[1, 0, 1]], torch.ones(3, 1, dtype=torch.long)], 1)
        got = model(input_ids=ids, attention_mask=mask, cache=cache).logits[:, -1]
        cache.kv.store.arena.check_invariants()

        ref_cache = (DynamicCache(config=model.config) if config is CompressionConfig.none()
                     else KvcalCache.from_bundle(bundle, model, config, raw_tokens=0))
        model(**inputs, cache=ref_cache)
        ref_ids = torch.stack([nxt[0], nxt[1]])[:, None]
        ref01 = model(input_ids=ref_ids, attention_mask=torch.cat([inputs.attention_mask, torch.ones(2, 1,
                      dtype=torch.long)], 1), cache=ref_cache).logits[:, -1]
    assert (got[1] - ref01[0]).abs().max() < 1e-4
    assert (got[0] - ref01[1]).abs().max() < 1e-4
    assert not torch.allclose(got[0], got[2], atol=1e-3)       # same history, another token: its own pages
    cache.release()
    assert cache.kv is None


@pytest.mark.parametrize("config", [CompressionConfig.none(), K8V8], ids=["none", "K8V8"])
def test_crop_then_generate_matches_a_fresh_run(smol, config):
    """Generate 16 tokens, crop the last 8 of the cache, continue: the same tokens and logits as one run that
    generates straight through (assisted decoding's rollback)."""
    lm, bundle = smol
    model = lm.model
    inputs = lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    P = inputs.input_ids.shape[1]
    kw = dict(do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        fresh = model.generate(**inputs, cache=KvcalCache.from_bundle(bundle, model, config),
                               max_new_tokens=20, **kw)
        cache = KvcalCache.from_bundle(bundle, model, config)
        first = model.generate(**inputs, cache=cache, max_new_tokens=16, **kw)
        assert cache.get_seq_length() == P + 15                     # the last token is not fed yet
        pages = cache.kv.store.arena.num_used
        cache.crop(-7)                                              # keep the prompt and 8 generated tokens
        assert cache.get_seq_length() == P + 8
        assert cache.kv.store.arena.num_used <= pages
        cache.kv.store.arena.check_invariants()
        keep = first.sequences[:, :P + 9]                           # the 9th generated token is not cached
        mask = torch.cat([inputs.attention_mask, torch.ones(2, 9, dtype=torch.long)], 1)
        cont = model.generate(input_ids=keep, attention_mask=mask, cache=cache, max_new_tokens=11, **kw)
    assert torch.equal(cont.sequences, fresh.sequences)
    assert _max_diff(cont.scores, fresh.scores[9:]) < 1e-4


def test_crop_refuses_tokens_that_left_the_high_tier(smol):
    """A tiered cache whose newest tokens were moved low: crop raises one line naming the fix, changes nothing."""
    lm, bundle = smol
    model = lm.model
    cfg = CompressionConfig(high=TierFormat(8, 8), low=TierFormat(4, 2), use_ranks=False,
                            tiering=TieringConfig(alpha_high=1e9, alpha_low=0.0, window=4))
    inputs = lm.tokenizer(PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():
        # raw_tokens=0: in the raw phase no token leaves the high tier, and crop is always exact
        cache = KvcalCache.from_bundle(bundle, model, cfg, raw_tokens=0)
        model.generate(**inputs, cache=cache, max_new_tokens=2, do_sample=False)
    n = cache.get_seq_length()
    before = cache.memory()
    with pytest.raises(ValueError, match=r"^cannot crop the cache to \d+ tokens: .*no longer at the high tier.*; "
                                         r"crop fewer tokens") as e:
        cache.crop(-(n - 1))
    assert "\n" not in str(e.value)
    assert cache.get_seq_length() == n and cache.memory() == before
    with pytest.raises(ValueError, match=r"pass a negative number"):
        cache.crop(3)
    cache.crop(-1)                                               # the newest token is still high: exact
    assert cache.get_seq_length() == n - 1
