"""The batched teacher-forced probe (chunks of the continuation per forward pass) against stepwise decode."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_bundle, random_text

from kvcal.profile.quality import DecodeProbe, teacher_force
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.fastgen import FastGenConfig
from kvcal.runtime.layout import TierFormat
from kvcal.runtime.policy import TokenPolicy


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
    stepwise one (exact agreement is not expected: a chunk's queries read the store before the steps of its earlier tokens)."""
    fast = FastGenConfig(recovery=0.5)
    probe = _probe("llama", fastgen=fast, words=150)
    tiers = CompressionConfig(low=TierFormat(4, 2, "channel"), policy=TokenPolicy(window=16, alpha_high=1.6,
                                                                                  alpha_low=0.5))
    for cfg in (tiers, tiers.with_(fastgen=fast)):
        step, batched = probe.measure(cfg, chunk=1), probe.measure(cfg, chunk=8)
        assert step.predictions == batched.predictions == 2 * (probe.continuation.shape[1] - 1)
        assert abs(step.top1 - batched.top1) <= 0.05
        for tier in ("high", "low", "pruned"):
            assert abs(step.tiers[tier] - batched.tiers[tier]) <= 0.05, (tier, step.tiers, batched.tiers)
        assert step.tiers["high"] < 0.9           # the policies moved tokens: the comparison has teeth


def test_chunk_must_be_positive():
    probe = _probe("llama")
    with pytest.raises(ValueError, match="chunk"):
        probe.measure(CompressionConfig(), chunk=0)
