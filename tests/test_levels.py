"""Calibrated levels (tier formats with an `n` after a side's bits): x = zero + scale * levels[code].

The format spelling, the quantizer against a brute-force nearest level, the store against the quantizer the quality
model calls (`quant.round_trip_per_token` / `round_trip_per_channel`), the fused CPU kernels against the torch store
and reference, the CUDA backend's refusal, the bundle's `levels.*` tensors, the fixed bytes, and `fit_levels`."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import make_model, needs_gpu, random_bundle, random_text
from test_cpu_backend import _decode_logits, assert_decode_matches, random_store

from kvcal.export import export_manifest
from kvcal.profile.codebooks import fit_levels
from kvcal.runtime.backends import TorchBackend, select_backend
from kvcal.runtime.backends.cpu.backend import CpuBackend
from kvcal.runtime.backends.cuda.backend import CudaBackend
from kvcal.runtime.backends.cuda.emulate import EmulatedCudaBackend
from kvcal.runtime.bundle import BundleError, load_bundle, save_bundle
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.files import safetensors_header
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.storage import codec, quant
from kvcal.runtime.storage.layout import TierFormat, check_sliding_format
from kvcal.runtime.storage.pages import HIGH, LOW

pytestmark = pytest.mark.float_order      # fused kernels against torch: rerun per instruction set


def random_levels(shape: tuple[int, ...], bits: int, seed: int = 0) -> torch.Tensor:
    """Sorted float32 levels [*shape, 2**bits], first 0 and last 2**bits - 1, the inner ones random."""
    gen = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    inner = torch.rand(*shape, top - 1, generator=gen).sort(-1).values * top
    return torch.cat([torch.zeros(*shape, 1), inner, torch.full((*shape, 1), float(top))], -1)


def bundle_levels(L: int, H: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return {f"levels.{side}.{bits}": random_levels((L, H), bits, seed + 3 * i + bits)
            for i, side in enumerate("kv") for bits in (2, 3, 4, 8)}


def brute_round_trip(x: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    """x [..., n] with levels [..., K]: per-token min-max (fp16 scale and zero), then the level nearest to u by an
    explicit argmin over the levels (ties to the lower: argmin takes the first)."""
    mn, mx = x.aminmax(dim=-1, keepdim=True)
    scale = ((mx - mn) / ((1 << bits) - 1)).half().float()
    zero = mn.half().float()
    u = (x - zero) / torch.where(scale == 0, 1.0, scale)
    code = (u[..., None] - levels[..., None, :]).abs().argmin(-1)
    code = torch.where(scale == 0, 0, code)
    return zero + scale * levels[..., None, :].expand(*code.shape, -1).gather(-1, code[..., None])[..., 0]


# ---------------------------------------------------------------------------------------------- the format


@pytest.mark.parametrize("spec,k,v", [("K4cnV2n", "calibrated", "calibrated"), ("K8V4n", "uniform", "calibrated"),
                                      ("K4nV4g8kg8m8", "calibrated", "uniform"), ("K4snV4", "calibrated", "uniform"),
                                      ("K16V4n", "uniform", "calibrated"), ("K4cV2", "uniform", "uniform")])
def test_format_spelling_round_trips(spec, k, v):
    fmt = TierFormat.parse(spec)
    assert (fmt.k_levels, fmt.v_levels) == (k, v) and fmt.calibrated == (k != v or k == "calibrated")
    assert fmt.name == spec and TierFormat.parse(fmt.name) == fmt


@pytest.mark.parametrize("spec", ["K16nV4", "K8V32n"])
def test_raw_sides_refuse_levels_in_one_line(spec):
    with pytest.raises(ValueError, match="drop the `n`") as e:
        TierFormat.parse(spec)
    assert "\n" not in str(e.value)


def test_sliding_formats_take_levels():
    check_sliding_format(TierFormat.parse("K8V4n"))
    check_sliding_format(TierFormat.parse("K4cnV2ng32m8"))


# ---------------------------------------------------------------------------------------------- the quantizer


def test_nearest_level_ties_go_to_the_lower_level():
    levels = torch.tensor([0.0, 1.0, 2.5, 3.0])
    u = torch.tensor([[-1.0, 0.5, 0.50001, 1.75, 2.75, 2.76, 9.0]])
    assert quant.nearest_level(u, levels).tolist() == [[0, 0, 1, 1, 2, 3, 3]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_nearest_level_is_the_binary_search_over_midpoints(bits):
    """The counted comparisons (up to 4 bits) and the binary search (8 bits) give the same code as searchsorted over
    the midpoints, including on the midpoints themselves and outside the grid."""
    levels = random_levels((3,), bits, seed=bits)[:, None, None]                    # [H, 1, 1, K]
    mid = (levels[..., 1:] + levels[..., :-1]) / 2
    gen = torch.Generator().manual_seed(bits)
    u = torch.rand(3, 5, 7, 64, generator=gen) * (1 << bits) * 1.2 - 0.1 * (1 << bits)
    on = min(mid.shape[-1], 64)
    u[..., :on] = mid.expand(3, 5, 7, -1)[..., :on]                                 # exactly on a boundary
    want = torch.searchsorted(mid.expand(3, 5, 7, -1).contiguous(), u.contiguous())
    got = quant.nearest_level(u, levels)
    assert got.dtype == torch.uint8 and torch.equal(got.long(), want)


@pytest.mark.parametrize("bits,group,meta_bits", [(2, None, 16), (3, None, 16), (4, 4, 16), (2, 8, 8), (3, 8, 8),
                                                  (8, None, 16)])
def test_per_token_round_trip_is_the_nearest_level(bits, group, meta_bits):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 20, 16, generator=gen) * 2                                   # [H, S, n]
    levels = random_levels((3,), bits, seed=bits)
    got = quant.round_trip_per_token(x, bits, group, meta_bits, levels=levels[:, None])
    if group is None and meta_bits == 16:
        torch.testing.assert_close(got, brute_round_trip(x, levels[:, None], bits), rtol=0, atol=1e-6)
    uniform = quant.round_trip_per_token(x, bits, group, meta_bits)
    assert not torch.equal(got, uniform)                           # the levels are read
    if meta_bits == 16:            # endpoints pinned: a group decodes within its own [min, max] (up to fp16)
        mn, mx = x.view(3, 20, -1, group or 16).aminmax(dim=-1)
        assert bool((got.view(3, 20, -1, group or 16).amin(-1) >= mn - 1e-2).all())
        assert bool((got.view(3, 20, -1, group or 16).amax(-1) <= mx + 1e-2).all())


def test_per_channel_round_trip_uses_the_levels():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, 16, generator=gen)                                    # [H, pages, T, r]
    levels = random_levels((2,), 4, seed=2)
    got = quant.round_trip_per_channel(x, 4, levels=levels[:, None, None])
    want = brute_round_trip(x.transpose(-1, -2), levels[:, None, None], 4).transpose(-1, -2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    uniform = quant.round_trip_per_channel(x, 4)
    codes, scale, zero = quant.quantize_per_channel(x, 4)
    assert torch.equal(uniform, quant.dequantize_per_channel(codes, scale, zero))


# ---------------------------------------------------------------------------------------------- the store

MIXES = [("K8nV4n", "K4cnV2n"), ("K8V4n", "K2nV2"), ("K4nV2g4", "K2cnV2n"), ("K8nV4m8", "K4cnV4nm8"),
         ("K16V16", "K4cnV4n"), ("K8V8", "K8cV4n"), ("K8V3n", "K3cnV3nm8")]


@pytest.mark.parametrize("high,low", MIXES)
def test_store_reads_what_the_quality_model_predicts(high, low):
    """store write -> read equals `round_trip_per_token` / `round_trip_per_channel` with the head's levels, bit for
    bit (the quality model's prediction is the store's own arithmetic)."""
    levels = bundle_levels(1, 3)
    store = random_store(high, low, seed=1, holes=0.0, max_high=0, max_low_pages=0, levels=levels)
    gen = torch.Generator().manual_seed(3)
    for side, fmt in ((HIGH, store.high), (LOW, store.low)):
        b, h = torch.tensor([0, 1, 1]), torch.tensor([0, 2, 1])
        k_lut, v_lut = (levels[f"levels.{which}.{bits}"][0, h] if kind == "calibrated" else None
                        for which, bits, kind in (("k", fmt.k_bits, fmt.k_levels), ("v", fmt.v_bits, fmt.v_levels)))
        if fmt.k_mode == "channel":
            for i in range(3):
                g = next(g for g in store.groups[0] if int(h[i]) in g.heads.tolist())
                T = g.layouts[LOW].tokens
                k, v = torch.randn(1, T, 16, generator=gen) * 2, torch.randn(1, T, 16, generator=gen)
                store.write_pages(0, b[i:i + 1], h[i:i + 1], k, v, torch.arange(T)[None], torch.zeros(1, T))
                got_k, got_v, _, _ = store.read(0, LOW, b[i].repeat(T), h[i].repeat(T), torch.arange(T))
                want_k = quant.round_trip_per_channel(k[:, :, :g.r_k], fmt.k_bits, fmt.meta_bits,
                                                      None if k_lut is None else k_lut[i, None, None])[0]
                want_v = codec_round_trip(v[0, :, :g.r_v], fmt.v_bits, fmt.v_group, fmt.meta_bits,
                                          None if v_lut is None else v_lut[i].expand(T, -1))
                assert torch.equal(got_k[:, :g.r_k], want_k) and torch.equal(got_v[:, :g.r_v], want_v)
            continue
        k, v = torch.randn(3, 16, generator=gen) * 2, torch.randn(3, 16, generator=gen)
        store.append(0, side, b, h, k, v, torch.arange(3), torch.zeros(3))
        got_k, got_v, _, _ = store.read(0, side, b, h, store.fill[0, b, h, side] - 1)
        for i, g in ((i, next(g for g in store.groups[0] if int(h[i]) in g.heads.tolist())) for i in range(3)):
            want_k = codec_round_trip(k[i:i + 1, :g.r_k], fmt.k_bits, fmt.k_group, fmt.meta_bits,
                                      None if k_lut is None else k_lut[i:i + 1])
            want_v = codec_round_trip(v[i:i + 1, :g.r_v], fmt.v_bits, fmt.v_group, fmt.meta_bits,
                                      None if v_lut is None else v_lut[i:i + 1])
            assert torch.equal(got_k[i:i + 1, :g.r_k], want_k) and torch.equal(got_v[i:i + 1, :g.r_v], want_v)


def codec_round_trip(x, bits, group, meta_bits, levels):
    """x [n, r] as a per-token side gives it back: raw tiers through the codec, quantized ones through
    `quant.round_trip_per_token` (levels [n, K] or None)."""
    if bits >= 16:
        return codec.decode_tokens(*codec.encode_tokens(x, bits, group), bits, group, x.shape[-1], 0)
    return quant.round_trip_per_token(x, bits, group, meta_bits, levels=levels)


def test_uniform_formats_ignore_levels_and_store_the_same_bytes():
    a = random_store("K8V4", "K4cV2", seed=2)
    b = random_store("K8V4", "K4cV2", seed=2, levels=bundle_levels(1, 3))
    assert b.levels == {} and b.level_bytes() == 0 and torch.equal(a.arena.arena, b.arena.arena)


def test_a_calibrated_format_without_levels_is_refused_in_one_line():
    with pytest.raises(ValueError, match="needs calibrated levels `levels.v.2`") as e:
        random_store("K8V4", "K4cV2n", seed=0)
    assert "\n" not in str(e.value)
    bad = bundle_levels(1, 3)
    bad["levels.k.4"] = bad["levels.k.4"].flip(-1)
    with pytest.raises(ValueError, match="not sorted"):
        random_store("K8V4", "K4cnV2", seed=0, levels=bad)


# ---------------------------------------------------------------------------------------------- the CPU kernels


@pytest.mark.parametrize("g,n", [(2, 1), (3, 3)])
@pytest.mark.parametrize("high,low", MIXES)
def test_cpu_decode_matches_the_torch_reference(high, low, g, n):
    """The fused kernel's attention and score updates with calibrated levels equal the torch reference at the same
    float32 tolerance as uniform codes (only the order of the sums differs)."""
    assert_decode_matches(random_store(high, low, seed=MIXES.index((high, low)) + 10 * g + n,
                                       levels=bundle_levels(1, 3)), g, n)


@pytest.mark.parametrize("writer", [CpuBackend, EmulatedCudaBackend])
@pytest.mark.parametrize("high,low", MIXES)
def test_writers_write_the_torch_bytes(high, low, writer):
    """The CPU kernels' kvcal_write / append_every / insert_every / write_pages, and the CUDA writers' plans (through
    their emulation), encode the nearest level bit for bit as the torch store does (including ties at a midpoint and
    constant vectors)."""
    levels = bundle_levels(1, 3, seed=5)
    for bits in (2, 3, 4, 8):              # head 0's values on the uniform grid: ties at the midpoints k + 0.5
        levels[f"levels.v.{bits}"][0, 0] = torch.arange(1 << bits).float()
    ref = random_store(high, low, seed=7, holes=0.3, levels=levels)
    store = copy.deepcopy(ref)
    store.writer = writer
    gen = torch.Generator().manual_seed(8)
    b, h = ref.every_entry()
    for step in range(12):
        keys, values = torch.randn(len(b), 16, generator=gen) * 2, torch.randn(len(b), 16, generator=gen)
        keys[0] = 1.5                                                # scale 0: code 0
        top = float((1 << ref.high.v_bits) - 1)
        values[0] = torch.tensor([0.0, top, 0.5, 1.5]).repeat(4)     # scale 1, zero 0: u on two midpoints
        score = torch.rand(len(b), generator=gen)
        for s in (ref, store):
            s.insert(0, HIGH, b, h, keys, values, 500 + step, score, every_entry=True)
    if ref.low.k_mode == "channel":
        T = max(g.layouts[LOW].tokens for g in ref.groups[0])
        for g in ref.groups[0]:
            Tg = g.layouts[LOW].tokens
            k, v = torch.randn(len(g.heads), T, 16, generator=gen), torch.randn(len(g.heads), T, 16, generator=gen)
            args = (torch.zeros_like(g.heads), g.heads, k[:, :Tg], v[:, :Tg], torch.zeros(len(g.heads), Tg).long(),
                    torch.zeros(len(g.heads), Tg))
            ref.write_pages_torch(0, *args)
            store.write_pages(0, *args)
    assert torch.equal(store.fill, ref.fill) and torch.equal(store.arena.page_table, ref.arena.page_table)
    assert torch.equal(store.arena.arena, ref.arena.arena)


# ---------------------------------------------------------------------------------------------- CUDA, selection


def test_cuda_serves_levels_and_auto_falls_back_without_a_gpu():
    """The CUDA kernels read a layer's level table (tests/test_cuda_backend.py serves calibrated tiers through them
    and their emulation); `auto` still picks a CPU backend where no GPU is."""
    fmts = (TierFormat.parse("K8V4"), TierFormat.parse("K4cnV2n"))
    for backend in (CudaBackend, EmulatedCudaBackend):
        assert backend.supports_formats(fmts, 64) == []
    assert select_backend("auto", "cpu", fmts, 64) in (CpuBackend, TorchBackend)


@pytest.mark.parametrize("g,n", [(2, 1), (3, 3)])
@pytest.mark.parametrize("high,low", MIXES)
def test_emulated_cuda_decode_matches_the_torch_reference(high, low, g, n):
    """The CUDA kernels' plan and arithmetic (their CPU emulation) decode each page with its head's levels."""
    assert_decode_matches(random_store(high, low, seed=MIXES.index((high, low)) + 10 * g + n,
                                       levels=bundle_levels(1, 3)), g, n, backend=EmulatedCudaBackend)


# ---------------------------------------------------------------------------------------------- the bundle


@pytest.fixture(scope="module")
def tiny():
    model, tok = make_model("llama")
    return model, tok


def test_levels_survive_save_and_load(tiny, tmp_path):
    model, tok = tiny
    bundle = random_bundle(model, tok)
    L, H, _ = bundle.shape
    bundle.extras = bundle_levels(L, H)
    path = save_bundle(bundle, tmp_path / "levels.kvcal.safetensors")
    loaded = load_bundle(path)
    assert set(loaded.extras) == set(bundle.extras)
    assert all(torch.equal(loaded.extras[k], v) for k, v in bundle.extras.items())
    plain = save_bundle(random_bundle(model, tok), tmp_path / "plain.kvcal.safetensors")
    assert load_bundle(plain).extras == {}
    assert [safetensors_header(p)[1]["__metadata__"]["schema_version"] for p in (path, plain)] == ["3", "1"]


def test_levels_need_schema_3():
    from kvcal.runtime.bundle_checks import _validate_versioned

    for version in ("1", "2"):
        assert "cannot hold calibrated levels" in _validate_versioned({"levels.k.4"}, {"schema_version": version})[0]
    assert _validate_versioned({"levels.k.4"}, {"schema_version": "3"}) == []


def test_the_manifest_export_carries_the_levels(tiny, tmp_path):
    """A manifest of calibrated tiers holds the bundle's levels beside the bases and names the calibrated sides; a
    bundle without the levels its tiers need is refused in one line, before anything is written."""
    from safetensors.torch import load_file

    model, tok = tiny
    config = CompressionConfig(high=TierFormat.parse("K8V4n"))
    with pytest.raises(ValueError, match="need levels levels.v.4, not in the bundle"):
        export_manifest(random_bundle(model, tok), tmp_path / "refused", config)
    assert not (tmp_path / "refused").exists()
    bundle = random_bundle(model, tok)
    L, H = bundle.shape[:2]
    bundle.extras["levels.v.4"] = random_levels((L, H), 4)
    export_manifest(bundle, tmp_path / "out", config)
    tensors = load_file(str(tmp_path / "out" / "kvcal_bases.safetensors"))
    assert torch.equal(tensors["levels.v.4"], bundle.extras["levels.v.4"])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    high = manifest["config"]["high"]
    assert high["v_levels"] == "calibrated" and high["k_levels"] == "uniform"


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.flip(-1), "not sorted"),
    (lambda t: t[..., :-1], "has shape"),
    (lambda t: t.index_put((torch.tensor(0), torch.tensor(0), torch.tensor(1)), torch.tensor(float("nan"))),
     "non-finite"),
    (lambda t: t * 0.5, "endpoints must be pinned"),
])
def test_bad_levels_are_refused_in_one_line(tiny, tmp_path, edit, message):
    model, tok = tiny
    bundle = random_bundle(model, tok)
    L, H, _ = bundle.shape
    bundle.extras = bundle_levels(L, H)
    bundle.extras["levels.v.4"] = edit(bundle.extras["levels.v.4"]).contiguous()
    with pytest.raises(BundleError, match=message) as e:
        save_bundle(bundle, tmp_path / "bad.kvcal.safetensors")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- whole decodes

CONFIGS = {
    "tiers, calibrated per-channel low": CompressionConfig(high=TierFormat.parse("K8nV4n"),
                                                           low=TierFormat.parse("K4cnV2n"),
                                                           tiering=TieringConfig(window=4, alpha_high=1.5,
                                                                                 alpha_low=0.5)),
    "untiered, calibrated values": CompressionConfig(high=TierFormat.parse("K4V2n"), use_ranks=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_whole_decode_cpu_matches_torch_and_counts_the_levels(tiny, name):
    """A bundle with levels through KvcalCache: the cpu backend's logits equal the torch backend's, the levels are
    the bundle's fixed bytes, and without them in the bundle the cache is refused in one line."""
    model, tok = tiny
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    bundle = random_bundle(model, tok)
    bundle.extras = bundle_levels(L, H)
    ids = tok([random_text(50, seed=1), random_text(50, seed=2)], return_tensors="pt").input_ids[:, :40]
    runs = {}
    for backend in ("torch", "cpu"):
        cache = KvcalCache.from_bundle(bundle, model, CONFIGS[name], tokenizer=tok, raw_tokens=0,
                                       serve=ServeOptions(backend, 256))
        runs[backend] = (_decode_logits(model, cache, ids, 16), cache)
    (want, ref), (got, cache) = runs["torch"], runs["cpu"]
    assert cache.kv.backend is CpuBackend
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    fmt = CONFIGS[name]
    used = {(side, bits) for f in (fmt.high, fmt.low) if f.calibrated
            for side, bits, kind in (("k", f.k_bits, f.k_levels), ("v", f.v_bits, f.v_levels)) if kind == "calibrated"}
    want_fixed = sum(L * H * (1 << bits) * 4 for _, bits in used)
    assert cache.memory()["fixed_bytes"] == want_fixed == ref.kv.store.level_bytes()
    bundle.extras = {}
    with pytest.raises(ValueError, match="needs calibrated levels") as e:
        _decode_logits(model, KvcalCache.from_bundle(bundle, model, CONFIGS[name], tokenizer=tok), ids[:, :5], 4)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("sliding", ["K4cnV2ng16m8", "K4nV4n"])
