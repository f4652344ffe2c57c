"""CudaBackend without a GPU (compile + register report, argument packing, grid math, plans checked through the CPU
emulator against the torch reference, backend selection) and with one (kernels vs the torch reference).

Nothing in the GPU section has been run in development (no GPU was available); those tests skip with the reason."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from conftest import needs_gpu
from test_levels import bundle_levels
from typer.testing import CliRunner

from kvcal.runtime.backends import TorchBackend, select_backend
from kvcal.runtime.backends.cuda import ceil_div, compile_kernel, cuda_status
from kvcal.runtime.backends.cuda.backend import (
    QT,
    CudaBackend,
    decode_args,
    merge_smem,
    signature,
    split_smem,
    write_args,
)
from kvcal.runtime.backends.cuda.emulate import emulate_decode, emulate_write
from kvcal.runtime.backends.cuda.plan import build_decode_plan, build_write_plan, desc_fields, desc_table
from kvcal.runtime.backends.cuda.sources import KERNELS, kernel_signature, kernel_text
from kvcal.runtime.storage.layout import PageLayout, TierFormat
from kvcal.runtime.storage.pages import HIGH, LOW
from kvcal.runtime.storage.store import CompressedStore

ARCHS = ("sm_80", "sm_90")      # A100, H100/H200
REGISTER_BUDGET = 128           # per thread: 128 threads x 128 registers keeps 4 blocks per SM
SPILL_BUDGET = (0, 0)           # (store, load) bytes per function: local-memory traffic in the inner loops is a bug

# (high, low) tiers; a trailing "u": the low tier is untracked (no score or position in its pages)
MIXES = [("K8V4", "K4cV2"), ("K8V4", "K2V2"), ("K16V16", "K4cV2"), ("K16V16", "K4cV4u"), ("K8V4", "K4V2u"),
         ("K8V3", "K3cV3"), ("K16V16", "K3V3g4m8"),
         ("K8V4m8", "K4cV2m8"), ("K16V16", "K4cV4m8u"), ("K8V4g4m8", "K2V2m8"),
         ("K8V8m8", "K4cV4m8u"),      # m8: 8-bit scales and zeros
         ("K8nV4n", "K4cnV2n"), ("K8V4n", "K2nV2"), ("K8nV4m8", "K4cnV4nm8"), ("K8V3n", "K3cnV3nm8"),
         ("K16V16", "K2cnV2nm8u")]    # n: calibrated levels (tests/test_levels.py)


# ---------------------------------------------------------------- random stores of mixed tiers and ranks


def random_store(high: str, low: str, *, seed: int = 0, B: int = 2, H: int = 3, d: int = 16, device="cpu",
                 max_high: int = 40, max_low_pages: int = 2, holes: float = 0.15,
                 raw16: torch.dtype = torch.float16) -> CompressedStore:
    """Ragged lengths per (sequence, head), three rank groups, both tiers, and holes (pos -1) in both sections (not
    in an untracked low tier, `low` ending in "u")."""
    gen = torch.Generator().manual_seed(seed)
    rank_k = torch.tensor([[16, 8, 12][:H]])
    rank_v = torch.tensor([[12, 16, 8][:H]])
    tracked = not low.endswith("u")
    store = CompressedStore(rank_k, rank_v, [0], high=TierFormat.parse(high), low=TierFormat.parse(low.rstrip("u")),
                            head_dim=d, batch=B, page_bytes=512, initial_pages=4, device=device, raw16=raw16,
                            low_tracked=tracked, levels=bundle_levels(1, H, seed))   # uniform sides ignore levels
    dev = store.device
    pos = 0
    for side, fmt in ((LOW, store.low), (HIGH, store.high)):
        for bi in range(B):
            for hi in range(H):
                if side == LOW and fmt.k_mode == "channel":
                    T = next(g for g in store.groups[0] if hi in g.heads.tolist()).layouts[LOW].tokens
                    for _ in range(int(torch.randint(0, max_low_pages + 1, (1,), generator=gen))):
                        b, h = torch.tensor([bi], device=dev), torch.tensor([hi], device=dev)
                        store.write_pages(0, b, h, torch.randn(1, T, d, generator=gen).to(dev),
                                          torch.randn(1, T, d, generator=gen).to(dev),
                                          torch.arange(pos, pos + T, device=dev)[None],
                                          torch.rand(1, T, generator=gen).to(dev))
                        pos += T
                    continue
                n = int(torch.randint(0, max_high + 1, (1,), generator=gen)) if (bi, hi) != (0, 0) else max_high
                b, h = torch.full((n,), bi, device=dev), torch.full((n,), hi, device=dev)
                store.append(0, side, b, h, torch.randn(n, d, generator=gen).to(dev) * 2,
                             torch.randn(n, d, generator=gen).to(dev), torch.arange(pos, pos + n, device=dev),
                             torch.rand(n, generator=gen).to(dev))
                pos += n
    for side in (HIGH, LOW) if tracked else (HIGH,):  # punch holes
        b, h = torch.arange(B).repeat_interleave(H), torch.arange(H).repeat(B)
        _, p = store.section_meta(0, side, b.to(dev), h.to(dev))
        drop = (p >= 0).cpu() & (torch.rand(p.shape, generator=gen) < holes)
        e, s = torch.nonzero(drop, as_tuple=True)
        if len(e):
            store.drop(0, side, b[e].to(dev), h[e].to(dev), s.to(dev))
    return store


def decode_inputs(store: CompressedStore, g: int, n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    B, H = store.batch, store.num_kv_heads
    r, rv = store.r_k_max[0], store.r_v_max[0]
    q = torch.randn(B, H, g, n, r, generator=gen)
    return q, torch.randn(B, H, n, r, generator=gen) * 2, torch.randn(B, H, n, rv, generator=gen)


# ---------------------------------------------------------------- NVRTC: every kernel, sm_80 and sm_90


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file", sorted(KERNELS))
def test_kernels_compile_within_register_budget(nvrtc_cache, file, arch):
    # the register/spill report is logged at debug level (`pytest --log-level=DEBUG` shows it with a failure)
    mod = compile_kernel(kernel_text(file), list(KERNELS[file]), arch, cache_dir=nvrtc_cache, name=file[:-3])
    assert mod.cubin[:4] == b"\x7fELF" and set(mod.symbols) == set(KERNELS[file])
    for fn, spill in mod.spills.items():     # callees too
        assert spill <= SPILL_BUDGET, f"{fn} spills {spill} B on {arch}:\n{mod.log}"
    for k in KERNELS[file]:
        assert 0 < mod.registers[k] <= REGISTER_BUDGET, f"{k} uses {mod.registers[k]} registers on {arch}"


def test_local_headers_are_inlined_into_the_hashed_source():
    text = kernel_text("decode_attention.cu")
    assert '#include "page_desc.cuh"' not in text and "struct PageDesc" in text
    assert text.count("struct PageDesc {") == 1


# ---------------------------------------------------------------- layout passing


def test_desc_table_is_page_layout():
    """Every PageDesc field comes from PageLayout (same name) or its format; nothing is recomputed in the .cu."""
    store = random_store("K8V4", "K4cV2")
    fields = desc_fields()
    assert fields[:3] == ("tokens", "r_k", "r_v") and len(set(fields)) == len(fields)
    descs = desc_table(store, 0)
    assert descs.dtype == torch.int32 and descs.shape == (2 * len(store.groups[0]), len(fields))
    for gi, g in enumerate(store.groups[0]):
        for side in (HIGH, LOW):
            lay: PageLayout = g.layouts[side]
            row = dict(zip(fields, descs[2 * gi + side].tolist()))
            for f in fields:
                if hasattr(lay, f):
                    assert row[f] == getattr(lay, f), (f, lay)
            assert (row["k_bits"], row["v_bits"]) == (lay.fmt.k_bits, lay.fmt.v_bits)
            assert row["k_channel"] == (lay.fmt.k_mode == "channel")
            assert row["raw_bf16"] == 0


def test_decode_plan_pages_match_the_store():
    store = random_store("K8V4", "K4cV2", seed=3)
    plan = build_decode_plan(store, 0, chunk=2)
    B, H = store.batch, store.num_kv_heads
    for item in range(B * H):
        b, h = item // H, item % H
        want, fills = [], []
        for side in (HIGH, LOW):
            g = next(g for g in store.groups[0] if h in g.heads.tolist())
            pages = store.section_pages(0, side, torch.tensor([b]), torch.tensor([h]))[0]
            fill = int(store.fill[0, b, h, side])
            T = g.layouts[side].tokens
            for k, page in enumerate(pages.tolist()):
                want.append(page * store.page_bytes)
                fills.append(min(T, fill - k * T))
        sl = slice(int(plan.item_page_start[item]), int(plan.item_page_start[item + 1]))
        assert plan.page_off[sl].tolist() == want and plan.page_fill[sl].tolist() == fills
        sides = [int(x) % 2 for x in plan.page_desc[sl]]
        assert sides == sorted(sides)                                   # high pages, then low pages


def test_decode_plan_tasks_cover_pages_longest_first():
    store = random_store("K8V4", "K4V2", seed=4, max_high=80)
    for chunk in (1, 2, 3, None):
        plan = build_decode_plan(store, 0, chunk=chunk, target_blocks=8)
        cover = torch.zeros(plan.num_pages, dtype=torch.int64)
        for t in range(plan.num_tasks):
            b, e, item = int(plan.task_begin[t]), int(plan.task_end[t]), int(plan.task_item[t])
            assert 0 < e - b <= plan.chunk
            assert plan.item_page_start[item] <= b and e <= plan.item_page_start[item + 1]
            cover[b:e] += 1
        assert (cover == 1).all()                                       # every page in exactly one task
        cost = torch.stack([plan.page_fill[int(b):int(e)].sum() for b, e in zip(plan.task_begin, plan.task_end)])
        assert (cost[:-1] >= cost[1:]).all()                            # longest task first
        for item in range(len(plan.item_task_start) - 1):               # the merge finds exactly the item's tasks
            tasks = plan.item_tasks[int(plan.item_task_start[item]):int(plan.item_task_start[item + 1])].long()
            assert (plan.task_item[tasks] == item).all()
        assert sorted(plan.item_tasks.tolist()) == list(range(plan.num_tasks))
    assert build_decode_plan(store, 0, target_blocks=10 ** 6).chunk == 1
    total = build_decode_plan(store, 0, chunk=1).num_pages
    assert build_decode_plan(store, 0, target_blocks=4).chunk == ceil_div(total, 4)


@pytest.mark.parametrize("high,low", [("K8V4", "K2V2"), ("K16V16", "K4V2"), ("K32V32", "K8V8"), ("K8V4", "K4V2u")])
def test_write_plan_bytes_match_store_write(high, low):
    """write_tokens' targets and segment offsets, emulated byte for byte against CompressedStore.write."""
    store = random_store(high, low, seed=5, holes=0.0)
    gen = torch.Generator().manual_seed(9)
    for side in (HIGH, LOW):
        B, H = store.batch, store.num_kv_heads
        b, h = torch.arange(B).repeat_interleave(H), torch.arange(H).repeat(B)
        fill = store.fill[0, b, h, side]
        keep = fill > 0
        b, h, slot = b[keep], h[keep], (torch.rand(int(keep.sum()), generator=gen) * fill[keep]).long()
        n, d = len(b), 16
        keys, values = torch.randn(n, d, generator=gen) * 3, torch.randn(n, d, generator=gen)
        pos, score = torch.arange(n) + 1000, torch.rand(n, generator=gen)
        before = store.arena.arena.clone()
        store.write(0, side, b, h, slot, keys, values, pos, score)
        emulated = before.clone()
        emulate_write(build_write_plan(store, 0, side, b, h, slot), emulated, keys, values, pos, score)
        assert torch.equal(emulated, store.arena.arena)


