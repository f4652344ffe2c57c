"""CudaBackend: decode attention and cache writes on the compressed page arena with NVRTC-built kernels.

    attend   build_decode_plan (plan.py) -> decode_split (one block per task: <= `chunk` pages of one (sequence, KV
             head), longest first) -> decode_merge (one block per item: partials + exact block, out, fused scores).
    prefill  the torch reference math: prefill runs on the uncompressed K/V of the prompt (compression happens
             when the cache is written), where dense attention is already what torch does well.
    write / write_pages   the cache writes (`writes_cache`): a CompressedStore made with this backend as its
             `writer` does the bookkeeping and hands the bytes to write_tokens / write_channel_keys.

Kernels compile at first use for the device's arch (cubin, cached on disk by `build.py` here). Everything
below `_kernels` needs a GPU; what was run without one is listed in docs/cuda.md.
"""

from __future__ import annotations

import functools

import torch

from kvcal.runtime.backends.base import AttentionBackend
from kvcal.runtime.backends.reference import TorchBackend
from kvcal.runtime.storage.pages import LOW

from . import cuda_status
from .launch import PackedArgs, ceil_div, pack_args
from .plan import (
    DecodePlan,
    WritePlan,
    build_decode_plan,
    build_write_plan,
    desc_table,
    format_limits,
    level_table,
)
from .sources import KERNELS, kernel_signature, kernel_text

THREADS = 128          # decode_attention.cu THREADS and cache_write.cu WARPS * 32
QT = 8                 # decode_attention.cu QT: query rows per pass
WRITE_WARPS = 4        # cache_write.cu WARPS: tokens per write_tokens block
_SMEM_LIMIT = 48 * 1024  # dynamic shared memory without the opt-in attribute


@functools.cache
def signature(kernel: str):
    """Parsed C parameters of a shipped kernel (from its .cu)."""
    file = next(f for f, ks in KERNELS.items() if kernel in ks)
    return kernel_signature(kernel_text(file), kernel)


def split_smem(r: int, t_max: int) -> int:
    """decode_split dynamic shared memory: q tile [QT, r] + probabilities [QT, t_max] floats + pos [t_max] ints."""
    return 4 * (QT * r + QT * t_max + t_max)


def merge_smem(g: int, n: int, m: int) -> int:
    """decode_merge dynamic shared memory: M, 1/L [g * n] and exact-token probabilities [g * n, m] floats."""
    return 4 * g * n * (2 + m)


def decode_args(plan: DecodePlan, arena: torch.Tensor, query: torch.Tensor, exact_keys: torch.Tensor,
                exact_values: torch.Tensor, scale: float, track_scores: bool, *, out: torch.Tensor,
                exact_score: torch.Tensor, logits: torch.Tensor | None, part_m: torch.Tensor, part_l: torch.Tensor,
                part_acc: torch.Tensor, exact_from: torch.Tensor | None = None) -> tuple[PackedArgs, PackedArgs]:
    """Packed arguments of (decode_split, decode_merge); shapes as in the .cu. Pure host code (CPU-testable)."""
    B, H, g, n, r = query.shape
    m, rv = exact_keys.shape[2], exact_values.shape[-1]
    qn = g * n
    flat = arena.view(-1)
    split = pack_args(signature("decode_split"), [
        flat, plan.descs, plan.page_off, plan.page_desc, plan.page_fill, plan.task_item, plan.task_begin,
        plan.task_end, query, logits, part_m, part_l, part_acc, plan.levels, qn, r, rv, plan.t_max, float(scale), H])
    merge = pack_args(signature("decode_merge"), [
        flat, plan.descs, plan.page_off, plan.page_desc, plan.page_fill, plan.item_page_start,
        plan.item_task_start, plan.item_tasks, part_m, part_l, part_acc, logits, query, exact_keys, exact_values,
        exact_from, out, exact_score, g, n, m, H, r, rv, plan.t_max, float(scale), int(track_scores)])
    return split, merge


def write_args(plan: WritePlan, arena: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
               score: torch.Tensor, heads: int, write_keys: bool = True) -> PackedArgs:
    """Packed arguments of write_tokens; keys [n, k_stride], values [n, v_stride] float32, pos int32, score float32;
    heads: the store's KV heads (rows of the level table)."""
    return pack_args(signature("write_tokens"), [
        arena.view(-1), plan.descs, plan.page_off, plan.slot, plan.desc, keys, values, pos, score, plan.levels,
        plan.head, len(plan.slot), keys.shape[-1], values.shape[-1], int(write_keys), heads])


@functools.cache
def _kernels(arch: str) -> dict:
    """GPU ONLY: kernel name -> loaded kernel, compiled for `arch` (disk-cached cubins)."""
    from . import load_module
    from .sources import compile_all

    kernels = {}
    for file, mod in compile_all(arch).items():
        obj = load_module(mod)
        kernels.update({k: obj.get_kernel(k) for k in KERNELS[file]})
    return kernels


