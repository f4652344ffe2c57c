"""The stepwise decode probe (kvcal.eval.probe): its dense reference, per-window top-1, and the target's bounds."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_bundle, random_text

from kvcal.eval import DecodeProbe, dense_logits
from kvcal.runtime.config import CompressionConfig


def _probe(model_type, fastgen=None, words=110):
    model, tok = make_model(model_type)
    bundle = random_bundle(model, tok)
    ids = tok([random_text(words, seed=5), random_text(words, seed=6)], return_tensors="pt").input_ids
    return DecodeProbe(model, bundle, ids[:, :40], ids[:, 40:], tokenizer=tok, fastgen=fastgen)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_reference_from_the_recorded_prompt_equals_one_dense_forward(model_type):
    """The probe's dense reference continues from the recorded prompt's K/V (sliding layers from their kept window)
    instead of running the prompt again: the logits of one dense forward over prompt + continuation, to float error."""
    probe = _probe(model_type)
    P, M = probe.prompt.shape[1], probe.continuation.shape[1] - 1
    want = dense_logits(probe.model, torch.cat([probe.prompt, probe.continuation], dim=1)[:, :P + M], start=P)
    logp = torch.log_softmax(want, -1)
    assert probe.ref.ids.shape[:2] == want.shape[:2]
    assert (probe.ref.logp - logp.gather(-1, probe.ref.ids)).abs().max().item() < 1e-4
    assert (probe.ref.target_logp - logp.gather(-1, probe.continuation[:, 1:, None])[..., 0]).abs().max() < 1e-4
    assert torch.equal(probe.ref.ids[..., 0], want.argmax(-1))


def test_top_logits_kl_is_exact_over_the_whole_vocabulary_and_a_lower_bound_over_part():
    """Kept whole (k = vocab), the coarsened KL is the KL; over the top k it is at most the KL and close to it
    when the rest holds little mass."""
    from kvcal.eval.fidelity import TopLogits

    g = torch.Generator().manual_seed(0)
    ref, got = torch.randn(2, 5, 300, generator=g) * 4, torch.randn(2, 5, 300, generator=g) * 4
    target = torch.randint(300, (2, 5), generator=g)
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    full = (lp.exp() * (lp - lq)).sum(-1)
    assert torch.allclose(TopLogits.of(ref, target, k=300).kl(lq), full, atol=1e-4)
    part = TopLogits.of(ref, target, k=20).kl(lq)
    assert (part <= full + 1e-5).all() and (part > 0.5 * full).all()


def test_target_bound_covers_variation_between_windows():
    """Two point sets with the same pooled top-1 and count: the one whose windows disagree has the lower bound and
    misses the target; with one window only Wilson applies."""
    from types import SimpleNamespace

    from kvcal.eval import QualityTarget, wilson_lower, window_lower

    target = QualityTarget(top1=0.97, ppl_ratio=1.02, z=1.5)
    steady = SimpleNamespace(top1=0.985, predictions=1024, ppl_ratio=1.0, top1_windows=[0.98, 0.99, 0.98, 0.99])
    spread = SimpleNamespace(top1=0.985, predictions=1024, ppl_ratio=1.0, top1_windows=[1.0, 1.0, 1.0, 0.94])
    assert target.met(steady) and not target.met(spread)
    assert target.top1_bound(spread) == window_lower(spread.top1_windows, 1.5) < wilson_lower(0.985, 1024, 1.5)
    single = SimpleNamespace(top1=0.985, predictions=1024, ppl_ratio=1.0, top1_windows=[0.985])
    assert target.top1_bound(single) == wilson_lower(0.985, 512, 1.5)          # held to a 512-prediction evaluation
    assert target.with_(held_out_predictions=0).top1_bound(single) == wilson_lower(0.985, 1024, 1.5)


def test_a_check_is_held_to_the_bound_of_the_smaller_held_out_evaluation():
    """qwen2.5-coder-1.5b's shipped check at bcea9ba: 1003 of 1024 (0.979) met its own Wilson bound, and kvcal
    bench's 512 predictions on other documents then read 500 (0.977), under the 503 that bench's bound needs. Held to
    the 512-prediction bound, the same check misses; 503 of 512 meets it; a smaller evaluation is not held to 512."""
    from kvcal.eval import QualityTarget

    target = QualityTarget()
    check = {"top1": 1003 / 1024, "predictions": 1024, "ppl_ratio": 1.0}
    assert target.with_(held_out_predictions=0).met(check) and not target.met(check)
    assert target.met({**check, "top1": 503 / 512, "predictions": 512})
    assert not target.met({**check, "top1": 500 / 512, "predictions": 512})
    assert target.top1_bound({"top1": 0.99, "predictions": 256}) == target.with_(held_out_predictions=0).top1_bound(
        {"top1": 0.99, "predictions": 256})


def test_probe_reports_top1_per_window():
    probe = _probe("llama")
    f = probe.measure(CompressionConfig())
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


def test_target_round_trips_and_refuses_what_it_is_not():
    """A report's or bundle's target reads back as the same rule; unknown keys and non-numbers are refused."""
    from kvcal.eval import QualityTarget

    target = QualityTarget(top1=0.98, ppl_ratio=1.01, z=2.0)
    assert QualityTarget.from_dict(target.to_dict()) == target
    # a target recorded before held_out_predictions: the bound over every prediction, as it was decided
    assert QualityTarget.from_dict({"top1": 0.9}) == QualityTarget(top1=0.9, held_out_predictions=0)
    with pytest.raises(ValueError, match="unknown keys"):
        QualityTarget.from_dict({"top1": 0.9, "margin": 0.01})
    with pytest.raises(ValueError, match="not a number"):
        QualityTarget.from_dict({"top1": "high"})
    for count in (1.5, -1, "many", float("inf")):
        with pytest.raises(ValueError, match="count >= 0"):
            QualityTarget.from_dict({"held_out_predictions": count})
    assert QualityTarget.from_dict({"held_out_predictions": 1024.0}).held_out_predictions == 1024
    assert target.met({"top1": 0.999, "predictions": 4096, "ppl_ratio": 1.0})
    assert not target.met({"top1": 0.999, "predictions": 4096, "ppl_ratio": 1.02})


def test_record_prompt_then_prime_serves_as_the_prefill_would():
    """`KvcalCache.record_prompt` + `prime` is the public way to replay one prefill into many caches: the primed
    cache holds the tiers and bytes of a cache that ran the prefill itself, and decodes the same next token."""
    from kvcal.runtime.hf import KvcalCache

    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    ids = tok([random_text(110, seed=5)], return_tensors="pt").input_ids[:, :60]
    cfg = CompressionConfig()
    with torch.inference_mode():
        records, last = KvcalCache.record_prompt(bundle, model, ids[:, :59], tokenizer=tok)
        primed = KvcalCache.from_bundle(bundle, model, cfg, tokenizer=tok)
        primed.prime(records, token_ids=ids[:, :59])
        live = KvcalCache.from_bundle(bundle, model, cfg, tokenizer=tok)
        want = model(input_ids=ids[:, :59], cache=live, use_cache=True).logits[:, -1]
        got = [model(input_ids=ids[:, 59:60], cache=c, use_cache=True).logits[:, -1] for c in (primed, live)]
    assert torch.equal(last.argmax(-1), want.argmax(-1))
    assert primed.kv.tier_counts() == live.kv.tier_counts()
    assert primed.memory()["total_bytes"] == live.memory()["total_bytes"]
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_bf16_prefill_is_shared_by_the_reference_and_the_measured_cache(model_type):
    """With `prefill_dtype=bfloat16` the prompts are prefilled in bf16 and the reference and each measured
    continuation run in float32 over the same recorded K/V: the reference moves by bf16 rounding (the prefill did run
    in bf16), yet a cache that holds the prompt as recorded (raw tiers) still reads the reference to fp16 rounding,
    so the prefill's rounding is not charged to compression."""
    model, tok = make_model(model_type)
    bundle = random_bundle(model, tok)
    ids = tok([random_text(110, seed=5), random_text(110, seed=6)], return_tensors="pt").input_ids
    probes = {dtype: DecodeProbe(model, bundle, ids[:, :40], ids[:, 40:], tokenizer=tok, prefill_dtype=dtype)
              for dtype in (None, torch.bfloat16)}
    assert (probes[None].ref.logp - probes[torch.bfloat16].ref.logp).abs().max() > 1e-4
    fid = probes[torch.bfloat16].measure(CompressionConfig.none())
    assert fid.top1 == 1.0
    assert abs(fid.kl) < 1e-6
