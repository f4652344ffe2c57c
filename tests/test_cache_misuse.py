"""Issue 34, runtime items: a `KvcalCache` used as a user would, with `generate`, but wrongly: a new batch size
without `release()`, another model, a prompt past the model's positions, two threads at once. After each, what the
model produces equals a fresh cache's output, or the call raises."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from conftest import make_model, random_bundle, random_text
from transformers import DynamicCache

from kvcal.runtime.bundle import BundleMismatchError
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache

pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(tok, n: int, seed: int = 0):
    tok.padding_side = "left"
    return tok([random_text(8 + 5 * i, seed=seed + i) for i in range(n)], return_tensors="pt", padding=True)


def generate(model, inputs, cache, n: int = 5, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(**inputs, cache=cache, max_new_tokens=n, do_sample=False, **kwargs)


# ---------------------------------------------------------------------------------------------- batch size


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])     # gemma3: sliding layers come first
@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("raw_tokens", [None, 0])                    # raw phase, or pages from the first token
def test_new_batch_size_without_release_raises(model_type, rows, raw_tokens):
    model, tok = make_model(model_type)
    bundle = random_bundle(model, tok)
    cache = KvcalCache.from_bundle(bundle, model, raw_tokens=raw_tokens)
    generate(model, prompts(tok, 2), cache)
    new = prompts(tok, rows, seed=10)
    with pytest.raises(ValueError, match=r"holds a batch of 2 sequences and the call brings "
                                         rf"{rows}: call `cache\.release\(\)`"):
        generate(model, new, cache)
    cache.release()
    assert torch.equal(generate(model, new, cache), generate(model, new, KvcalCache.from_bundle(bundle, model)))


def test_reset_empties_the_cache_like_release():
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    cache = KvcalCache.from_bundle(bundle, model, raw_tokens=0)
    generate(model, prompts(tok, 2), cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.memory()["fp16_bytes"] == 0
    new = prompts(tok, 3, seed=10)
    assert torch.equal(generate(model, new, cache), generate(model, new, KvcalCache.from_bundle(bundle, model)))


def test_beam_search_still_changes_the_batch():
    """Beams widen the batch and reorder it through the Cache API: no error, and exact without compression."""
    model, tok = make_model("llama")
    inputs = prompts(tok, 2)
    kw = dict(num_beams=3, num_return_sequences=2)
    dense = generate(model, inputs, DynamicCache(config=model.config), **kw)
    got = generate(model, inputs, KvcalCache.from_bundle(random_bundle(model, tok), model, CompressionConfig.none()),
                   **kw)
    assert torch.equal(dense, got)


# ---------------------------------------------------------------------------------------------- another model


def test_another_model_without_kvcal_attention_raises():
    """The README's usage, batch 1: the other model never ran `from_bundle`, so it attends with SDPA."""
    model, tok = make_model("llama")
    other, _ = make_model("llama", seed=1)
    bundle = random_bundle(model, tok)
    cache = KvcalCache.from_bundle(bundle, model)
    ids = prompts(tok, 1)
    with pytest.raises(BundleMismatchError, match="does not run kvcal's attention"):
        generate(other, ids, cache)
    cache.release()
    assert torch.equal(generate(model, ids, cache), generate(model, ids, KvcalCache.from_bundle(bundle, model)))


def test_another_model_with_its_own_cache_raises():
    """Both models are installed and have the same shapes: only the model object tells them apart."""
    model, tok = make_model("llama")
    other, _ = make_model("llama", seed=1)
    cache = KvcalCache.from_bundle(random_bundle(model, tok), model)
    mine = KvcalCache.from_bundle(random_bundle(other, tok), other)
    for rows in (1, 2):
        with pytest.raises(BundleMismatchError, match="another model called it"):
            generate(other, prompts(tok, rows), cache)
    assert cache.get_seq_length() == 0 and cache.kv is None                  # refused before any layer ran
    generate(other, prompts(tok, 2), mine)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("shape", [dict(num_key_value_heads=1), dict(head_dim=32), dict(num_hidden_layers=3)])