def _launch(name: str, grid: int, block: int, args: PackedArgs, shmem: int = 0) -> None:
    from .launch import launch

    if shmem > _SMEM_LIMIT:
        raise ValueError(f"`{name}` needs {shmem} B of shared memory (> {_SMEM_LIMIT}); lower the rank or the "
                         "tokens per page (`page_bytes`)")
    if grid > 0:
        launch(_kernels(cuda_status().arch)[name], grid, block, args, shmem=shmem)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class CudaBackend(AttentionBackend):
    """Fused compressed paged attention on NVIDIA GPUs through cuda-python (see the module docstring)."""

    writes_cache = True

    @classmethod
    def name(cls) -> str:
        return "cuda"

    @classmethod
    def supports(cls, device: torch.device) -> list[str]:
        reasons = []
        status = cuda_status()
        if not status.available:
            reasons.append(status.reason)
        if torch.device(device).type != "cuda":
            reasons.append(f"device `{device}` is not a CUDA device")
        elif not torch.cuda.is_available():
            reasons.append("torch has no CUDA (CPU build of torch)")
        return reasons

    @classmethod
    def supports_formats(cls, formats: tuple, head_dim: int) -> list[str]:
        return [reason for fmt in formats for reason in format_limits(fmt, head_dim)]

    prefill = staticmethod(TorchBackend.prefill)

    @staticmethod
    def attend(store, layer, query, exact_keys, exact_values, scale, track_scores=True, exact_from=None, *,
               chunk: int | None = None):
        """As TorchBackend.attend. query [B, H, g, n, r]; exact_keys [B, H, m, r]; exact_values [B, H, m, rv];
        exact_from int64 [B] or None."""
        dev = query.device
        B, H, g, n, r = query.shape
        m, rv = exact_keys.shape[2], exact_values.shape[-1]
        plan = build_decode_plan(store, layer, chunk=chunk, target_blocks=2 * _sm_count(dev.index or 0))
        query, exact_keys, exact_values = (t.float().contiguous() for t in (query, exact_keys, exact_values))
        if exact_from is not None:
            exact_from = exact_from.to(device=dev, dtype=torch.int64).contiguous()
        qn = g * n
        out = torch.empty(B, H, g, n, rv, device=dev)
        exact_score = torch.empty(B, H, m, device=dev)
        logits = torch.empty(plan.num_pages * plan.t_max * qn, device=dev) if track_scores else None
        part_m = torch.empty(plan.num_tasks * qn, device=dev)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(plan.num_tasks * qn * rv, device=dev)
        split, merge = decode_args(plan, store.arena.arena, query, exact_keys, exact_values, scale, track_scores,
                                   out=out, exact_score=exact_score, logits=logits, part_m=part_m, part_l=part_l,
                                   part_acc=part_acc, exact_from=exact_from)
        _launch("decode_split", plan.num_tasks, THREADS, split, split_smem(r, plan.t_max))
        _launch("decode_merge", B * H, THREADS, merge, merge_smem(g, n, m))
        return out, exact_score

    # ------------------------------------------------------------------------------------------------- writes

    @staticmethod
    def write(store, layer, side, b, h, slot, keys, values, pos, score) -> None:
        """As CompressedStore.write (per-token formats; pages must exist)."""
        if len(b) == 0:
            return
        plan = build_write_plan(store, layer, side, b, h, slot)
        keys, values = keys.float().contiguous(), values.float().contiguous()
        args = write_args(plan, store.arena.arena, keys, values, pos.to(torch.int32).contiguous(),
                          score.float().contiguous(), store.num_kv_heads)
        _launch("write_tokens", ceil_div(len(b), WRITE_WARPS), WRITE_WARPS * 32, args)

    @staticmethod
    def write_pages(store, layer, b, h, keys, values, pos, score) -> None:
        """As CompressedStore.write_pages: one whole new per-channel low page per entry (b, h) [n];
        keys [n, T, >= r_k]; values [n, T, >= r_v]; pos, score [n, T]."""
        descs, levels, H = desc_table(store, layer), level_table(store, layer), store.num_kv_heads
        for g, sel in store.group_rows(layer, h):
            gi = store.groups[layer].index(g)
            lay = g.layouts[LOW]
            bs, hs, T = b[sel], h[sel], lay.tokens
            base = store.reserve_low_page(layer, bs, hs, lay)
            k = keys[sel].float().contiguous()                             # [m, T, k_stride]
            assert k.shape[1] == T, f"keys hold {k.shape[1]} tokens per page, the group's low pages hold {T}"
            rows = torch.full((len(bs),), 2 * gi + LOW, dtype=torch.int32, device=store.device)
            hs32 = hs.to(torch.int32).contiguous()
            args = pack_args(signature("write_channel_keys"), [store.arena.arena.view(-1), descs, base, rows, k,
                                                               levels, hs32, len(bs), k.shape[-1], H])
            _launch("write_channel_keys", len(bs), 128, args)
            slot = torch.arange(T, device=store.device).repeat(len(bs))
            plan = WritePlan(descs, base.repeat_interleave(T), slot.to(torch.int32), rows.repeat_interleave(T),
                             hs32.repeat_interleave(T), levels)
            args = write_args(plan, store.arena.arena, k.reshape(len(bs) * T, -1),
                              values[sel].float().reshape(len(bs) * T, -1).contiguous(),
                              pos[sel].reshape(-1).to(torch.int32).contiguous(),
                              score[sel].reshape(-1).float().contiguous(), H, write_keys=False)
            _launch("write_tokens", ceil_div(len(bs) * T, WRITE_WARPS), WRITE_WARPS * 32, args)
