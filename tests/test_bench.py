"""`kvcal bench` on tiny random models: each baseline's memory accounting, exact eviction budgets, the dense baseline
against the model's own logits, the store's special cases, and the report schema through the CLI."""

import json
import math

import pytest
import torch
from conftest import decode_logits, make_model, random_text
from typer.testing import CliRunner

from kvcal.bench import caches as C
from kvcal.bench import methods as M
from kvcal.bench.lowrank import PaluCache, palu_factors
from kvcal.bench.report import SCHEMA, SCHEMA_VERSION, validate
from kvcal.cli import app
from kvcal.models import adapter_for
from kvcal.profile.calibrate import CalibrationConfig, calibrate
from kvcal.runtime.storage.layout import PageLayout, TierFormat

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    model, tok = make_model("llama")
    return model, tok, adapter_for(model.config)


@pytest.fixture(scope="module")
def bundle_path(tiny_dir, text_file, tmp_path_factory):
    """A calibrated bundle (settings chosen by the quality model and probes), as `kvcal calibrate` writes it."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("bench") / "tiny.kvcal.safetensors"
    calibrate(CalibrationConfig(model=str(tiny_dir), out=out, random_tokens=256, text_tokens=256, seq_len=64,
                                dataset=str(text_file), dtype="float32", search=True, search_windows=2,
                                search_prompt=48, search_steps=6, eval_windows=2, eval_steps=6, window=8,
                                target_top1=0.5, target_ppl_ratio=1.5))
    return out


def _ids(tok, n_seq=2, n_words=70):
    rows = [tok(random_text(n_words, seed=s), return_tensors="pt").input_ids[0, :n_words] for s in range(n_seq)]
    return torch.stack(rows)


def _held(obj) -> int:
    """Bytes of every tensor an object holds in its attributes, found independently of its `memory()`."""
    total = 0
    for value in vars(obj).values():
        items = value if isinstance(value, tuple) else (value,)
        total += sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))
    return total


# --------------------------------------------------------------------------------------------- baselines


def test_dense_baseline_reproduces_the_models_own_logits(tiny):
    model, tok, a = tiny
    ids = _ids(tok)
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[:, 39:]
    cache = C.DenseCache(config=model.config)
    got = decode_logits(model, cache, ids, 40)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    mem = cache.memory()
    B, S = ids.shape
    # float32 K and V of every token are held; the bench counts dense tensors at 16 bits, as served
    assert sum(_held(layer) for layer in cache.layers) == a.num_layers * B * a.num_kv_heads * S * a.head_dim * 4 * 2
    assert mem["total_bytes"] == a.num_layers * B * a.num_kv_heads * S * a.head_dim * 2 * 2
    assert mem["ratio_to_fp16"] == 1.0


def _eviction(model, tok, name, ratio, **settings):
    """A KvcalCache serving the eviction baseline `name` as the bench builds it, budgeted to `ratio` of fp16 bytes,
    with its settings changed by `settings`."""
    import dataclasses

    from conftest import random_bundle

    a = adapter_for(model.config)
    method = next(m for m in M.matched_methods(model, a, ratio, lambda: None, random_bundle(model, tok))
                  if m.key == name)
    method.config = method.config.with_(**{name: dataclasses.replace(getattr(method.config, name), **settings)})
    return method


def _kept_positions(cache, layer):
    """Cache indices each (sequence, KV head) holds in `layer`, sorted: int64 [B, H, kept] (the same count for every
    entry, or the stack fails)."""
    kv = cache.kv
    b, h = kv.every_entry()
    pos = torch.cat([kv.store.section_meta(layer, side, b, h)[1] for side in (0, 1)], dim=-1)
    rows = [p[p >= 0].sort().values for p in pos]
    return torch.stack(rows).view(kv.batch, kv.store.num_kv_heads, -1)


@pytest.mark.parametrize("name, ratio, P, settings", [("streamingllm", 0.3, 40, {}), ("h2o", 0.3, 40, {}),
                                                     ("snapkv", 0.5, 56, {"window": 8})])
def test_eviction_keeps_exactly_the_budget_and_counts_what_it_holds(tiny, name, ratio, P, settings):
    """Each eviction baseline, a runtime token policy, holds exactly its token budget after every step, keeps the
    tokens its method defines, and its real page bytes meet the matched ratio (plus at most one page per entry)."""
    model, tok, a = tiny
    ids = _ids(tok)
    steps = ids.shape[1] - P
    method = _eviction(model, tok, name, ratio, **settings)
    cache = method.make_cache(model, tok, reserve=steps)
    cfg = getattr(cache.config, name)                      # SnapKV: with the steps to come as its reserve
    assert cfg.fraction == pytest.approx(M.eviction_fraction(ratio, a.head_dim))
    layers = range(a.num_layers)
    with torch.inference_mode():
        model(input_ids=ids[:, :P], cache=cache, use_cache=True)
        for t in range(P, ids.shape[1]):
            want = cfg.prompt_tokens(P) + t - P if name == "snapkv" else cfg.tokens(t)
            assert all(_kept_positions(cache, i).shape[-1] == want for i in layers), (t, want)
            model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    n = ids.shape[1]
    final = _kept_positions(cache, 0).shape[-1]
    assert final == cfg.tokens(n)                                                 # memory met at the end
    for i in layers:
        pos = _kept_positions(cache, i)
        if name == "streamingllm":
            assert bool((pos == torch.tensor([0, 1, 2, 3] + list(range(n - final + 4, n)))).all())
        elif name == "h2o":
            recent = int(cfg.recent_for(torch.tensor([final]))[0])
            assert bool((pos[..., -recent:] == torch.arange(n - recent, n)).all())
        else:                                             # the observation window, then every decode token
            assert bool((pos[..., -(steps + 8):] == torch.arange(P - 8, n)).all())
    mem = cache.memory()
    page = cache.kv.store.page_bytes
    fp16 = a.num_layers * 2 * a.num_kv_heads * n * a.head_dim * 4
    assert mem["total_bytes"] == cache.kv.store.bytes_in_use() and mem["fp16_bytes"] == fp16
    # matched: a budget's rounding up (one slot) and a partly filled page of slack per entry at most
    slot = page // PageLayout.build(TierFormat(16, 16), a.head_dim, a.head_dim, page).tokens
    assert ratio <= mem["ratio_to_fp16"] <= ratio + a.num_layers * 2 * a.num_kv_heads * (page + slot) / fp16
    assert page == M.eviction_page_bytes(a.head_dim)
    assert cache.kv.store.high.name == "K16V16" and not cache.kv.config.rotate and not cache.kv.config.use_ranks
    cache.release()


def test_h2o_keeps_the_heaviest_hitters(tiny):
    """After a prefill, H2O keeps the recent tokens and the prompt tokens with the most attention received: per query
    the max over the KV head's query heads (the runtime's significance), summed over every query (checked against
    transformers' eager attention weights)."""
    model, tok, a = tiny
    ids = _ids(tok, n_seq=1)
    n, recent = ids.shape[1], 4
    method = _eviction(model, tok, "h2o", 0.5, fraction=0.5, recent=recent)
    cache = method.make_cache(model, tok)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    eager, _ = make_model("llama")
    eager.set_attn_implementation("eager")
    with torch.inference_mode():
        probs = eager(input_ids=ids, output_attentions=True).attentions            # per layer [1, Hq, n, n]
    budget, g = method.config.h2o.tokens(n), a.num_q_heads // a.num_kv_heads
    kv = cache.kv
    b, h = kv.every_entry()
    for layer, p in enumerate(probs):
        score = p.view(1, a.num_kv_heads, g, n, n).amax(dim=2).sum(dim=2)            # [1, H, n]
        heavy = score[..., :n - recent].topk(budget - recent, dim=-1).indices.sort(dim=-1).values
        want = torch.cat([heavy, torch.arange(n - recent, n).expand(1, a.num_kv_heads, recent)], dim=-1)
        assert torch.equal(_kept_positions(cache, layer), want)
        stored, pos = kv.store.section_meta(layer, 0, b, h)
        kept = pos >= 0
        torch.testing.assert_close(stored[kept].view(1, a.num_kv_heads, -1),
                                   score.gather(-1, pos[kept].view(1, a.num_kv_heads, -1)), atol=1e-4, rtol=1e-4)


def test_palu_at_full_rank_is_dense_and_counts_its_latents(tiny):
    model, tok, a = tiny
    ids = _ids(tok)
    calib = tok(random_text(200, seed=9), return_tensors="pt").input_ids
    factors = palu_factors(model, a, calib)
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[:, 39:]
    full = PaluCache(model, factors, a.head_dim, list(a.layer_types))
    torch.testing.assert_close(decode_logits(model, full, ids, 40), ref, atol=2e-3, rtol=0)    # fp16 latents
    half = PaluCache(model, factors, a.head_dim // 2, list(a.layer_types))
    decode_logits(model, half, ids, 40)
    mem = half.memory()
    assert mem["total_bytes"] == sum(_held(layer) for layer in half.layers)
    assert mem["ratio_to_fp16"] == 0.5


def test_transformers_quantized_cache_fp8_counts_its_bytes(tiny):
    model, tok, a = tiny
    ids = _ids(tok)
    cache = C.MeasuredQuantizedCache("fp8", model.config)
    decode_logits(model, cache, ids, 40)
    mem = cache.memory()
    held = sum(_held(layer) for layer in cache.layers)
    assert mem["total_bytes"] == held
    B, S = ids.shape
    assert held == a.num_layers * (2 * B * a.num_kv_heads * S * a.head_dim + 2 * 4)   # 1 B codes + 2 fp32 scales
    unavailable = [m for m in M.cache_methods(model) if m.unavailable]
    assert all(m.unavailable.strip() and "\n" not in m.unavailable for m in unavailable)


# --------------------------------------------------------------------------------------------- store special cases


def _bundle(model, tok):
    from conftest import random_bundle

    return random_bundle(model, tok)


def test_uniform_k8v8_ratio_is_the_page_layout(tiny):
    model, tok, a = tiny
    ids = _ids(tok, n_seq=2, n_words=200)        # past the raw phase (runtime.cache: held raw until pages pay)
    method = next(m for m in M.store_methods(_bundle(model, tok)) if m.key == "uniform-k8v8")
    cache = method.make_cache(model, tok)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    d, n = a.head_dim, ids.shape[1]
    page = cache.kv.store.page_bytes
    T = PageLayout.build(TierFormat(8, 8), d, d, page).tokens
    pages = a.num_layers * 2 * a.num_kv_heads * math.ceil(n / T)
    mem = cache.memory()
    assert mem["total_bytes"] == pages * page
    assert mem["ratio_to_fp16"] == pytest.approx(pages * page / (a.num_layers * 2 * a.num_kv_heads * n * d * 4))
    assert method.config.rotate is False and method.config.use_ranks is False and not method.config.tiering.tiered
    cache.release()


def test_kivi_keeps_the_window_and_less_than_a_group_in_fp16(tiny):
    model, tok, a = tiny
    ids = torch.randint(3, len(tok), (1, 200))
    method = next(m for m in M.store_methods(_bundle(model, tok)) if m.key == "kivi-k2v2")
    cache = method.make_cache(model, tok)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        for t in range(5):
            model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    counts = cache.kv.tier_counts()
    n, heads = 205, a.num_layers * a.num_kv_heads
    low = (n - M.KIVI_WINDOW) // M.KIVI_GROUP * M.KIVI_GROUP          # whole per-channel groups
    assert counts == {"low": heads * low, "high": heads * (n - low)}
    assert cache.kv.store.high.name == "K16V16" and cache.kv.store.low.name == "K2cV2"
    cache.release()


def test_methods_from_a_searched_bundle(bundle_path, tiny_dir):
    from kvcal import load_bundle
    from kvcal.models import load_model

    b = load_bundle(bundle_path)
    methods = M.store_methods(b)
    joint = next(m for m in methods if m.key == "kvcal-joint")
    assert joint.config.tiering.alpha_high == b.settings.get("alpha_high") and joint.bundle is b
    families = b.calibration["search"].get("families", {})       # calibration no longer searches families alone
    for key, name in (("fdc-ranks", "rank-only (FDC)"), ("diffkv-tiers", "tiers-only (DiffKV)"),
                      ("fastgen", "policies-only (FastGen)")):
        m = next(m for m in methods if m.key == key)
        assert (m.note is None) == (families.get(name) is not None)      # a default is always said so
    sweep = M.sweep_methods(b, joint, quick=True)
    assert sweep and all(m.family == "kvcal" and m.config.tiering != joint.config.tiering for m in sweep)
    lm = load_model(str(tiny_dir), dtype="float32")
    matched = M.matched_methods(lm.model, lm.adapter, 0.4, lambda: None, b, shortest_prompt=32)
    from kvcal.press import PRESSES, unavailable

    assert {m.key for m in matched} == {"streamingllm", "h2o", "snapkv", "palu", *PRESSES}   # kvpress: opt-in extra
    assert all(m.unavailable == unavailable(m.key, 32) for m in matched if m.key in PRESSES)
    if unavailable("kvpress-tova", 32) is None:                          # with the extra: SnapKV's window is too long
        import kvpress

        window = kvpress.SnapKVPress.window_size
        assert "needs prompts of at least" in unavailable("kvpress-snapkv", window)
        assert unavailable("kvpress-snapkv", window + 1) is None
    assert next(m for m in matched if m.key == "palu").settings["rank"] == round(0.4 * lm.adapter.head_dim)


def test_passkey_replay_equals_generate(tiny):
    from kvcal.bench.measure import PasskeyProbe
    from kvcal.runtime.policies.fastgen import FastGenConfig

    model, tok, a = tiny
    bundle = _bundle(model, tok)
    method = next(m for m in M.store_methods(bundle) if m.key == "uniform-k4v4")
    filler = random_text(400, seed=3)
    probe = PasskeyProbe(model, bundle, tok, filler, 120, 0.5, 0, FastGenConfig())
    cache = method.make_cache(model, tok)
    with torch.no_grad():
        out = model.generate(input_ids=probe.prompt, max_new_tokens=6, do_sample=False, cache=cache,
                             pad_token_id=tok.eos_token_id)
    cache.release()
    assert probe.answer(method, 6) == tok.decode(out[0, probe.prompt.shape[1]:], skip_special_tokens=True)


# --------------------------------------------------------------------------------------------- CLI and schema

QUICK = ["--quick", "--windows", "2", "--prompt", "32", "--steps", "4", "--contexts", "48,1024",
         "--passkey-lengths", "64", "--speed-steps", "2", "--quiet", "--threads", "1"]


@pytest.fixture(scope="module")
def bench_run(bundle_path, tiny_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    torch.set_num_threads(1)
    r = runner.invoke(app, ["bench", "--model", str(tiny_dir), "--bundle", str(bundle_path), "--out", str(out),
                            "--dataset", str(text_file), "--json", *QUICK])
    return r, out


def test_bench_json_report_is_stable(bench_run):
    r, out = bench_run
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert validate(report) == []
    assert report == json.loads((out / "bench.json").read_text())
    assert report["schema_version"] == SCHEMA_VERSION == 4 and report["kind"] == "kvcal-bench"
    assert set(report) == set(SCHEMA[""]) | {"outputs"}
    assert set(report["summary"]) == set(SCHEMA["summary"])
    keys = [m["key"] for m in report["methods"]]
    for key in ("dense", "uniform-k8v8", "uniform-k4v4", "uniform-k2v2", "kivi-k4v4", "kivi-k4v2", "kivi-k2v2",
                "hf-fp8", "streamingllm", "h2o", "snapkv", "palu", "fdc-ranks", "diffkv-tiers", "fastgen",
                "kvcal-joint"):
        assert key in keys, key
    assert any(k.startswith("kvcal-a") for k in keys)                                 # the sweep
    for m in report["methods"]:
        assert set(m) == set(SCHEMA["methods[]"])
        if not m["available"]:
            assert m["unavailable_reason"] and m["quality"] is None
            continue
        assert set(m["memory"]) == set(SCHEMA["methods[].memory"]) and m["memory"]["bytes_per_token"] > 0
        assert set(m["quality"]) == set(SCHEMA["methods[].quality"])
        assert set(m["passkey"]["cases"]) == {"64@0.1", "64@0.5", "64@0.9"}
        assert [s["context"] for s in m["speed"]] == [48]
    assert report["skipped"] == [{"what": "speed", "length": 1024, "reason": report["skipped"][0]["reason"]}]
    assert "model's window" in report["skipped"][0]["reason"]
    dense = next(m for m in report["methods"] if m["key"] == "dense")
    assert dense["quality"]["top1"] == 1.0 and abs(dense["quality"]["kl"]) < 1e-6
    joint = next(m for m in report["methods"] if m["key"] == "kvcal-joint")
    assert report["settings"]["matched_ratio"] == joint["memory"]["ratio_to_fp16"]
    for m in report["methods"]:                        # the matched rows report the budget they ran at
        if m["key"] in ("streamingllm", "h2o", "snapkv", "palu"):
            assert m["settings"]["ratio"] == report["settings"]["matched_ratio"], m["settings"]
    assert report["summary"]["verdict"] and report["summary"]["kvcal_joint"]["key"] == "kvcal-joint"


def test_bench_writes_markdown_and_png_plots(bench_run):
    r, out = bench_run
    assert r.exit_code == 0, r.output
    for name in ("pareto.png", "decode_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    for part in ("## Result", "## Methods", "## Reproducibility", "pareto.png", "decode_time.png", "H2O",
                 "unavailable:", "speed at 1024 tokens"):
        assert part in md, part


def test_validate_names_each_problem(bench_run):
    report = json.loads(bench_run[0].stdout)
    del report["summary"]["verdict"]
    report["methods"][0]["quality"]["top1"] = "high"
    report["seed"] = True
    problems = validate(report)
    assert any("summary.verdict" in p for p in problems)
    assert any("methods[0].quality.top1" in p for p in problems)
    assert any("`seed`" in p for p in problems)


def test_bench_table_and_one_line_errors(bundle_path, tiny_dir, text_file, tmp_path):
    r = runner.invoke(app, ["bench", "--model", str(tiny_dir), "--bundle", str(bundle_path), "--out",
                            str(tmp_path / "o"), "--dataset", str(text_file), "--methods", "dense,h2o", *QUICK])
    assert r.exit_code == 0, r.output
    assert "kvcal joint" in r.stdout and "H2O" in r.stdout and "report:" in r.stdout
    r = runner.invoke(app, ["bench", "--model", str(tiny_dir), "--bundle", str(bundle_path), "--backend", "cuda"])
    assert r.exit_code == 1 and "attention backend `cuda`" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = runner.invoke(app, ["bench", "--model", str(tiny_dir), "--bundle", str(bundle_path), "--methods", "nope",
                            "--dataset", str(text_file), *QUICK])
    assert r.exit_code == 1 and "unknown `nope`" in r.stderr
    from conftest import save_model

    other = save_model(tmp_path / "other", "llama", num_hidden_layers=3)
    r = runner.invoke(app, ["bench", "--model", str(other), "--bundle", str(bundle_path), *QUICK])
    assert r.exit_code == 1 and "calibrate this model" in r.stderr


def test_target_top1_judges_against_another_target(bundle_path, tiny_dir, text_file, tmp_path):
    """`--target-top1` replaces the bundle's top-1 target, and the report says where the target came from; the
    measurements are the same run's whatever the target."""
    reports = {}
    for top1 in (None, 0.01, 1.0):
        extra = [] if top1 is None else ["--target-top1", str(top1)]
        r = runner.invoke(app, ["bench", "--model", str(tiny_dir), "--bundle", str(bundle_path), "--out",
                                str(tmp_path / f"o{top1}"), "--dataset", str(text_file), "--methods", "dense",
                                "--json", *QUICK, *extra])
        assert r.exit_code == 0, r.output
        reports[top1] = json.loads(r.stdout)
    target = {k: reports[k]["bundle"]["target"] for k in reports}
    assert target[None]["source"] == "bundle" and target[None]["top1"] == 0.5          # the calibration's
    assert target[0.01]["source"] == target[1.0]["source"] == "command line" and target[1.0]["top1"] == 1.0
    for k in reports:
        assert validate(reports[k]) == []
    joint = {k: next(m for m in reports[k]["methods"] if m["key"] == "kvcal-joint")["quality"] for k in reports}
    assert joint[0.01]["top1"] == joint[1.0]["top1"]        # the same measurement; its Wilson bound is below 1.0
    assert joint[0.01]["meets_target"] and not joint[1.0]["meets_target"]
    r = runner.invoke(app, ["bench", "--model", str(tiny_dir), "--bundle", str(bundle_path), "--target-top1", "1.5",
                            *QUICK])
    assert r.exit_code == 1 and "`--target-top1 1.5` must lie in (0, 1]" in r.stderr


def test_bench_and_calibrate_agree_on_meeting_the_target(tiny):
    """The same measurement through calibrate's budget (`budget.meets` on a probe's Fidelity) and through bench
    (`measure_quality` -> `meets_target`) gets the same verdict, including a target that the point estimate meets
    but the Wilson bound does not."""
    import dataclasses

    from conftest import random_bundle

    from kvcal.bench.measure import measure_quality
    from kvcal.eval import DecodeProbe, QualityTarget
    from kvcal.runtime.config import CompressionConfig

    model, tok, _ = tiny
    bundle = random_bundle(model, tok)
    ids = _ids(tok, n_seq=2, n_words=60)
    probe = DecodeProbe(model, bundle, ids[:, :40], ids[:, 40:])
    config = CompressionConfig(high=TierFormat(4, 4)).with_tiering(window=8)
    method = M.Method("k4v4", "K4V4", "quantization", "s", "", config=config, bundle=bundle)
    fid = dataclasses.asdict(probe.measure(config))
    targets = [QualityTarget(top1=fid["top1"], ppl_ratio=10.0, z=z) for z in (0.0, 1.5)]   # the estimate meets both
    verdicts = []
    for target in targets:
        quality, _ = measure_quality(method, probe, model, tok, target)
        assert quality["top1"] == fid["top1"] and quality["meets_target"] == target.met(fid)
        verdicts.append(target.met(fid))
    assert verdicts == [True, fid["top1"] == 1.0]      # with z > 0 a top-1 below 1 needs more than its point estimate
    assert not dataclasses.replace(targets[1], ppl_ratio=0.5).met(fid)


def test_where_kvcal_loses_says_what_it_holds():
    from kvcal.bench.report import _where_it_loses

    def row(name, family, ratio, top1, meets):
        return {"name": name, "family": family, "memory": {"ratio_to_fp16": ratio},
                "quality": {"top1": top1, "ppl_ratio": 1.003, "predictions": 512, "meets_target": meets}}

    residual = {"high": "K16V16", "low": "K4cV4", "window": 16, "alpha_high": 16.0, "alpha_low": 0.0}
    report = {"settings": {"quality": {"prompt": 1024, "steps": 64}}, "bundle": {"policy": residual}}
    cheaper = _where_it_loses(report, row("kvcal joint", "kvcal", 0.401, 0.977, False),
                              row("KIVI K4V4", "quantization", 0.809, 0.984, True))
    assert "0.50x KIVI K4V4's bytes: the loss is quality" in cheaper and "bytes per token are lower" not in cheaper
    assert "the low tier, which nothing prunes, none" in cheaper
    report["bundle"]["policy"] = {**residual, "alpha_low": 0.5}
    dearer = _where_it_loses(report, row("kvcal joint", "kvcal", 0.42, 0.99, True),
                             row("KIVI K4V4", "quantization", 0.40, 0.984, True))
    assert "every stored token carries 8 B" in dearer and "bytes per token are lower" in dearer