# ---------------------------------------------------------------- the decode plan, run by the CPU emulator


@pytest.mark.parametrize("chunk", [1, 2, None])
@pytest.mark.parametrize("g,n", [(2, 1), (3, 3)])
@pytest.mark.parametrize("high,low", MIXES)
def test_emulated_kernels_match_torch_reference(high, low, g, n, chunk):
    store = random_store(high, low, seed=MIXES.index((high, low)) * 10 + g + n)
    ref_store = copy.deepcopy(store)
    q, kn, vn = decode_inputs(store, g, n)
    scale = 16 ** -0.5
    out_ref, score_ref = TorchBackend.attend(ref_store, 0, q, kn, vn, scale)
    plan = build_decode_plan(store, 0, chunk=chunk)
    out, score = emulate_decode(plan, store.arena.arena, q, kn, vn, scale)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(score, score_ref, rtol=1e-5, atol=1e-6)
    got, want = store.gather(0), ref_store.gather(0)                 # the fused score update of stored tokens
    assert torch.equal(got.pos, want.pos)
    live = want.pos >= 0
    torch.testing.assert_close(got.score[live], want.score[live], rtol=1e-5, atol=1e-6)


def test_emulated_kernels_read_bfloat16_raw_tiers():
    store = random_store("K16V16", "K4cV2", seed=6, raw16=torch.bfloat16)
    assert desc_table(store, 0)[:, desc_fields().index("raw_bf16")].tolist() == [1] * 6
    ref_store = copy.deepcopy(store)
    q, kn, vn = decode_inputs(store, 2, 1)
    ref = TorchBackend.attend(ref_store, 0, q, kn, vn, 0.25)
    got = emulate_decode(build_decode_plan(store, 0, chunk=1), store.arena.arena, q, kn, vn, 0.25)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_emulated_kernels_without_score_tracking_leave_scores():
    store = random_store("K8V4", "K4cV2", seed=7)
    before = store.arena.arena.clone()
    q, kn, vn = decode_inputs(store, 2, 2)
    out_ref, s_ref = TorchBackend.attend(copy.deepcopy(store), 0, q, kn, vn, 0.25, track_scores=False)
    out, s = emulate_decode(build_decode_plan(store, 0, chunk=1), store.arena.arena, q, kn, vn, 0.25, False)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(s, s_ref) and torch.equal(store.arena.arena, before)


