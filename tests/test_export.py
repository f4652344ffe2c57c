"""`kvcal export`: vLLM FP8 scales against vLLM's documented format and on held-out K/V, the manifest's byte offsets
against the runtime's page arena, the folded-V checkpoint against the rank-truncated model, atomic writes, the CLI."""

import json
import re
from dataclasses import asdict

import pytest
import torch
from conftest import make_model, random_bundle, random_text, save_model
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from kvcal.cli import app
from kvcal.export import (
    EXPORT_LIST,
    atomic_dir,
    export_hf_lowrank_v,
    export_manifest,
    export_vllm_fp8,
    fp8_round_trip,
)
from kvcal.models import adapter_for, load_model
from kvcal.profile.calibrate import CalibrationConfig, calibrate
from kvcal.profile.capture import capturing
from kvcal.runtime.bundle import BundleError, BundleMismatchError, load_bundle, save_bundle
from kvcal.runtime.cache import CompressedKV, CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.storage.layout import PageLayout, TierFormat
from kvcal.runtime.storage.pages import HIGH, LOW
from kvcal.runtime.storage.store import HELD

runner = CliRunner()


def _calibrate(folder, text_file, out):
    cfg = CalibrationConfig(model=str(folder), out=out, random_tokens=128, text_tokens=512, seq_len=64,
                            dataset=str(text_file), dtype="float32", search=False)   # statistics only
    return calibrate(cfg).path


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, text_file):
    """A tiny Llama folder and the bundle `kvcal calibrate` writes for it (k.absmax / v.absmax included)."""
    root = tmp_path_factory.mktemp("export")
    folder = save_model(root / "llama", "llama")
    return folder, _calibrate(folder, text_file, root / "llama.kvcal.safetensors")


class KVRecorder:
    def __init__(self):
        self.k, self.v = {}, {}

    def add(self, layer, query, key, value):
        self.k.setdefault(layer, []).append(key.detach().float().clone())
        self.v.setdefault(layer, []).append(value.detach().float().clone())


def held_out_kv(model, tok, n_docs=4, words=200):
    """Post-RoPE K and V [1, H, S, d] per layer on texts the calibration never saw (seeds outside text_file's)."""
    rec = KVRecorder()
    with torch.no_grad(), capturing(model, rec):
        for i in range(n_docs):
            model(**tok(random_text(words, seed=1000 + i), return_tensors="pt"))
    cat = lambda parts: torch.cat(parts, dim=2)                                          # noqa: E731
    return {layer: (cat(rec.k[layer]), cat(rec.v[layer])) for layer in rec.k}


def rel_err(x, scale):
    """FP8 round-trip error per KV head, relative to the head's own energy: x [B, H, S, d] -> [H]."""
    x_hat = fp8_round_trip(x, scale)
    return ((x_hat - x) ** 2).sum((0, 2, 3)) / (x ** 2).sum((0, 2, 3))


# ---------------------------------------------------------------------------------------------- vllm-fp8

# The format as vLLM documents and loads it (docs/features/quantization/quantized_kvcache.md; compressed-tensors'
# CompressedTensorsKVCacheMethod): written out here, not imported from kvcal.
VLLM_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v)_scale$")
VLLM_STRATEGY = {"tensor": "tensor", "head": "attn_head"}


