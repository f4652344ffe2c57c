"""KVPR offloading (kvcal.runtime.offload, kvcal.runtime.offload.profiler, `kvcal bench --offload`): recompute +
transfer gives the model's K/V for every split, greedy generation is unchanged, the solver's l* = 0 cases, the profile
cache."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_model
from transformers import DynamicCache

from kvcal.runtime.offload import OffloadedCache, kvpr
from kvcal.runtime.offload.profiler import fit_rate, profile_hardware

A100 = kvpr.Hardware(link_bytes_per_s=32 * 2**30, matmul_flops_per_s=312e12)
EPS32 = torch.finfo(torch.float32).eps


def _run_both(model, ids, steps, **cache_kw):
    """Prefill `ids` and run `steps` greedy steps through a DynamicCache and an OffloadedCache side by side."""
    ref, cache = DynamicCache(config=model.config), OffloadedCache(model, **cache_kw)
    with torch.no_grad():
        a = model(input_ids=ids, cache=ref)
        b = model(input_ids=ids, cache=cache)
        for _ in range(steps):
            assert torch.equal(a.logits, b.logits)
            nxt = a.logits[:, -1:].argmax(-1)
            a, b = model(input_ids=nxt, cache=ref), model(input_ids=nxt, cache=cache)
    return ref, cache


# ---- exactness of recompute + transfer --------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_recompute_plus_transfer_equals_full_kv_for_every_l(model_type):
    # B = 2, prompt 30 + 5 decode tokens, fp32. For each offloaded layer and every l in [0, s]:
    # transferred rows [l:s] are the model's K/V bit for bit; recomputed rows [0:l] are the same arithmetic on the same
    # X but a GEMM over l rows may sum in another order than the one that made the token (MKL switches kernels below
    # 16 rows; a decode token is a 1-row GEMM), so they are held to 16 fp32 ulp of the layer's largest |K|, |V|.
    model, _ = make_model(model_type)
    prompt, steps = 30, 5
    ref, cache = _run_both(model, torch.randint(3, 100, (2, prompt)), steps, split="none")
    s = prompt + steps
    with cache:
        assert cache.get_seq_length(cache.offloaded[0]) == s
        for i in cache.offloaded:
            rk, rv = ref.layers[i].keys, ref.layers[i].values                 # [B, H, s, d]
            for l in range(s + 1):
                k, v = cache.past(i, l)
                assert k.shape == rk.shape and v.shape == rv.shape
                assert torch.equal(k[:, :, l:], rk[:, :, l:]) and torch.equal(v[:, :, l:], rv[:, :, l:])
                for got, want in ((k[:, :, :l], rk[:, :, :l]), (v[:, :, :l], rv[:, :, :l])):
                    tol = 16 * EPS32 * want.abs().max().item() if l else 0.0
                    assert (got - want).abs().max().item() <= tol if l else got.numel() == 0
            # where the recompute GEMM has the prefill's shape (all prompt rows), it is the model's own bits
            k, v = cache.past(i, prompt)
            assert torch.equal(k, rk) and torch.equal(v, rv)


def test_recompute_is_exact_in_float64():
    # The same check in fp64: recompute differs only by summation order, ~1e-16 relative.
    model, _ = make_model("llama")
    ref, cache = _run_both(model.double(), torch.randint(3, 100, (1, 24)), 3, split="none")
    with cache:
        for i in cache.offloaded:
            for l in (1, 7, 24, 27):
                k, v = cache.past(i, l)
                assert (k - ref.layers[i].keys).abs().max() <= 1e-12
                assert (v - ref.layers[i].values).abs().max() <= 1e-12


def test_host_tier_holds_x_and_kv_sequence_major():
    model, _ = make_model("llama")                       # hidden 64, 2 KV heads x 16, 2 layers
    _, cache = _run_both(model, torch.randint(3, 100, (2, 20)), 2, split="none")
    with cache:
        host = cache.layers[0].host
        assert host.length == 22 and host.x.shape[1:] == (2, 64) and host.keys.shape[1:] == (2, 2, 16)
        # X is the attention module's input: post input-norm, what k_proj/v_proj consume
        assert cache.host_bytes() == 2 * 22 * 2 * (64 + 2 * 2 * 16) * 4
        assert cache.past(0, 5)[0].shape == (2, 2, 22, 16)
        with pytest.raises(ValueError, match="must be in"):
            cache.past(0, 23)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_generation_with_offloading_is_unchanged_on_tiny_models(model_type):
    # Left-padded batch of 2, 12 greedy tokens, every split policy; Gemma3 mixes sliding (on device) and offloaded.
    model, _ = make_model(model_type)
    ids = torch.randint(3, 100, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    want = model.generate(**kw, cache=DynamicCache(config=model.config))
    for split in ("none", "full", 7, lambda layer, s: s // 2):
        with OffloadedCache(model, split=split) as cache:
            got = model.generate(**kw, cache=cache)
        assert torch.equal(got, want), split
        steps = cache.history[cache.offloaded[0]]
        assert len(steps) == 11                          # one split per decode step (prefill has nothing to fetch)
        assert steps == {"none": [0] * 11, "full": list(range(40, 51)), 7: [7] * 11}.get(split, steps)


def test_next_layer_is_fetched_before_it_runs():
    # Double buffering: layer i's update starts layer i+1's fetch, so i+1's fetch precedes i+1's attention call;
    # only the first layer of a step is fetched from its own pre-hook. Each layer is fetched once per step.
    model, _ = make_model("llama", num_hidden_layers=4)
    events = []
    with OffloadedCache(model, split=3) as cache:
        fetch = cache._fetch
        cache._fetch = lambda i, l=None: events.append(("fetch", i)) or fetch(i, l)
        for i in range(4):            # prepend: logs before the cache's own pre-hook runs
            cache._attn[i].register_forward_pre_hook(lambda m, a, i=i: events.append(("attn", i)), prepend=True)
        with torch.no_grad():
            out = model(input_ids=torch.randint(3, 100, (1, 9)), cache=cache)
            events.clear()
            model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache)
    assert events == [("attn", 0), ("fetch", 0), ("fetch", 1), ("attn", 1), ("fetch", 2), ("attn", 2), ("fetch", 3),
                      ("attn", 3)]


def test_closed_hooks_capture_nothing():
    model, _ = make_model("llama")
    cache = OffloadedCache(model, split="none")
    cache.close()
    with torch.no_grad(), pytest.raises(RuntimeError, match="pre-hook did not run"):
        model(input_ids=torch.randint(3, 100, (1, 5)), cache=cache)
    with pytest.raises(ValueError, match="split"):
        OffloadedCache(model, split="half")


# ---- smollm2: greedy generation with offloading == without ------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    from kvcal.models import load_model

    try:
        return load_model("smollm2-135m", dtype="float32")
    except ValueError as e:
        pytest.skip(f"smollm2-135m unavailable: {e}")


@pytest.mark.slow
def test_smollm2_recompute_plus_transfer_for_every_l(smol):
    # Real weights (K up to |K| ~ 20): recomputed rows within 16 ulp of the layer's max |K|, |V| (measured worst ~7;
    # ~60% of (layer, l) pairs are bit-identical), transferred rows bit-identical, for all 30 layers and every l.
    ids = smol.tokenizer("The history of the printing press begins in the fifteenth century", return_tensors="pt")
    ref, cache = _run_both(smol.model, ids.input_ids, 6, split="none")
    s = cache.get_seq_length()
    with cache:
        for i in cache.offloaded:
            rk, rv = ref.layers[i].keys, ref.layers[i].values
            for l in range(s + 1):
                k, v = cache.past(i, l)
                assert torch.equal(k[:, :, l:], rk[:, :, l:]) and torch.equal(v[:, :, l:], rv[:, :, l:])
                if l:
                    assert (k[:, :, :l] - rk[:, :, :l]).abs().max() <= 16 * EPS32 * rk[:, :, :l].abs().max()
                    assert (v[:, :, :l] - rv[:, :, :l]).abs().max() <= 16 * EPS32 * rv[:, :, :l].abs().max()


@pytest.mark.slow
def test_smollm2_greedy_generation_unchanged_with_offloading(smol):
    lm = smol
    model, tok = lm.model, lm.tokenizer
    ids = tok("The history of the printing press begins in the fifteenth century, when", return_tensors="pt")
    kw = dict(**ids, max_new_tokens=32, do_sample=False)
    want = model.generate(**kw, cache=DynamicCache(config=model.config))
    # "auto" with the paper's row model on an A100 recomputes ~94% of the tokens; the pipelined model picks l = 0
    # (SmolLM2 is GQA: X is 576 values/token, its K+V 384). A fixed half split exercises the merge.
    for split, mode in (("auto", "row"), ("auto", "pipelined"), (lambda layer, s: s // 2, "row")):
        with OffloadedCache(model, split=split, hardware=A100, mode=mode) as cache:
            got = model.generate(**kw, cache=cache)
        assert torch.equal(got, want), (split, mode)
        ls = [l for h in cache.history.values() for l in h]
        assert len(ls) == 30 * 31
        if split == "auto" and mode == "row":
            assert min(ls) > 0
        if split == "auto" and mode == "pipelined":
            assert max(ls) == 0


# ---- solver: where recompute cannot win ---------------------------------------------------------------------------


@pytest.mark.parametrize("x_bytes, kv_elem_bytes", [(2.0, 2.0), (2.0, 1.0), (4.0, 2.0), (1.0, 2.0)])
@pytest.mark.parametrize("hidden, kv_heads, head_dim", [(576, 3, 64), (4096, 8, 128), (4096, 32, 128)])
def test_l_star_zero_iff_x_outweighs_kv(x_bytes, kv_elem_bytes, hidden, kv_heads, head_dim):
    # GQA with X and KV in (possibly) different dtypes: β_X = h·p_X, β_KV = 2·h_kv·d·p_KV; in the schedules that put
    # X on the link, l* = 0 exactly when h >= 2·h_kv·d·(p_KV / p_X).
    w = kvpr.LayerWorkload(batch=4, tokens=4096, hidden=hidden, kv_heads=kv_heads, head_dim=head_dim,
                           x_bytes_per_elem=x_bytes, kv_bytes_per_token=2 * kv_heads * head_dim * kv_elem_bytes)
    never = hidden >= 2 * kv_heads * head_dim * kv_elem_bytes / x_bytes
    for mode in ("pipelined", "column"):
        split = kvpr.solve_split(w, A100, mode)
        assert (split.l == 0) == never
        assert split.reason.startswith("recompute never wins") == never


def test_runtime_auto_split_uses_the_solver():
    model, _ = make_model("llama", hidden_size=64, num_key_value_heads=4, head_dim=16)   # β_X 256 B < β_KV 512 B
    with OffloadedCache(model, split="auto", hardware=A100, mode="pipelined") as cache:
        w = kvpr.LayerWorkload(batch=2, tokens=100, hidden=64, kv_heads=4, head_dim=16, x_bytes_per_elem=4)
        assert cache.choose_split(0, 100, 2) == kvpr.solve_split(w, A100, "pipelined").l > 0
    gqa, _ = make_model("llama")                         # hidden 64 >= 2·2·16: never
    with OffloadedCache(gqa, split="auto", hardware=A100) as cache:
        assert cache.choose_split(0, 100, 2) == 0


# ---- profiler ----------------------------------------------------------------------------------------------------


def test_fit_rate_recovers_rate_and_latency():
    rate, lat = fit_rate([(n, 2e-6 + n / 5e9) for n in (1e5, 1e6, 4e6, 1.6e7)])
    assert rate == pytest.approx(5e9, rel=1e-9) and lat == pytest.approx(2e-6, rel=1e-6)
    assert fit_rate([(100, 1.0), (200, 0.5)]) == (400.0, 0.0)   # noise: best observed rate, no latency


def test_profile_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path))
    kw = dict(batch=1, tokens=64, hidden=64, kv_dim=32, dtype=torch.float32, repeats=2)
    first = profile_hardware(**kw)
    assert first.source == "measured" and first.link_kind.startswith("cpu-memcpy")
    assert first.hardware.link_bytes_per_s > 0 and first.hardware.matmul_flops_per_s > 0
    path = tmp_path / "hardware" / first.path.split("/")[-1]
    assert path.exists() and json.loads(path.read_text())["identity"]["torch"] == torch.__version__
    again = profile_hardware(**kw)
    assert again.source == "cache" and again.hardware == first.hardware and again.link == first.link
    d = json.loads(path.read_text())
    d["identity"]["hostname"] = "another-machine"        # a profile from elsewhere is not trusted
    path.write_text(json.dumps(d))
    assert profile_hardware(**kw).source == "measured"


# ---- CLI ----------------------------------------------------------------------------------------------------------


def test_bench_offload_quick_cli(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kvcal.cli import app

    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench", "--offload", "--quick", "--model", str(tiny_dir), "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "offload.json").read_text())
    assert {x["hardware"] for x in rep["modelled"]} == {"this CPU (memcpy as link, profiled)",
                                                         "A100 + PCIe 4.0 x16 (nominal, paper)"}
    assert all(len(x["l_star"]) == 2 and x["ms_l_star"] <= x["ms_l0"] * (1 + 1e-9) for x in rep["modelled"])
    assert [x["split"] for x in rep["measured"]["rows"]] == ["dense (DynamicCache)", "none", "auto", "full"]
    assert all(x["same_tokens"] for x in rep["measured"]["rows"])
    assert rep["gpu_measured"] is False and "not a GPU measurement" in (out / "offload.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU is not available")
def test_cuda_streams_path_matches_dense():
    model, _ = make_model("llama")
    model = model.cuda()
    ids = torch.randint(3, 100, (2, 40), device="cuda")
    kw = dict(input_ids=ids, max_new_tokens=12, do_sample=False)
    want = model.generate(**kw, cache=DynamicCache(config=model.config))
    for split in ("none", "full", 7):
        with OffloadedCache(model, split=split) as cache:
            got = model.generate(**kw, cache=cache)
        assert torch.equal(got, want), split
        assert cache.layers[0].host.x.is_pinned()