def test_sliding_layers_serve_levels_and_count_them(sliding):
    """A tiny Gemma3 whose sliding layers hold calibrated levels: the cpu backend's logits equal the torch
    backend's (float order only), the levels are read (other logits than the uniform format's), and the sliding
    layers' level rows are the cache's fixed bytes, held on top of the same token bytes and allowed for."""
    model, tok = make_model("gemma3_text")
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    bundle = random_bundle(model, tok)
    bundle.extras = bundle_levels(L, H)
    fmt = TierFormat.parse(sliding)
    config = CompressionConfig(high=TierFormat(16, 16), sliding=fmt, page_tokens=8)
    uniform = CompressionConfig(high=TierFormat(16, 16), sliding=TierFormat.parse(sliding.replace("n", "")),
                                page_tokens=8)
    ids = tok([random_text(60, seed=1), random_text(60, seed=2)], return_tensors="pt").input_ids[:, :48]
    runs = {}
    for name, cfg, backend in (("torch", config, "torch"), ("cpu", config, "cpu"), ("uniform", uniform, "cpu")):
        cache = KvcalCache.from_bundle(bundle, model, cfg, serve=ServeOptions(backend, 256))
        runs[name] = (_decode_logits(model, cache, ids, 12), cache)
    want, got, uniform_logits = (runs[name][0] for name in ("torch", "cpu", "uniform"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (uniform_logits - want).abs().max() > 1e-2 * want.abs().max()
    sliding_layers = sum(t == "sliding_attention" for t in model.config.layer_types)
    per_layer = sum(H * (1 << bits) * 4 for bits, kind in ((fmt.k_bits, fmt.k_levels), (fmt.v_bits, fmt.v_levels))
                    if kind == "calibrated")
    memory = runs["cpu"][1].memory()
    assert memory["fixed_bytes"] == sliding_layers * per_layer > 0
    flat = runs["uniform"][1].memory()          # the same bytes of tokens, the levels held on top, and allowed for
    assert memory["total_bytes"] == flat["total_bytes"] and flat["fixed_bytes"] == 0
    assert memory["held_bytes"] - flat["held_bytes"] == memory["fixed_bytes"]
    assert memory["allowance_bytes"] - flat["allowance_bytes"] == memory["fixed_bytes"]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_whole_decode_through_the_cuda_kernels_matches_torch(tiny, name):
    """The same bundle with levels on the GPU: the CUDA kernels' logits equal the torch backend's there (fp32, only
    the order of the sums differs)."""
    model, tok = tiny
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    bundle = random_bundle(model, tok)
    bundle.extras = bundle_levels(L, H)
    gpu_model = copy.deepcopy(model).cuda()
    ids = tok([random_text(50, seed=1), random_text(50, seed=2)], return_tensors="pt").input_ids[:, :40].cuda()
    runs = {}
    for backend in ("torch", "cuda"):
        cache = KvcalCache.from_bundle(bundle, gpu_model, CONFIGS[name], tokenizer=tok, raw_tokens=0,
                                       serve=ServeOptions(backend, 256))
        runs[backend] = _decode_logits(gpu_model, cache, ids, 16)
        assert cache.kv.backend.name() == backend
    torch.testing.assert_close(runs["cuda"], runs["torch"], rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------- fitting


def test_fitted_levels_code_gaussian_data_better_than_uniform_at_2_bits():
    """Levels fitted on the normalised samples of Gaussian vectors lower the round-trip error against the uniform
    grid, measured on other vectors from the same distribution."""
    gen = torch.Generator().manual_seed(0)
    train, test = torch.randn(2, 4000, 32, generator=gen)
    u = quant.normalised_per_token(train, 2)[0].reshape(-1)                           # as the store normalises
    assert float(u.min()) > -0.01 and float(u.max()) < 3.01                      # up to fp16 scale and zero
    levels = fit_levels(u, 2)
    assert levels[0] == 0 and levels[-1] == 3 and bool((levels[1:] >= levels[:-1]).all())
    err = lambda y: float(((y - test) ** 2).mean())                                # noqa: E731
    calibrated = err(quant.round_trip_per_token(test, 2, levels=levels))
    assert calibrated < 0.95 * err(quant.round_trip_per_token(test, 2))


def test_normalised_samples_code_as_the_store_codes():
    """The nearest level of the normalised samples is the code the quantizer writes (per token and per channel)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 8, 16, generator=gen)
    levels = random_levels((3,), 4, seed=4)
    codes = quant.quantize_per_token(x, 4, 8, levels=levels[:, None])[0]
    assert torch.equal(quant.nearest_level(quant.normalised_per_token(x, 4, 8)[0], levels[:, None]), codes)
    codes = quant.quantize_per_channel(x, 4, levels=levels[:, None])[0]
    assert torch.equal(quant.nearest_level(quant.normalised_per_channel(x, 4)[0], levels[:, None]), codes)
