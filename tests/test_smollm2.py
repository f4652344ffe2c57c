"""Acceptance checks on the real packaged model `smollm2-135m` (fp32): exactness without compression in `generate`,
K8V8 fidelity, memory accounting. Skipped with the reason when the model package is not installed."""

import pytest
import torch
from transformers import DynamicCache

from kvcal.data import load_corpus, token_windows
from kvcal.eval import decode_fidelity
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.storage.layout import TierFormat

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from kvcal.models import load_model
    from kvcal.profile.calibrate import CalibrationConfig, calibrate

    try:
        lm = load_model("smollm2-135m", dtype="float32")
    except ValueError as e:
        pytest.skip(f"smollm2-135m unavailable: {e}")
    out = tmp_path_factory.mktemp("smol") / "b.safetensors"
    res = calibrate(CalibrationConfig(random_tokens=2048, text_tokens=2048, out=out, dtype="float32", search=False),
                    lm=lm)
    return lm, res.bundle


def test_no_compression_generate_matches_dense_logits(smol):
    lm, bundle = smol
    tok, model = lm.tokenizer, lm.model
    tok.padding_side = "left"
    docs = load_corpus("default", "eval").documents
    inputs = tok([docs[0][:400], docs[1][:150]], return_tensors="pt", padding=True)
    assert inputs.attention_mask[1].sum() < inputs.attention_mask[0].sum()   # different prompt lengths, padded
    kw = dict(max_new_tokens=64, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(**inputs, cache=DynamicCache(config=model.config), **kw)
        cache = KvcalCache.from_bundle(bundle, model, CompressionConfig.none())
        got = model.generate(**inputs, cache=cache, **kw)
    assert len(got.scores) == 64
    diff = max((a - b).abs().max().item() for a, b in zip(ref.scores, got.scores))
    assert diff < 1e-4, diff
    assert torch.equal(ref.sequences, got.sequences)
    arena = cache.kv.store.arena
    assert cache.memory()["paged_bytes"] == arena.num_used * arena.page_bytes
    cache.release()
    assert arena.num_free == arena.num_pages


def test_k8v8_full_rank_keeps_top1(smol):
    lm, bundle = smol
    ids = token_windows(lm.tokenizer, load_corpus("default", "eval"), 1, 512 + 257, seed=1)
    cfg = CompressionConfig(high=TierFormat(8, 8), use_ranks=False)          # no pruning: policy untiered
    res = decode_fidelity(lm.model, ids[:, :512], ids[:, 512:], lambda: KvcalCache.from_bundle(bundle, lm.model, cfg))
    assert res.predictions == 256
    assert res.top1 >= 0.99, res
    assert res.tiers["pruned"] == 0 and res.tiers["low"] == 0
    assert res.memory["ratio_to_fp16"] < 0.6
