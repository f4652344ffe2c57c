"""Launch plans for the CUDA kernels, built from a CompressedStore with plain torch ops (CPU-testable).

Everything the kernels need to find a byte comes from here: the descriptor table (one row per page layout, from
storage.layout.PageLayout, in the field order of `struct PageDesc` parsed from kernels/page_desc.cuh) and the
per-page / per-token byte offsets read from the store's page tables. The .cu files hard-code no layout.

Decode plan (W = B * H items, item = b * H + h; P plan pages; NT tasks):

    page_off        int64 [P]     byte offset of each page; an item's pages are contiguous, high pages then low
    page_desc       int32 [P]     descriptor row (group, side) of the page
    page_fill       int32 [P]     slots written in the page (the last page of a section may be partial)
    item_page_start int32 [W + 1]
    task_item, task_begin, task_end  int32 [NT]   a task = up to `chunk` consecutive pages of one item (split-K)
    item_task_start int32 [W + 1], item_tasks int32 [NT]   the tasks of each item, for the merge

Tasks are sorted by token count, longest first (FDC's greedy longest-task-first assignment: the GPU issues blocks
in index order, so long tasks start first and short ones fill in behind them). `chunk` defaults to
ceil(total pages / target_blocks), which cuts long items into roughly equal tasks once there are fewer items than
SMs to fill (flash-decoding), and leaves one task per item otherwise.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from functools import cache

import torch

from kvcal.runtime.storage.layout import PageLayout
from kvcal.runtime.storage.levels import kernel_table
from kvcal.runtime.storage.pages import HIGH, LOW

MAX_GROUPS = 32       # per-token (scale, zero) groups per vector (cache_write.cu MAX_GROUPS)
MAX_RANK = 256        # stored rank per head (decode_attention.cu THREADS * DIMS_PER_THREAD, cache_write.cu MAX_RANK)


def format_limits(fmt, rank: int) -> list[str]:
    """Reasons the kernels cannot serve tier format `fmt` (a TierFormat) at stored ranks up to `rank`."""
    reasons = []
    if fmt.k_mode == "static":       # PageDesc has no field for them, so the emulation cannot serve them either
        reasons.append(f"{fmt.name}: the CUDA kernels read per-token or per-page key scales, not static calibrated "
                       "ones")
    if rank > MAX_RANK:
        reasons.append(f"stored rank {rank} exceeds the CUDA kernels' limit of {MAX_RANK}")
    # (bits, channels per group, whether the group gives per-token (scale, zero) pairs); per-channel keys have none
    for bits, group, per_token in ((fmt.k_bits, fmt.k_group, fmt.k_mode == "token"), (fmt.v_bits, fmt.v_group, True)):
        if bits >= 16 or group is None:
            continue
        if per_token and -(-rank // group) > MAX_GROUPS:
            reasons.append(f"{fmt.name} has more than {MAX_GROUPS} quantization groups per vector; use a larger "
                           "group")
    return reasons


@cache
def desc_fields() -> tuple[str, ...]:
    """Field names of `struct PageDesc` in kernels/page_desc.cuh, in declaration order (all C `int`)."""
    from .build import kernel_source

    body = re.search(r"struct PageDesc\s*\{(.*?)\};", kernel_source("page_desc.cuh"), re.S)
    assert body is not None, "page_desc.cuh lost its `struct PageDesc`"
    return tuple(re.findall(r"^\s*int\s+(\w+)\s*;", body.group(1), re.M))


def _desc_values(lay: PageLayout, raw_bf16: bool, side: int) -> dict[str, int]:
    """One PageDesc row: PageLayout's own fields plus the few the kernels derive nothing from."""
    fmt = lay.fmt
    return dict(tokens=lay.tokens, r_k=lay.r_k, r_v=lay.r_v, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
                k_channel=int(fmt.k_mode == "channel"),
                k_group=max(1, lay.r_k // max(1, lay.k_groups)), v_group=max(1, lay.r_v // max(1, lay.v_groups)),
                k_bytes=lay.k_bytes, v_bytes=lay.v_bytes, k_groups=lay.k_groups, v_groups=lay.v_groups,
                k_off=lay.k_off, k_meta_off=lay.k_meta_off, v_off=lay.v_off, v_meta_off=lay.v_meta_off,
                score_off=lay.score_off, pos_off=lay.pos_off, end=lay.end, raw_bf16=int(raw_bf16),
                meta8=int(fmt.meta_bits == 8), side=side, k_levels=int(fmt.k_levels == "calibrated"),
                v_levels=int(fmt.v_levels == "calibrated"))


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _per_store(store, key: tuple, make):
    """`make()` once per store and key: a store's layouts, formats and levels never change after it is made, so its
    tables are built (and copied to its device) once, not on every decode step and write."""
    tables = _TABLES.setdefault(store, {})
    if key not in tables:
        tables[key] = make()
    return tables[key]


def desc_table(store, layer: int) -> torch.Tensor:
    """int32 [2 * groups, len(desc_fields())]: row 2 * group + side describes that group's pages on that side (built
    once per store and layer)."""
    return _per_store(store, ("descs", layer), lambda: _desc_table(store, layer))


def _desc_table(store, layer: int) -> torch.Tensor:
    fields = desc_fields()
    rows = []
    for g in store.groups[layer]:
        for side in (HIGH, LOW):
            lay = g.layouts[side]
            reasons = format_limits(lay.fmt, max(g.r_k, g.r_v))
            if reasons:
                raise ValueError(reasons[0])
            values = _desc_values(lay, store.raw16 == torch.bfloat16, side)
            rows.append([values[f] for f in fields])
    return torch.tensor(rows, dtype=torch.int32, device=store.device)


def level_table(store, layer: int) -> torch.Tensor | None:
    """The layer's calibrated levels as the kernels read them (`levels.kernel_table`: float32 [2, H, 2, 256] on the
    store's device), None when every side is uniform; built once per store and layer."""
    return _per_store(store, ("levels", layer), lambda: kernel_table(store, layer))


def _head_group(store, layer: int) -> torch.Tensor:
    """int64 [H]: group index of each KV head."""
    out = torch.empty(store.num_kv_heads, dtype=torch.int64, device=store.device)
    for gi, g in enumerate(store.groups[layer]):
        out[g.heads] = gi
    return out


def _cumsum0(x: torch.Tensor) -> torch.Tensor:
    """[n] -> int64 [n + 1] = (0, x0, x0 + x1, ...)"""
    return torch.cat([x.new_zeros(1, dtype=torch.int64), torch.cumsum(x.to(torch.int64), 0)])


@dataclass
class DecodePlan:
    """Launch plan of decode_split / decode_merge for one layer; see the module docstring for the fields."""

    descs: torch.Tensor
    page_off: torch.Tensor
    page_desc: torch.Tensor
    page_fill: torch.Tensor
    item_page_start: torch.Tensor
    task_item: torch.Tensor
    task_begin: torch.Tensor
    task_end: torch.Tensor
    item_task_start: torch.Tensor
    item_tasks: torch.Tensor
    t_max: int            # most tokens per page over the descriptors (rows of the logits scratch per page)
    chunk: int            # pages per task
    levels: torch.Tensor | None = None   # `level_table`

    @property
    def num_pages(self) -> int:
        return self.page_off.numel()

    @property
    def num_tasks(self) -> int:
        return self.task_item.numel()


def _section_pages(store, layer: int, side: int):
    """Dense [W, P] page ids (-1 padded), descriptor rows and slot counts of one side for every item."""
    B, H = store.batch, store.num_kv_heads
    dev = store.device
    parts = []
    for gi, g in enumerate(store.groups[layer]):
        b, h = store.entries(layer, g)
        pages = store.section_pages(layer, side, b, h)                                            # [n, P_g]
        T = g.layouts[side].tokens
        fill = store.fill[layer, b, h, side]                                               # [n]
        slots = (fill[:, None] - torch.arange(pages.shape[1], device=dev) * T).clamp(0, T)  # [n, P_g]
        parts.append((b * H + h, pages, slots, 2 * gi + side))
    width = max((p[1].shape[1] for p in parts), default=0)
    ids = torch.full((B * H, width), -1, dtype=torch.int64, device=dev)
    desc = torch.zeros(B * H, width, dtype=torch.int64, device=dev)
    fill = torch.zeros(B * H, width, dtype=torch.int64, device=dev)
    for item, pages, slots, row in parts:
        P = pages.shape[1]
        ids[item, :P], fill[item, :P], desc[item, :P] = pages, slots, row
    return ids, desc, fill


def build_decode_plan(store, layer: int, *, chunk: int | None = None, target_blocks: int = 264) -> DecodePlan:
    """The decode plan of `layer` as the store holds it now. `chunk` = pages per task (None: split so that about
    `target_blocks` tasks cover the layer, e.g. 2 per SM)."""
    parts = [_section_pages(store, layer, side) for side in (HIGH, LOW)]
    ids, desc, fill = (torch.cat([p[i] for p in parts], dim=1) for i in range(3))          # [W, P_high + P_low]
    keep = (ids >= 0) & (fill > 0)                     # row-major order: item by item, high pages then low
    counts = keep.sum(1)                                                                   # [W]
    item_page_start = _cumsum0(counts)
    total = int(item_page_start[-1])
    if chunk is None:
        chunk = max(1, -(-total // max(1, target_blocks)))
    if chunk < 1:
        raise ValueError(f"`chunk` must be >= 1 page, got {chunk}")

    n_tasks = -(-counts // chunk)                                                          # [W]
    item_task_start = _cumsum0(n_tasks)
    NT = int(item_task_start[-1])
    W = counts.numel()
    task_item = torch.repeat_interleave(torch.arange(W, device=store.device), n_tasks, output_size=NT)
    k = torch.arange(NT, device=store.device) - item_task_start[task_item]
    begin = item_page_start[task_item] + k * chunk
    end = torch.minimum(begin + chunk, item_page_start[task_item + 1])
    page_fill = fill[keep]
    cum = _cumsum0(page_fill)
    cost = cum[end] - cum[begin]                                                           # tokens per task
    order = torch.argsort(cost, descending=True, stable=True)                              # longest first
    rank = torch.empty_like(order)
    rank[order] = torch.arange(NT, device=store.device)                                    # task -> launch slot

    descs = desc_table(store, layer)
    i32 = lambda t: t.to(torch.int32).contiguous()                                         # noqa: E731
    return DecodePlan(
        descs=descs, page_off=(ids[keep] * store.page_bytes).contiguous(), page_desc=i32(desc[keep]),
        page_fill=i32(page_fill), item_page_start=i32(item_page_start), task_item=i32(task_item[order]),
        task_begin=i32(begin[order]), task_end=i32(end[order]), item_task_start=i32(item_task_start),
        item_tasks=i32(rank), t_max=max(g.layouts[s].tokens for g in store.groups[layer] for s in (HIGH, LOW)),
        chunk=chunk, levels=level_table(store, layer))


@dataclass
class WritePlan:
    """Where write_tokens puts each token: page byte offset int64 [n], slot in the page int32 [n], descriptor row
    int32 [n], KV head int32 [n] (its level rows), the descriptor table and the level table (`level_table`)."""

    descs: torch.Tensor
    page_off: torch.Tensor
    slot: torch.Tensor
    desc: torch.Tensor
    head: torch.Tensor
    levels: torch.Tensor | None = None


def build_write_plan(store, layer: int, side: int, b: torch.Tensor, h: torch.Tensor,
                     slot: torch.Tensor) -> WritePlan:
    """Targets of tokens (b, h, section slot) [n] on `side`; their pages must exist (as for `store.write`)."""
    n = len(b)
    page_off = torch.zeros(n, dtype=torch.int64, device=store.device)
    in_page = torch.zeros(n, dtype=torch.int64, device=store.device)
    gi = _head_group(store, layer)[h]
    for i, g in enumerate(store.groups[layer]):
        sel = gi == i
        if bool(sel.any()):
            page_off[sel], in_page[sel] = store.page_of(layer, side, b[sel], h[sel], slot[sel], g.layouts[side])
    return WritePlan(desc_table(store, layer), page_off, in_page.to(torch.int32), (2 * gi + side).to(torch.int32),
                     h.to(torch.int32).contiguous(), level_table(store, layer))