def test_another_shape_raises(shape, rows):
    model, tok = make_model("llama")
    other, _ = make_model("llama", seed=1, **shape)
    cache = KvcalCache.from_bundle(random_bundle(model, tok), model)
    with pytest.raises(BundleMismatchError, match="KvcalCache.from_bundle"):
        generate(other, prompts(tok, rows), cache)
    KvcalCache.from_bundle(random_bundle(other, tok), other)                  # installs kvcal on the other model
    with pytest.raises(BundleMismatchError, match="another model called it"):
        generate(other, prompts(tok, rows), KvcalCache.from_bundle(random_bundle(model, tok), model))


# ---------------------------------------------------------------------------------------------- positions


def test_past_the_models_positions_warns_once_per_cache(caplog):
    model, tok = make_model("llama", max_position_embeddings=32)
    bundle = random_bundle(model, tok)
    ids = tok([random_text(40, seed=3)], return_tensors="pt")
    assert ids.input_ids.shape[1] > 32
    short = tok([random_text(10, seed=3)], return_tensors="pt")
    with caplog.at_level(logging.WARNING, logger="kvcal.runtime.hf"):
        generate(model, short, KvcalCache.from_bundle(bundle, model), n=4)
        assert not [r for r in caplog.records if r.name == "kvcal.runtime.hf"]
        cache = KvcalCache.from_bundle(bundle, model)
        generate(model, ids, cache, n=4)
        generate(model, ids, KvcalCache.from_bundle(bundle, model), n=4)
    warned = [r.getMessage() for r in caplog.records if r.name == "kvcal.runtime.hf"]
    assert len(warned) == 2 and "past the model's 32" in warned[0]


# ---------------------------------------------------------------------------------------------- threads


def test_two_threads_at_once_raise_and_release_recovers():
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    cache = KvcalCache.from_bundle(bundle, model)
    inside, go_on = threading.Event(), threading.Event()

    def hold(module, args):                       # keeps the first thread inside its forward call
        if threading.current_thread().name == "first":
            inside.set()
            assert go_on.wait(30)

    handle = model.get_decoder().layers[0].register_forward_pre_hook(hold)
    errors = []

    def first():
        try:
            with torch.no_grad():
                out = model(**prompts(tok, 1), cache=cache, use_cache=True)       # held, then finishes
                model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        except RuntimeError as e:
            errors.append(str(e))

    worker = threading.Thread(target=first, name="first")
    try:
        worker.start()
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match="two threads used this KvcalCache at once"), torch.no_grad():
            model(**prompts(tok, 1, seed=5), cache=cache, use_cache=True)
    finally:
        go_on.set()
        worker.join(30)
        handle.remove()
    assert len(errors) == 1 and "two threads" in errors[0]          # the first thread's next call is refused too
    cache.release()
    ids = prompts(tok, 2)
    assert torch.equal(generate(model, ids, cache), generate(model, ids, KvcalCache.from_bundle(bundle, model)))


def test_a_cache_handed_to_another_thread_between_calls_works():
    """Only overlapping calls are refused: a thread may go on with what another thread's finished call left."""
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    ids = tok([random_text(12, seed=1)], return_tensors="pt").input_ids
    cache, out = KvcalCache.from_bundle(bundle, model), []
    worker = threading.Thread(target=lambda: out.append(generate(model, {"input_ids": ids}, cache, n=3)))
    worker.start()
    worker.join(60)
    with torch.no_grad():
        model(input_ids=out[0][:, -1:], cache=cache, use_cache=True)
    assert cache.get_seq_length() == out[0].shape[1]
    cache.release()
    assert torch.equal(out[0], generate(model, {"input_ids": ids}, cache, n=3))
