"""The opt-in `[bench]` extra on the real packaged model `smollm2-135m` (fp32): transformers' QuantizedCache with the
quanto and HQQ backends (real bytes), kvpress presses at a memory budget, and a kvcal bundle served inside kvpress's
pipeline. Each test skips with the reason when its package (or the model) is not installed: `pip install -e
".[bench]"` (README)."""

import pytest
import torch
from conftest import smollm2_or_skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    return smollm2_or_skip()


def _ids(lm, n: int) -> torch.Tensor:
    from kvcal.data import load_corpus, token_windows

    return token_windows(lm.tokenizer, load_corpus("default", "eval"), 1, n, seed=0)


@pytest.mark.parametrize("backend, module", [("quanto", "optimum.quanto"), ("hqq", "hqq")])
def test_quantized_cache_rows_run_with_real_bytes(smol, backend, module):
    pytest.importorskip(module, reason=f"{module} not installed (opt-in: pip install -e \".[bench]\")")
    from kvcal.bench import methods as M

    model = smol.model
    row = next(m for m in M.cache_methods(model) if m.key == f"hf-{backend}-int4")
    assert row.unavailable is None
    ids = _ids(smol, 300)
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[0, -1]
        cache = row.make_cache(model, smol.tokenizer)
        got = model(input_ids=ids, past_key_values=cache).logits[0, -1]
    L, H, d = 30, 3, 64                        # smollm2-135m: every token of the prompt is quantized at prefill
    per_tensor = H * 300 * d // 2 + H * 300 * d // 64 * 2 * 4   # 4-bit codes + fp32 scale and zero per 64 values
    assert cache.memory()["total_bytes"] == L * 2 * per_tensor
    assert cache.memory()["ratio_to_fp16"] < 0.33
    assert got.argmax() == ref.argmax()        # the prefill itself is dense; the cache is quantized afterwards
    with torch.inference_mode():
        step = model(input_ids=ref.argmax()[None, None], past_key_values=cache).logits[0, -1]
        dense = model(input_ids=torch.cat([ids, ref.argmax()[None, None]], 1)).logits[0, -1]
    assert torch.softmax(dense, -1).dot(torch.log_softmax(dense, -1) - torch.log_softmax(step, -1)) < 0.5


def test_kvpress_press_holds_its_memory_budget(smol):
    pytest.importorskip("kvpress", reason="kvpress not installed (opt-in: pip install -e \".[bench]\")")
    from kvcal.bench import methods as M

    model = smol.model
    rows = {m.key: m for m in M.press_methods(model, 0.3, shortest_prompt=256)}
    assert {"kvpress-snapkv", "kvpress-streamingllm", "kvpress-expected-attention", "kvpress-tova",
            "kvpress-knorm", "kvpress-adakv"} <= set(rows)
    ids = _ids(smol, 256 + 8)
    mems = {}
    for key in ("kvpress-snapkv", "kvpress-adakv"):
        cache = rows[key].make_cache(model, smol.tokenizer, reserve=8)
        with torch.inference_mode():
            model(input_ids=ids[:, :256], past_key_values=cache)
            for i in range(8):
                model(input_ids=ids[:, 256 + i:257 + i], past_key_values=cache)
        mems[key] = cache.memory()
        assert cache.seen == {i: 264 for i in range(30)}
    snap = mems["kvpress-snapkv"]
    # K/V count at 16 bits (as served, whatever the measuring dtype): kept prompt tokens = floor(0.3 * 264) - 8 =
    # 71, plus the 8 decoded ones, in every layer
    assert snap["total_bytes"] == 30 * 2 * 3 * (71 + 8) * 64 * 2
    assert 0.3 - 4 / 264 < snap["ratio_to_fp16"] <= 0.3
    # AdaKV (kvpress) masks keys instead of removing them: the bytes held are the full cache plus its mask
    assert mems["kvpress-adakv"]["total_bytes"] > 30 * 2 * 3 * 264 * 64 * 2


def test_kvcal_bundle_inside_the_kvpress_pipeline(smol):
    pytest.importorskip("kvpress", reason="kvpress not installed (opt-in: pip install -e \".[bench]\")")
    from pathlib import Path

    from kvpress import KnormPress
    from transformers import DynamicCache

    from kvcal import load_bundle
    from kvcal.press import kvcal_pipeline
    from kvcal.runtime.cache import CompressionConfig
    from kvcal.runtime.hf import KvcalCache

    model, tok = smol.model, smol.tokenizer
    bundle = load_bundle(Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m.kvcal.safetensors")
    context = "The capital of France is Paris. The capital of Spain is Madrid. The capital of Italy is Rome. " * 8
    questions = ["What is the capital of Spain?", "What is the capital of Italy?"]
    pipe = kvcal_pipeline(model, tok)
    with torch.inference_mode():
        dense_cache = DynamicCache()
        dense = pipe(context, questions=questions, cache=dense_cache, max_new_tokens=6)["answers"]
        cache = KvcalCache.from_bundle(bundle, model, CompressionConfig.none())
        exact = pipe(context, questions=questions, cache=cache, max_new_tokens=6)["answers"]
        context_len = cache.get_seq_length()
        mem = cache.memory()
        # K8V4 without tiers: the pipeline crops each answer away, and only high-tier tokens can be cropped
        cache = KvcalCache.from_bundle(bundle, model, CompressionConfig(), tokenizer=tok)
        packed = pipe(context, questions=questions, cache=cache, max_new_tokens=6)["answers"]
        tiered = KvcalCache.from_bundle(bundle, model, tokenizer=tok)                     # the bundle's settings
        assert CompressionConfig.from_dict(bundle.settings).tiering.tiered
        with pytest.raises(ValueError, match="cannot crop the cache .* no longer at the high tier"):
            pipe(context, questions=questions, cache=tiered, max_new_tokens=6)
    assert exact == dense                       # each answer cropped away exactly before the next question
    assert context_len == dense_cache.get_seq_length() > 150      # back to the context after each answer
    assert mem["total_bytes"] == mem["paged_bytes"] > 0
    assert len(packed) == 2 and all(isinstance(a, str) for a in packed)
    assert cache.get_seq_length() == context_len
    assert cache.memory()["ratio_to_fp16"] < 0.8                  # real paged bytes, bundle's formats
    with pytest.raises(ValueError, match="a kvpress press cannot compress a KvcalCache"):
        pipe(context, question=questions[0], cache=cache, press=KnormPress(0.5))


def test_docs_bench_example_runs_as_written(monkeypatch, capsys):
    """The ```python block of docs/bench.md (kvcal inside kvpress's pipeline), from the clone's root."""
    pytest.importorskip("kvpress", reason="kvpress not installed (opt-in: pip install -e \".[bench]\")")
    import re
    from pathlib import Path

    from kvcal.models import resolve_model

    try:
        resolve_model("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"smollm2-135m is not installed: {e}")
    root = Path(__file__).resolve().parents[1]
    blocks = re.findall(r"```python\n(.*?)```", (root / "docs" / "bench.md").read_text(), re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(root)
    exec(compile(blocks[0], "docs/bench.md", "exec"), {"__name__": "docs"})
    printed = capsys.readouterr().out
    assert "Madrid" in printed and "paged_bytes" in printed