def test_emulated_kernels_on_an_empty_store():
    """Only the new tokens: no tasks, the merge alone."""
    store = random_store("K8V4", "K4V2", seed=8, max_high=0, max_low_pages=0)
    store.release()
    plan = build_decode_plan(store, 0)
    assert plan.num_pages == 0 and plan.num_tasks == 0
    q, kn, vn = decode_inputs(store, 2, 3)
    ref = TorchBackend.attend(copy.deepcopy(store), 0, q, kn, vn, 0.5)
    got = emulate_decode(plan, store.arena.arena, q, kn, vn, 0.5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- launch arguments and grid math


@pytest.mark.parametrize("kernel", [k for ks in KERNELS.values() for k in ks])
def test_signatures_parse_from_the_source(kernel):
    params = signature(kernel)
    assert params and all(p.name for p in params)
    file = next(f for f, ks in KERNELS.items() if kernel in ks)
    assert kernel_signature(kernel_text(file), kernel) == params
    assert params[0].name == "arena" and params[1].name == "descs"
    with pytest.raises(ValueError, match="no_such"):
        kernel_signature(kernel_text(file), "no_such")


def _decode_buffers(plan, q, vn, track_scores=True):
    B, H, g, n, r = q.shape
    qn, rv = g * n, vn.shape[-1]
    return dict(out=torch.empty(B, H, g, n, rv), exact_score=torch.empty(B, H, n),
                logits=torch.empty(plan.num_pages * plan.t_max * qn) if track_scores else None,
                part_m=torch.empty(plan.num_tasks * qn), part_l=torch.empty(plan.num_tasks * qn),
                part_acc=torch.empty(plan.num_tasks * qn * rv))


def test_decode_launch_args_are_packed_at_c_sizes():
    store = random_store("K8V4", "K4cV2")
    plan = build_decode_plan(store, 0, chunk=2)
    q, kn, vn = decode_inputs(store, 2, 1)
    split, merge = decode_args(plan, store.arena.arena, q, kn, vn, 0.25, True, **_decode_buffers(plan, q, vn))
    for packed in (split, merge):
        for p, v in zip(packed.params, packed.values):
            want = np.uint64 if p.pointee else {"int": np.int32, "float": np.float32}[p.ctype]
            assert type(v) is want, (p, type(v))
    named = {p.name: v for p, v in zip(split.params, split.values)}
    assert named["qn"] == 2 and named["r"] == 16 and named["rv"] == 16 and named["t_max"] == plan.t_max
    assert named["page_off"] == plan.page_off.data_ptr() and named["scale"] == np.float32(0.25)
    named = {p.name: v for p, v in zip(merge.params, merge.values)}
    assert (named["g"], named["n"], named["track_scores"]) == (2, 1, 1)
    # without score tracking the logits scratch is NULL
    _, merge = decode_args(plan, store.arena.arena, q, kn, vn, 0.25, False, **_decode_buffers(plan, q, vn, False))
    assert dict(zip([p.name for p in merge.params], merge.values))["logits"] == 0
    # a plan field of the wrong width is refused, not reinterpreted
    bad = copy.copy(plan)
    bad.page_off = plan.page_off.to(torch.int32)
    with pytest.raises(TypeError, match="page_off"):
        decode_args(bad, store.arena.arena, q, kn, vn, 0.25, True, **_decode_buffers(plan, q, vn))


def test_write_launch_args_are_packed_at_c_sizes():
    store = random_store("K8V4", "K2V2", holes=0.0)
    b, h, slot = torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([0, 0])
    plan = build_write_plan(store, 0, HIGH, b, h, slot)
    keys, values = torch.randn(2, 16), torch.randn(2, 16)
    packed = write_args(plan, store.arena.arena, keys, values, torch.tensor([5, 6], dtype=torch.int32),
                        torch.rand(2), store.num_kv_heads)
    named = dict(zip([p.name for p in packed.params], packed.values))
    assert type(named["n_tokens"]) is np.int32 and named["n_tokens"] == 2 and named["k_stride"] == 16
    assert named["tok_page_off"] == plan.page_off.data_ptr() and type(named["write_keys"]) is np.int32
    assert named["levels"] == 0 and named["H"] == 3 and named["tok_head"] == plan.head.data_ptr()   # uniform: null
    with pytest.raises(TypeError, match="pos"):
        write_args(plan, store.arena.arena, keys, values, torch.tensor([5, 6]), torch.rand(2), 3)   # int64 pos


def test_grid_and_shared_memory_math():
    store = random_store("K8V4", "K4cV2")
    plan = build_decode_plan(store, 0, chunk=1)
    assert plan.num_tasks == plan.num_pages                       # one block per page at chunk 1
    assert ceil_div(70, 4) == 18                                  # write_tokens: one warp per token, 4 per block
    assert split_smem(16, plan.t_max) == 4 * (QT * 16 + QT * plan.t_max + plan.t_max)
    assert merge_smem(4, 1, 1) == 4 * 4 * 3
    # the default geometry of a 128-dim head fits the 48 KiB default on every tier format
    for spec in ("K8V4", "K4cV2", "K2V2", "K16V16"):
        lay = PageLayout.build(TierFormat.parse(spec), 8, 8, 4608)   # low ranks: the most tokens per page
        assert split_smem(128, lay.tokens) <= 48 * 1024, spec


# ---------------------------------------------------------------- backend selection without a GPU

NO_GPU = not cuda_status().available


@pytest.mark.skipif(not NO_GPU, reason="checks the GPU-less fallback")
def test_select_cuda_without_gpu_is_a_one_line_value_error():
    with pytest.raises(ValueError) as exc:
        select_backend.__wrapped__("cuda", "cpu")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("attention backend `cuda` cannot run on cpu: ")
    assert cuda_status().reason in msg
    assert CudaBackend.supports(torch.device("cpu"))


@pytest.mark.skipif(not NO_GPU, reason="checks the GPU-less fallback")
def test_auto_falls_back_to_torch_with_one_log_line(caplog):
    cuda_status()                                            # its own probe line is not the selector's
    with caplog.at_level(logging.INFO, logger="kvcal.runtime.backends.registry"):
        backend = select_backend.__wrapped__("auto", "cpu")
    assert backend is not CudaBackend                        # the fused cpu backend, or torch where it cannot build
    lines = [r for r in caplog.records if r.name == "kvcal.runtime.backends.registry"]
    assert len(lines) == 1 and backend.name() in lines[0].getMessage() and "cuda" in lines[0].getMessage()


@pytest.mark.skipif(not NO_GPU, reason="checks the GPU-less fallback")
def test_bench_backend_cuda_prints_one_line_and_fails(tmp_path):
    from kvcal.cli import app

    r = CliRunner().invoke(app, ["bench", "--bundle", str(tmp_path / "unused"), "--backend", "cuda"])
    assert r.exit_code == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "attention backend `cuda`" in r.stderr


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b"])
def test_the_shipped_bundles_formats_are_served_by_the_kernels(model):
    """Every tier format of each bundle in artifacts/ (calibrated levels, per-channel keys, 8-bit scales) is one the
    CUDA kernels declare they serve, so on a GPU `auto` serves them through the kernels, not the torch reference."""
    from pathlib import Path

    from kvcal.runtime.bundle import load_bundle
    from kvcal.runtime.config import CompressionConfig

    bundle = load_bundle(Path(__file__).resolve().parents[1] / "artifacts" / f"{model}.kvcal.safetensors")
    formats = CompressionConfig.from_dict(bundle.settings).formats
    assert any(f.calibrated for f in formats)
    assert CudaBackend.supports_formats(formats, bundle.shape[-1]) == []


def test_supports_names_a_non_cuda_device():
    assert any("`cpu` is not a CUDA device" in x for x in CudaBackend.supports(torch.device("cpu")))
    assert CudaBackend.prefill is TorchBackend.prefill or CudaBackend.prefill.__func__ is TorchBackend.prefill


# ---------------------------------------------------------------- GPU: kernels vs the torch reference




@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("chunk", [1, None])
@pytest.mark.parametrize("g,n", [(2, 1), (4, 3)])
@pytest.mark.parametrize("high,low", MIXES)
def test_gpu_decode_matches_torch_reference(high, low, g, n, chunk):
    store = random_store(high, low, seed=11, device="cuda")
    ref_store = copy.deepcopy(store)
    q, kn, vn = (t.cuda() for t in decode_inputs(store, g, n))
    out_ref, score_ref = TorchBackend.attend(ref_store, 0, q, kn, vn, 0.25)
    out, score = CudaBackend.attend(store, 0, q, kn, vn, 0.25, chunk=chunk)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, out_ref, rtol=1e-3, atol=1e-3)      # fp16 tolerance
    torch.testing.assert_close(score, score_ref, rtol=1e-3, atol=1e-3)
    got, want = store.gather(0), ref_store.gather(0)
    live = want.pos >= 0
    torch.testing.assert_close(got.score[live], want.score[live], rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("high,low", [("K8V4", "K2V2"), ("K16V16", "K4V2"), ("K8V4", "K4cV2"), ("K8nV4n", "K4cnV2nm8"),
                                      ("K8V3n", "K3cnV3n")])
def test_gpu_cache_writes_match_store_bytes(high, low):
    """write_tokens / write_channel_keys produce the torch store's bytes (same rounding, same layout)."""
    ref = random_store(high, low, seed=12, device="cuda", holes=0.0)
    mine = copy.deepcopy(ref)
    mine.writer = CudaBackend                      # the store hands its writes to the backend's kernels
    gen = torch.Generator().manual_seed(3)
    B, H, d = ref.batch, ref.num_kv_heads, 16
    b, h = torch.arange(B).repeat_interleave(H).cuda(), torch.arange(H).repeat(B).cuda()
    keys, values = torch.randn(B * H, d, generator=gen).cuda(), torch.randn(B * H, d, generator=gen).cuda()
    pos, score = torch.arange(B * H).cuda() + 5000, torch.rand(B * H, generator=gen).cuda()
    for store in (ref, mine):
        store.append(0, HIGH, b, h, keys, values, pos, score)
    if ref.low.k_mode == "channel":
        T = max(g.layouts[LOW].tokens for g in ref.groups[0])
        kp, vp = torch.randn(B * H, T, d, generator=gen).cuda(), torch.randn(B * H, T, d, generator=gen).cuda()
        pp, sp = torch.arange(B * H * T).view(B * H, T).cuda(), torch.rand(B * H, T, generator=gen).cuda()
        for store in (ref, mine):
            for gr in store.groups[0]:
                sel = torch.isin(h, gr.heads)
                Tg = gr.layouts[LOW].tokens
                store.write_pages(0, b[sel], h[sel], kp[sel, :Tg], vp[sel, :Tg], pp[sel, :Tg], sp[sel, :Tg])
    torch.cuda.synchronize()
    got, want = mine.gather(0), ref.gather(0)
    assert torch.equal(got.pos, want.pos) and torch.equal(got.score, want.score)
    # Not demanded bit for bit: torch on CUDA computes `(max - min) / levels` as `(max - min) * (1 / levels)`, so an
    # fp16 scale may differ by one ulp (and then a code by one) where the fp32 quotient sits on a rounding boundary.
    differ = (mine.arena.arena != ref.arena.arena).float().mean().item()
    assert differ < 1e-3, f"{differ:.2%} of the arena's bytes differ from the torch store's"


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("g,n", [(2, 1), (3, 3)])
def test_emulated_kernels_serve_an_exact_window(g, n, track, padded):
    """The exact block (window tokens every query sees, then the new ones; the second sequence's first 3 window
    tokens left padding when `padded`, else exact_from None), as TorchBackend.attend; the launch packs the window's
    length and its padding (a null pointer without)."""
    store = random_store("K8V8", "K4cV2", seed=21 + n)
    ref_store = copy.deepcopy(store)
    gen = torch.Generator().manual_seed(5)
    B, H, r, rv, m = store.batch, store.num_kv_heads, store.r_k_max[0], store.r_v_max[0], n + 5
    q = torch.randn(B, H, g, n, r, generator=gen)
    kx, vx = torch.randn(B, H, m, r, generator=gen) * 2, torch.randn(B, H, m, rv, generator=gen)
    exact_from = torch.tensor([0, 3]) if padded else None
    want = TorchBackend.attend(ref_store, 0, q, kx, vx, 0.25, track_scores=track, exact_from=exact_from)
    plan = build_decode_plan(store, 0, chunk=2)
    got = emulate_decode(plan, store.arena.arena, q, kx, vx, 0.25, track, exact_from)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    live = ref_store.gather(0).pos >= 0
    torch.testing.assert_close(store.gather(0).score[live], ref_store.gather(0).score[live], rtol=1e-5, atol=1e-6)
    buffers = _decode_buffers(plan, q, vx, track) | {"exact_score": torch.empty(B, H, m)}
    _, merge = decode_args(plan, store.arena.arena, q, kx, vx, 0.25, track, exact_from=exact_from, **buffers)
    named = {p.name: v for p, v in zip(merge.params, merge.values)}
    assert (named["n"], named["m"], named["H"]) == (n, m, H)
    assert named["exact_from"] == (exact_from.data_ptr() if padded else 0)
    assert merge_smem(g, n, m) == 4 * g * n * (2 + m)
