"""The batched teacher-forced probe (chunks of the continuation per forward pass) against stepwise decode."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_bundle, random_text

from kvcal.profile.quality import DecodeProbe, dense_logits, teacher_force
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.diffkv import TieringConfig
from kvcal.runtime.fastgen import FastGenConfig
from kvcal.runtime.layout import TierFormat


def _probe(model_type, fastgen=None, words=110):
    model, tok = make_model(model_type)
    bundle = random_bundle(model, tok)
    ids = tok([random_text(words, seed=5), random_text(words, seed=6)], return_tensors="pt").input_ids
    return DecodeProbe(model, bundle, ids[:, :40], ids[:, 40:], tokenizer=tok, fastgen=fastgen)


def _logits(probe, config, chunk):
    with torch.inference_mode():
        cache = probe.replay(config, chunk=chunk)
        got, _ = teacher_force(probe.model, cache, probe.continuation, chunk)
        memory = cache.memory()
        cache.release()
    return got, memory


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
@pytest.mark.parametrize("high", ["K8V4", "K8V4g16", "K16V16"])
def test_batched_probe_equals_stepwise_without_token_policies(model_type, high):
    """Without token policies nothing moves between the steps of a chunk, so a chunk's tokens must see each other
    exactly as stepwise decode stores them (rounded through the high tier): the same logits up to float error. A
    chunked attend that read its own tokens unquantized would differ by the quantization error (checked too)."""
    probe = _probe(model_type)
    cfg = CompressionConfig(high=TierFormat.parse(high))
    step, mem_step = _logits(probe, cfg, 1)
    for chunk in (7, 64):
        got, mem = _logits(probe, cfg, chunk)
        assert got.shape == step.shape
        assert (got - step).abs().max().item() < 1e-3, (chunk, (got - step).abs().max().item())
        assert mem == mem_step
    if high != "K16V16":
        from kvcal.runtime.hf import KvcalCache

        with torch.inference_mode():      # the runtime's own attend on a chunk: its tokens are not rounded
            cache = KvcalCache.from_bundle(probe.bundle, probe.model, cfg)
            cache.prime(probe.records)
            plain, _ = teacher_force(probe.model, cache, probe.continuation, 64)
        assert (plain - step).abs().max().item() > 10 * (got - step).abs().max().item()


def test_batched_probe_tracks_stepwise_with_tiers_and_fastgen():
    """With DiffKV tiers and FastGen the policy steps still run per token, so the batched probe lands near the
    stepwise one (exact agreement is not expected: a chunk's queries read the store before the steps of its earlier
    tokens)."""
    fast = FastGenConfig(recovery=0.5)
    probe = _probe("llama", fastgen=fast, words=150)
    tiers = CompressionConfig(low=TierFormat(4, 2, "channel"), tiering=TieringConfig(window=16, alpha_high=1.6,
                                                                                  alpha_low=0.5))
    untracked = tiers.with_tiering(alpha_low=0.0)     # nothing pruned: low pages keep no score or position
    assert not untracked.low_tracked
    for cfg in (tiers, tiers.with_(fastgen=fast), untracked):
        step, batched = probe.measure(cfg, chunk=1), probe.measure(cfg, chunk=8)
        assert step.predictions == batched.predictions == 2 * (probe.continuation.shape[1] - 1)
        assert abs(step.top1 - batched.top1) <= 0.05
        for tier in ("high", "low", "pruned"):
            assert abs(step.tiers[tier] - batched.tiers[tier]) <= 0.05, (tier, step.tiers, batched.tiers)
        assert step.tiers["high"] < 0.9           # the policies moved tokens: the comparison has teeth


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_reference_from_the_recorded_prompt_equals_one_dense_forward(model_type):
    """The probe's dense reference continues from the recorded prompt's K/V (sliding layers from their kept window)
    instead of running the prompt again: the logits of one dense forward over prompt + continuation, to float error."""
    probe = _probe(model_type)
    P, M = probe.prompt.shape[1], probe.continuation.shape[1] - 1
    want = dense_logits(probe.model, torch.cat([probe.prompt, probe.continuation], dim=1)[:, :P + M], start=P)
    assert probe.ref.shape == want.shape
    assert (probe.ref - want).abs().max().item() < 1e-4
    assert torch.equal(probe.ref.argmax(-1), want.argmax(-1))


def test_chunk_must_be_positive():
    probe = _probe("llama")
    with pytest.raises(ValueError, match="chunk"):
        probe.measure(CompressionConfig(), chunk=0)


def test_target_bound_covers_variation_between_windows():
    """Two point sets with the same pooled top-1 and count: the one whose windows disagree has the lower bound and
    misses the target; with one window only Wilson applies."""
    from types import SimpleNamespace

    from kvcal.profile.quality import QualityTarget, wilson_lower, window_lower

    target = QualityTarget(top1=0.97, ppl_ratio=1.02, z=1.5)
    steady = SimpleNamespace(top1=0.985, predictions=1024, ppl_ratio=1.0, top1_windows=[0.98, 0.99, 0.98, 0.99])
    spread = SimpleNamespace(top1=0.985, predictions=1024, ppl_ratio=1.0, top1_windows=[1.0, 1.0, 1.0, 0.94])
    assert target.met(steady) and not target.met(spread)
    assert target.top1_bound(spread) == window_lower(spread.top1_windows, 1.5) < wilson_lower(0.985, 1024, 1.5)
    single = SimpleNamespace(top1=0.985, predictions=1024, ppl_ratio=1.0, top1_windows=[0.985])
    assert target.top1_bound(single) == wilson_lower(0.985, 1024, 1.5)


def test_probe_reports_top1_per_window():
    probe = _probe("llama")
    f = probe.measure(CompressionConfig(), chunk=16)
    assert len(f.top1_windows) == 2 and abs(sum(f.top1_windows) / 2 - f.top1) < 1e-6


def test_long_first_windows_come_from_single_long_documents():
    from conftest import make_tokenizer

    from kvcal.data.corpora import Corpus, token_windows

    tok = make_tokenizer()
    short = [random_text(5, seed=s) for s in range(40)]
    long = [random_text(80, seed=100 + s) for s in range(3)]
    corpus = Corpus("mixed", tuple(short[:20] + long + short[20:]), "x")
    w = token_windows(tok, corpus, 4, 50, seed=0, long_first=True)
    starts = {tuple(tok(d).input_ids[:50]) for d in long}
    assert sum(tuple(row.tolist()) in starts for row in w) == 3      # one window per long document
    plain = token_windows(tok, corpus, 4, 50, seed=0)
    assert sum(tuple(row.tolist()) in starts for row in plain) < 3