@pytest.mark.parametrize("strategy", ["tensor", "head"])
def test_vllm_fp8_names_shapes_dtypes_match_vllms_format(calibrated, tmp_path, strategy):
    folder, bundle_path = calibrated
    res = export_vllm_fp8(bundle_path, str(folder), tmp_path / "out", strategy=strategy)
    assert sorted(res.files) == ["kv_cache_scales.safetensors", "kvcal_export.json", "quantization_config.json"]
    lm = load_model(str(folder), dtype="float32")
    L, H = lm.model.config.num_hidden_layers, lm.model.config.num_key_value_heads
    scales = load_file(str(tmp_path / "out" / "kv_cache_scales.safetensors"))
    assert len(scales) == 2 * L
    modules = dict(lm.model.named_modules())
    seen = set()
    for name, t in scales.items():
        m = VLLM_NAME.match(name)
        assert m, name
        seen.add((int(m.group(1)), m.group(2)))
        assert t.dtype == torch.float32
        assert tuple(t.shape) == ((1,) if strategy == "tensor" else (H,))      # docs: [1] or [num_kv_heads]
        assert bool((t > 0).all()) and bool(torch.isfinite(t).all())
        # vLLM remaps `...self_attn.k_scale` to the attention layer `...self_attn.attn.k_scale`; llm-compressor finds
        # the same module as the one with k_proj and v_proj (is_cached_attention_module)
        attn = modules[name.rsplit(".", 1)[0]]
        assert hasattr(attn, "k_proj") and hasattr(attn, "v_proj")
    assert seen == {(layer, kv) for layer in range(L) for kv in "kv"}

    qcfg = json.loads((tmp_path / "out" / "quantization_config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and isinstance(qcfg["config_groups"], dict)
    scheme = qcfg["kv_cache_scheme"]
    # vLLM's validate_kv_cache_scheme: float, 8 bits, tensor or attn_head, symmetric; llm-compressor's test: static
    assert (scheme["type"], scheme["num_bits"], scheme["symmetric"], scheme["dynamic"]) == ("float", 8, True, False)
    assert scheme["strategy"] == VLLM_STRATEGY[strategy]

    # compressed-tensors' symmetric FP8 scale is max|x| / 448; kvcal adds its documented margin of 2
    absmax = load_bundle(bundle_path).extras["k.absmax"]
    want = absmax.amax(-1, keepdim=True) if strategy == "tensor" else absmax
    got = torch.stack([scales[f"model.layers.{layer}.self_attn.k_scale"] for layer in range(L)])
    torch.testing.assert_close(got, 2 * want / 448)


def test_fp8_scales_on_held_out_kv(calibrated, tmp_path):
    """On K/V the calibration never saw, against per-tensor max-abs scaling from the same calibration (llm-compressor's
    min-max scale, max|x| / 448 per layer): held-out values exceed the calibration maximum, so min-max saturates them
    while the exported scales (margin 2) store every value; the mean error is the same (E4M3 is a float format, so
    its relative rounding error does not depend on the scale), also against max-abs fitted to the held-out data."""
    folder, bundle_path = calibrated
    lm = load_model(str(folder), dtype="float32")
    kv = held_out_kv(lm.model, lm.tokenizer, n_docs=8, words=400)
    absmax = load_bundle(bundle_path).extras
    worst = {"exported": 0.0, "minmax": 0.0}
    for strategy in ("head", "tensor"):
        scales = load_file(str(export_vllm_fp8(bundle_path, str(folder), tmp_path / strategy, strategy=strategy).out
                               / "kv_cache_scales.safetensors"))
        for layer, (k, v) in kv.items():
            for x, kind in ((k, "k"), (v, "v")):
                s = scales[f"model.layers.{layer}.self_attn.{kind}_scale"]
                minmax = absmax[f"{kind}.absmax"][layer].max() / 448
                head_max = x.abs().amax((0, 2, 3), keepdim=True)                               # [1, H, 1, 1]
                assert float((head_max.flatten() / s).max()) < 448                   # nothing saturates
                for name, scale in (("exported", s), ("minmax", minmax)):
                    err = ((fp8_round_trip(x, scale) - x).abs() / head_max).max().item()
                    worst[name] = max(worst[name], err)
                e, e_minmax = rel_err(x, s).mean(), rel_err(x, minmax).mean()
                e_fitted = rel_err(x, x.abs().max() / 448).mean()                   # max-abs of the held-out data
                assert e <= 1.05 * e_minmax and e <= 1.05 * e_fitted, (layer, kind, e, e_minmax, e_fitted)
                assert e < 1e-3                                                     # E4M3 keeps 3 mantissa bits
    assert worst["exported"] <= 1 / 16                                              # half an E4M3 step at most
    assert worst["minmax"] > 1.5 * worst["exported"], worst                          # saturation at 448


def test_per_head_scales_protect_a_quiet_head(tmp_path, text_file):
    """A KV head whose V is 10^4 times smaller than its neighbour's: one scale per layer (exported, or max-abs fitted
    to the held-out data) pushes it into E4M3's subnormal range, its own scale does not."""
    model, tok = make_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight[16:32] *= 1e-4                            # KV head 1 of 2 (d = 16)
    folder = tmp_path / "quiet"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    bundle_path = _calibrate(folder, text_file, tmp_path / "quiet.kvcal.safetensors")
    kv = held_out_kv(model, tok, n_docs=2)
    head = load_file(str(export_vllm_fp8(bundle_path, str(folder), tmp_path / "h", strategy="head").out
                         / "kv_cache_scales.safetensors"))
    tensor = load_file(str(export_vllm_fp8(bundle_path, str(folder), tmp_path / "t", strategy="tensor").out
                           / "kv_cache_scales.safetensors"))
    for layer, (_, v) in kv.items():
        name = f"model.layers.{layer}.self_attn.v_scale"
        e_head, e_tensor = rel_err(v, head[name]), rel_err(v, tensor[name])
        e_fitted = rel_err(v, v.abs().max() / 448)                                  # max-abs of the held-out data
        assert e_head[1] < 1e-3 and e_tensor[1] > 5 * e_head[1] and e_fitted[1] > 2 * e_head[1], (e_head, e_tensor)
        assert e_head[0] <= e_tensor[0] * 1.02                                     # the loud head loses nothing


def test_fp8_round_trip_saturates_like_vllm():
    x = torch.tensor([1000.0, -1000.0, 1.0]).view(1, 1, 1, 3)
    assert fp8_round_trip(x, torch.tensor([1.0])).flatten().tolist() == [448.0, -448.0, 1.0]


def test_vllm_fp8_without_absmax_says_recalibrate(calibrated, tmp_path):
    folder, bundle_path = calibrated
    b = load_bundle(bundle_path)
    b.extras = {}
    old = save_bundle(b, tmp_path / "old.kvcal.safetensors")
    with pytest.raises(BundleError, match="recalibrate with `kvcal calibrate`"):
        export_vllm_fp8(old, str(folder), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    r = runner.invoke(app, ["export", str(old), "--format", "vllm-fp8", "--model", str(folder), "--out",
                            str(tmp_path / "out")])
    assert r.exit_code == 1 and "k.absmax" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_vllm_fp8_with_weights_is_a_complete_model_folder(calibrated, tmp_path):
    folder, bundle_path = calibrated
    out = tmp_path / "served"
    res = export_vllm_fp8(bundle_path, str(folder), out, strategy="head", with_weights=True)
    config = json.loads((out / "config.json").read_text())
    original = json.loads((folder / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == original
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        weights = set(f.keys())
    scales = set(load_file(str(out / "kv_cache_scales.safetensors")))
    assert set(index) == weights | scales and all(index[k] == "kv_cache_scales.safetensors" for k in scales)
    assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert (out / "tokenizer.json").is_file() and "kvcal_export.json" in res.files

    quantized = tmp_path / "gptq"
    save_model(quantized, "llama")
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="already quantized with `gptq`"):
        export_vllm_fp8(bundle_path, str(quantized), tmp_path / "refused", with_weights=True)
    assert not (tmp_path / "refused").exists()


def test_exports_refuse_a_bundle_for_another_model(calibrated, tmp_path):
    _, bundle_path = calibrated
    other = save_model(tmp_path / "qwen", "qwen2")
    for export in (lambda out: export_vllm_fp8(bundle_path, str(other), out),
                   lambda out: export_manifest(bundle_path, out, model=str(other)),
                   lambda out: export_hf_lowrank_v(bundle_path, str(other), out, dtype="float32")):
        with pytest.raises(BundleMismatchError, match="calibrate this model"):
            export(tmp_path / "out")
        assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- atomic writes


def test_atomic_dir_refuses_replaces_and_cleans_up(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with atomic_dir(out) as tmp:                                # an empty folder is fine
        (tmp / "a").write_text("1")
    assert (out / "a").read_text() == "1"
    with pytest.raises(FileExistsError, match="--overwrite"):
        with atomic_dir(out):
            pass
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_LIST, "b"]     # the export lists what it wrote
    with pytest.raises(RuntimeError):
        with atomic_dir(out, overwrite=True) as tmp:
            (tmp / "c").write_text("half")
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_LIST, "b"]  # the old export survives a failed one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # and no temporary folder is left


def test_interrupted_export_leaves_nothing(calibrated, tmp_path, monkeypatch):
    import safetensors.torch

    folder, bundle_path = calibrated

    def die(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", die)
    with pytest.raises(KeyboardInterrupt):
        export_vllm_fp8(bundle_path, str(folder), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- manifest

RAGGED = torch.tensor([[16, 8], [12, 16]], dtype=torch.int32)
PAGE_BYTES = {"K8V4+K4cV2": 256, "K16V16+K4V2g4": 512, "K16V16+K4cV4 untracked": 512,
              "K16V16+K4cV4, layer 1 K4cV2": 512}
CONFIGS = {
    "K8V4+K4cV2": CompressionConfig(high=TierFormat(8, 4), low=TierFormat(4, 2, "channel"),
                                    tiering=TieringConfig(window=4, alpha_high=1.6, alpha_low=0.2)),
    "K16V16+K4V2g4": CompressionConfig(high=TierFormat(16, 16), low=TierFormat(4, 2, k_group=4, v_group=4),
                                       tiering=TieringConfig(window=4, alpha_high=1.6, alpha_low=0.2)),
    # nothing is pruned: the low tier keeps no score or position (untracked)
    "K16V16+K4cV4 untracked": CompressionConfig(high=TierFormat(16, 16), low=TierFormat(4, 4, "channel"),
                                                tiering=TieringConfig(window=4, alpha_high=1.6)),
    # layer 1's low tier at 2-bit values: its layouts name their own format
    "K16V16+K4cV4, layer 1 K4cV2": CompressionConfig(high=TierFormat(16, 16), low=TierFormat(4, 4, "channel"),
                                                     tiering=TieringConfig(window=4, alpha_high=1.6),
                                                     low_layers=((1, TierFormat(4, 2, "channel")),)),
}


def test_manifest_offsets_equal_page_layout(tmp_path):
    model, tok = make_model("gemma3_text")
    bundle = random_bundle(model, tok, rank_k=torch.tensor([[32], [24], [16]], dtype=torch.int32),
                            rank_v=torch.tensor([[8], [32], [20]], dtype=torch.int32))
    cfg = CompressionConfig()
    res = export_manifest(bundle, tmp_path / "m", cfg, model=model, page_bytes=1024)
    assert sorted(res.files) == ["kvcal_bases.safetensors", "manifest.json"]
    man = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert (man["format"], man["schema_version"]) == ("kvcal-manifest", 3)
    assert man["config"]["page_bytes"] == 1024 and man["config"]["high"]["name"] == "K8V4"
    assert [entry["compressed"] for entry in man["layers"]] == [False, False, True]   # sliding layers stay dense
    for entry in man["layers"]:
        for head in entry["heads"]:
            r_k, r_v = int(bundle.qk_rank[entry["layer"], head["kv_head"]]), int(bundle.v_rank[entry["layer"], 0])
            assert (head["qk_rank"], head["v_rank"]) == (r_k, r_v)
            if not entry["compressed"]:
                assert head["high"] is None
                continue
            for tier, fmt in (("high", cfg.high), ("low", cfg.low)):
                lay, got = PageLayout.build(fmt, r_k, r_v, 1024), head[tier]
                assert got["tokens_per_page"] == lay.tokens and got["bytes_per_token"] == lay.bytes_per_token
                for f in ("page_bytes", "k_off", "k_meta_off", "v_off", "v_meta_off", "score_off", "pos_off",
                          "k_bytes", "v_bytes", "k_groups", "v_groups", "end"):
                    assert got[f] == getattr(lay, f), (tier, f)
    tensors = load_file(str(tmp_path / "m" / "kvcal_bases.safetensors"))
    assert torch.equal(tensors["qk.rank"], bundle.qk_rank) and tensors["v.rank"].dtype == torch.int32
    # the exported bases are the ones the runtime applies (mixing included), not the raw calibrated ones ...
    kv = CompressedKV.from_bundle(bundle, cfg, batch=1,
                                  sliding=[t == "sliding_attention" for t in bundle.model.layer_types],
                                  serve=ServeOptions(page_bytes=1024))
    for layer in kv.layers:
        for h in range(bundle.shape[1]):
            r_k, r_v = int(bundle.qk_rank[layer, h]), int(bundle.v_rank[layer, h])
            R, B = tensors["qk.rotation"][layer, h], tensors["v.basis"][layer, h]
            assert torch.allclose(R[:, :r_k], kv.rotation[layer][h, :, :r_k], atol=1e-6)
            assert torch.allclose(B[:, :r_v], kv.basis[layer][h, :, :r_v], atol=1e-6)
            assert not torch.allclose(R[:, :r_k], bundle.qk_rotation[layer, h][:, :r_k], atol=1e-3)   # mixed
            # ... and the mixing is orthogonal inside the kept subspace: the same projector, the same dot products
            raw = bundle.qk_rotation[layer, h][:, :r_k]
            assert torch.allclose(R[:, :r_k] @ R[:, :r_k].T, raw @ raw.T, atol=1e-5)

    # without rotation or ranks the manifest describes what the runtime then does: identity bases at full rank
    export_manifest(bundle, tmp_path / "none", CompressionConfig.none())
    t = load_file(str(tmp_path / "none" / "kvcal_bases.safetensors"))
    assert torch.equal(t["qk.rotation"][2, 0], torch.eye(32)) and bool((t["v.rank"] == 32).all())


def _unpack(raw: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 [T, nbytes] -> codes float [T, n]: element 0 in the least-significant bits of byte 0 (the manifest)."""
    shifts = torch.arange(0, 8, bits)
    codes = (raw[..., None].int() >> shifts) & ((1 << bits) - 1)
    return codes.reshape(raw.shape[0], -1)[:, :n].float()


def _decode_page(page: torch.Tensor, lay: dict, tier: dict):
    """Decode one page's bytes using nothing but the manifest: keys [T, r_k], values [T, r_v], score, pos [T]."""
    T = lay["tokens_per_page"]
    seg = lambda off, n: page[off:off + n].contiguous()                                  # noqa: E731

    def vectors(side, r, bits, group):
        nbytes, groups = lay[f"{side}_bytes"], lay[f"{side}_groups"]
        data = seg(lay[f"{side}_off"], T * nbytes).view(T, nbytes)
        if bits in (16, 32):
            return data.view(torch.float32 if bits == 32 else torch.float16).float()
        codes = _unpack(data, bits, r).view(T, groups, r // groups)
        meta = seg(lay[f"{side}_meta_off"], T * groups * 4).view(torch.float16).view(T, groups, 2).float()
        return (codes * meta[..., :1] + meta[..., 1:]).reshape(T, r)

    if tier["k_mode"] == "channel":
        codes = _unpack(seg(lay["k_off"], T * lay["k_bytes"]).view(T, lay["k_bytes"]), tier["k_bits"], lay["r_k"])
        meta = seg(lay["k_meta_off"], lay["r_k"] * 4).view(torch.float16).view(lay["r_k"], 2).float()
        keys = codes * meta[:, 0] + meta[:, 1]
    else:
        keys = vectors("k", lay["r_k"], tier["k_bits"], tier["k_group"])
    values = vectors("v", lay["r_v"], tier["v_bits"], tier["v_group"])
    if not lay["tracked"]:
        assert lay["score_off"] == lay["pos_off"] == -1
        return keys, values, None, None
    score = seg(lay["score_off"], 4 * T).view(torch.float32)
    pos = seg(lay["pos_off"], 4 * T).view(torch.int32).long()
    return keys, values, score, pos


@pytest.mark.parametrize("name", list(CONFIGS))
def test_manifest_offsets_match_the_runtime_store_bytes(tmp_path, name):
    """Run the runtime (prefill + decode, tiering, per-head ranks), then read every stored token back from the raw
    arena bytes at the manifest's offsets: it must equal what the store itself reads."""
    cfg, page_bytes = CONFIGS[name], PAGE_BYTES[name]
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok, rank_k=RAGGED, rank_v=RAGGED.flip(-1))
    export_manifest(bundle, tmp_path / "m", cfg, model=model, page_bytes=page_bytes)
    man = json.loads((tmp_path / "m" / "manifest.json").read_text())
    cache = KvcalCache.from_bundle(bundle, model, cfg, serve=ServeOptions(page_bytes=page_bytes))
    tok.padding_side = "left"
    inputs = tok([random_text(60, seed=1), random_text(45, seed=2)], return_tensors="pt", padding=True)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=6, do_sample=False, cache=cache)
    store = cache.kv.store
    arena = store.arena
    checked = {HIGH: 0, LOW: 0}
    for layer in cache.kv.layers:
        got = store.gather(layer)
        for b in range(2):
            for h in range(2):
                head = man["layers"][layer]["heads"][h]
                r_k, r_v = head["qk_rank"], head["v_rank"]
                for side, tier in ((HIGH, "high"), (LOW, "low")):
                    lay = head[tier]
                    assert lay["page_bytes"] == store.page_bytes
                    sel = (got.pos[b, h] >= 0) & (got.side[b, h] == side)
                    for i in torch.nonzero(sel).flatten().tolist():
                        slot = int(got.slot[b, h, i])
                        k = slot // lay["tokens_per_page"]
                        col = k if side == HIGH else arena.max_pages_per_entry - 1 - k
                        page = arena.arena[int(arena.page_table[b, layer, h, col])]
                        fmt = TierFormat.parse(lay["format"])        # a layer's own low bits (`low_layers`)
                        assert fmt == cfg.high if side == HIGH else fmt == cfg.low_of(layer)
                        keys, values, score, pos = _decode_page(page, lay, asdict(fmt))
                        j = slot % lay["tokens_per_page"]
                        if pos is None:                    # untracked: a held token, no position or score
                            assert int(got.pos[b, h, i]) == HELD and float(got.score[b, h, i]) == 0.0
                        else:
                            assert int(pos[j]) == int(got.pos[b, h, i])
                            assert float(score[j]) == float(got.score[b, h, i])
                        torch.testing.assert_close(keys[j], got.keys[b, h, i, :r_k], rtol=1e-6, atol=1e-6)
                        torch.testing.assert_close(values[j], got.values[b, h, i, :r_v], rtol=1e-6, atol=1e-6)
                        checked[side] += 1
    assert checked[HIGH] > 50 and checked[LOW] > 10, checked                  # both tiers were exercised


# ---------------------------------------------------------------------------------------------- hf-lowrank-v


def _truncated_v_hooks(model, bundle, folded_layers):
    """Reference: the original model with V replaced by V B_r B_r^T per KV head, applied to v_proj's output."""
    a = adapter_for(model.config)
    d = a.head_dim
    handles = []
    for layer in folded_layers:
        P = torch.stack([bundle.v_basis[layer, h, :, :int(bundle.v_rank[layer, h])]
                         @ bundle.v_basis[layer, h, :, :int(bundle.v_rank[layer, h])].T
                         for h in range(a.num_kv_heads)])                                # [H, d, d]

        def hook(module, args, out, P=P):
            v = out.view(*out.shape[:-1], -1, d)                                        # [B, S, H, d]
            return torch.einsum("bshd,hde->bshe", v, P).reshape(out.shape)

        handles.append(a.attention(model, layer).v_proj.register_forward_hook(hook))
    return handles


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_folded_v_checkpoint_reproduces_rank_truncated_logits(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    model, tok = make_model(model_type)
    a = adapter_for(model.config)
    L, H, d = a.num_layers, a.num_kv_heads, a.head_dim
    g = torch.Generator().manual_seed(1)
    rank_v = torch.randint(d // 4, d, (L, H), generator=g, dtype=torch.int32)              # ragged, all < d
    bundle = random_bundle(model, tok, rank_v=rank_v)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = export_hf_lowrank_v(bundle, model, tmp_path / "hf")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())          # the caller's model is kept
    folded_layers = res.summary["folded_layers"]
    assert folded_layers == [i for i in range(L) if not a.is_sliding(i)]
    folded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(folded) is type(model)                                                    # stock transformers

    ids = tok([random_text(40, seed=5)], return_tensors="pt").input_ids
    with torch.no_grad():
        dense = model(ids).logits
        handles = _truncated_v_hooks(model, bundle, folded_layers)
        try:
            truncated = model(ids).logits
        finally:
            for handle in handles:
                handle.remove()
        got = folded(ids).logits
    torch.testing.assert_close(got, truncated, rtol=1e-4, atol=1e-5)
    assert (got - dense).abs().max() > 1e3 * (got - truncated).abs().max()               # the fold did something
    for layer in range(L):
        w, w0 = a.attention(folded, layer).v_proj.weight, a.attention(model, layer).v_proj.weight
        if layer in folded_layers:                                                         # rank r_v per head
            for h in range(H):
                assert torch.linalg.matrix_rank(w[h * d:(h + 1) * d].double(), rtol=1e-5) == int(rank_v[layer, h])
        else:
            assert torch.equal(w, w0)                                                      # sliding: untouched


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_export_each_format(calibrated, tmp_path):
    folder, bundle_path = calibrated
    for fmt, extra in (("vllm-fp8", ["--strategy", "head"]), ("manifest", []), ("hf-lowrank-v", ["--dtype",
                                                                                                 "float32"])):
        out = tmp_path / fmt
        r = runner.invoke(app, ["export", str(bundle_path), "--format", fmt, "--model", str(folder), "--out",
                                str(out), "--json", *extra])
        assert r.exit_code == 0, r.output
        info = json.loads(r.stdout)
        assert info["format"] == fmt and info["out"] == str(out) and all((out / f).is_file() for f in info["files"])
    r = runner.invoke(app, ["export", str(bundle_path), "--format", "manifest", "--out", str(tmp_path / "manifest")])
    assert r.exit_code == 1 and "--overwrite" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = runner.invoke(app, ["export", str(bundle_path), "--format", "manifest", "--out", str(tmp_path / "manifest"),
                            "--overwrite"])
    assert r.exit_code == 0 and "compressed layers" in r.stdout
    r = runner.invoke(app, ["export", str(bundle_path), "--format", "vllm-fp8", "--out", str(tmp_path / "x")])
    assert r.exit_code == 1 and "needs `--model`" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = runner.invoke(app, ["export", str(tmp_path / "missing.safetensors"), "--format", "manifest", "--out",
                            str(tmp_path / "y")])
    assert r.exit_code == 1 and "no bundle at" in r.stderr
