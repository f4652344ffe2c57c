"""CPU emulation of decode_attention.cu and cache_write.cu from the same plans and raw arena bytes.

This is how the plan, the descriptor offsets and the split-K / merge arithmetic are checked without a GPU: the
emulator reads pages only through the descriptor table and the plan (never through PageLayout or the store), runs
the split pass task by task with the kernel's online-softmax recurrences (m, l, acc with the same -inf guards),
merges the partials with the exact block as decode_merge does, and adds the fused score deltas into the arena. Tests
compare it with TorchBackend.attend. It mirrors the kernels' arithmetic, not their thread mapping, and it does not
execute the CUDA C++: the .cu files are only compiled on machines without a GPU.
"""

from __future__ import annotations

import torch

from kvcal.runtime.backends.base import exact_visible
from kvcal.runtime.storage import quant
from kvcal.runtime.storage.pages import LOW

from .backend import CudaBackend
from .plan import (
    DecodePlan,
    WritePlan,
    build_decode_plan,
    build_write_plan,
    desc_fields,
    desc_table,
    level_table,
)

_NEG_INF = float("-inf")


def _desc(descs: torch.Tensor, row: int) -> dict[str, int]:
    return dict(zip(desc_fields(), descs[row].tolist()))


def _level_row(levels: torch.Tensor | None, D: dict, h: int, which: str) -> torch.Tensor | None:
    """KV head h's levels [LEVEL_ROW] of side `which` of a descriptor row, None for a uniform side (page_desc.cuh
    `level_row`)."""
    if not D[f"{which}_levels"]:
        return None
    return levels[D["side"], h, "kv".index(which), :1 << D[f"{which}_bits"]]


def _vectors(page: torch.Tensor, D: dict, which: str, fill: int, lut: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token vectors float32 [fill, r] of segment `which` ("k" or "v") of one page (uint8 [page_bytes]); lut: the
    head's levels of that side (`_level_row`)."""
    r, bits, nbytes = D[f"r_{which}"], D[f"{which}_bits"], D[f"{which}_bytes"]
    raw = page[D[f"{which}_off"]:D[f"{which}_off"] + fill * nbytes].reshape(fill, nbytes)
    if bits >= 16:
        dtype = torch.float32 if bits == 32 else (torch.bfloat16 if D["raw_bf16"] else torch.float16)
        return raw.contiguous().view(dtype).float()
    codes = quant.unpack(raw.contiguous(), bits, r)                                        # [fill, r]
    pair, meta_bits = _meta_format(D)
    if which == "k" and D["k_channel"]:
        meta = page[D["k_meta_off"]:D["k_meta_off"] + pair * r].contiguous()
        return quant.dequantize_per_channel(codes, *quant.meta_from_bytes(meta, meta_bits, bits, (r,)), levels=lut)
    groups, group = D[f"{which}_groups"], D[f"{which}_group"]
    off = D[f"{which}_meta_off"]
    scale, zero = quant.meta_from_bytes(page[off:off + pair * groups * fill].contiguous(), meta_bits, bits,
                                        (fill, groups))
    return quant.dequantize_per_token(codes, scale, zero, group if groups > 1 else None, levels=lut)


def _meta_format(D: dict) -> tuple[int, int]:
    """(bytes per (scale, zero) pair, meta bits) of a descriptor row."""
    return (2, 8) if D["meta8"] else (4, 16)


def _i32(page: torch.Tensor, off: int, n: int) -> torch.Tensor:
    return page[off:off + 4 * n].contiguous().view(torch.int32)


def _valid(page: torch.Tensor, D: dict, fill: int) -> torch.Tensor:
    """bool [fill]: which slots below the fill hold a token (an untracked tier has no holes)."""
    return _i32(page, D["pos_off"], fill) >= 0 if D["pos_off"] >= 0 else torch.ones(fill, dtype=torch.bool)


def _exp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """exp(a - b), 0 where a = -inf (also when b = -inf: the kernels' guard)."""
    return torch.where(a == _NEG_INF, 0.0, torch.exp(a - torch.where(b == _NEG_INF, 0.0, b)))


def emulate_decode(plan: DecodePlan, arena: torch.Tensor, query: torch.Tensor, exact_keys: torch.Tensor,
                   exact_values: torch.Tensor, scale: float, track_scores: bool = True,
                   exact_from: torch.Tensor | None = None):
    """decode_split + decode_merge on the CPU. arena uint8 [num_pages, page_bytes] (scores updated in place);
    query [B, H, g, n, r]; exact_keys [B, H, m, r]; exact_values [B, H, m, rv]; exact_from int64 [B] or None.
    Returns out [B, H, g, n, rv] and exact_score [B, H, m], as TorchBackend.attend."""
    B, H, g, n, r = query.shape
    m_exact, rv = exact_keys.shape[2], exact_values.shape[-1]
    W, qn = B * H, g * n
    flat = arena.view(-1)
    q = query.reshape(W, qn, r).float() * scale                                           # pre-scaled rows
    logits = torch.full((plan.num_pages, plan.t_max, qn), _NEG_INF)
    part_m = torch.full((plan.num_tasks, qn), _NEG_INF)
    part_l = torch.zeros(plan.num_tasks, qn)
    part_acc = torch.zeros(plan.num_tasks, qn, rv)

    def page_of(p: int):
        D = _desc(plan.descs, int(plan.page_desc[p]))
        off = int(plan.page_off[p])
        return D, flat[off:off + D["end"]], int(plan.page_fill[p])

    # ---- decode_split: one task = online softmax over its pages
    for task in range(plan.num_tasks):
        item = int(plan.task_item[task])
        m, l, acc = torch.full((qn,), _NEG_INF), torch.zeros(qn), torch.zeros(qn, rv)
        for p in range(int(plan.task_begin[task]), int(plan.task_end[task])):
            D, page, fill = page_of(p)
            valid = _valid(page, D, fill)                                                  # [fill]
            k = _vectors(page, D, "k", fill, _level_row(plan.levels, D, item % H, "k"))   # [fill, r_k]
            x = (q[item, :, :D["r_k"]] @ k.T).masked_fill(~valid, _NEG_INF)               # [qn, fill]
            logits[p, :fill] = x.T
            m_new = torch.maximum(m, x.amax(1) if fill else m)
            alpha = torch.where(m_new == _NEG_INF, 1.0, _exp_diff(m, m_new))
            e = _exp_diff(x, m_new[:, None])
            l = l * alpha + e.sum(1)
            v = _vectors(page, D, "v", fill, _level_row(plan.levels, D, item % H, "v"))
            v = torch.where(valid[:, None], v, 0.0)                                        # holes may hold NaN
            acc = acc * alpha[:, None]
            acc[:, :D["r_v"]] += e @ v
            m = m_new
        part_m[task], part_l[task], part_acc[task] = m, l, acc

    # ---- decode_merge: partials + the exact block, then the fused score update
    out = torch.zeros(W, qn, rv)
    exact_score = torch.zeros(W, m_exact)
    visible = exact_visible(B, n, m_exact, exact_from, "cpu")                             # [B, ni, i]
    kn, vn = exact_keys.reshape(W, m_exact, r).float(), exact_values.reshape(W, m_exact, rv).float()
    for item in range(W):
        tasks = plan.item_tasks[int(plan.item_task_start[item]):int(plan.item_task_start[item + 1])].long()
        x_new = (q[item] @ kn[item].T).view(g, n, m_exact).masked_fill(~visible[item // H], _NEG_INF)
        x_new = x_new.view(qn, m_exact)
        M = torch.maximum(part_m[tasks].amax(0) if len(tasks) else torch.full((qn,), _NEG_INF), x_new.amax(1))
        w = _exp_diff(part_m[tasks], M)                                                    # [s, qn]
        e_new = _exp_diff(x_new, M[:, None])
        Linv = 1.0 / ((part_l[tasks] * w).sum(0) + e_new.sum(1))
        p_new = e_new * Linv[:, None]                                                      # [qn, m]
        out[item] = (part_acc[tasks] * w[..., None]).sum(0) * Linv[:, None] + p_new @ vn[item]
        if not track_scores:
            continue
        exact_score[item] = p_new.view(g, n, m_exact).amax(0).sum(0)
        for p in range(int(plan.item_page_start[item]), int(plan.item_page_start[item + 1])):
            D, page, fill = page_of(p)
            if D["score_off"] < 0:                                                         # untracked: no scores
                continue
            valid = _valid(page, D, fill)
            prob = torch.exp(logits[p, :fill] - M) * Linv                                 # [fill, qn]
            delta = prob.view(fill, g, n).amax(1).sum(1)
            score = page[D["score_off"]:D["score_off"] + 4 * fill].view(torch.float32)    # a view into the arena
            score += torch.where(valid, delta, 0.0)
    return out.view(B, H, g, n, rv), exact_score.view(B, H, m_exact)


def emulate_write(plan: WritePlan, arena: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                  score: torch.Tensor, write_keys: bool = True) -> None:
    """write_tokens on the CPU, token by token through the descriptor table: keys [n, >= r_k], values [n, >= r_v],
    pos, score [n]. Quantization is storage.quant's, so this checks where the bytes go, not the rounding."""
    flat = arena.view(-1)
    for i in range(len(plan.slot)):
        D = _desc(plan.descs, int(plan.desc[i]))
        page = flat[int(plan.page_off[i]):int(plan.page_off[i]) + D["end"]]
        t = int(plan.slot[i])
        for which, x in (("k", keys[i]), ("v", values[i])):
            if which == "k" and (not write_keys or D["k_channel"]):
                continue
            r, bits, nbytes = D[f"r_{which}"], D[f"{which}_bits"], D[f"{which}_bytes"]
            x = x[:r].float()
            if bits >= 16:
                dtype = torch.float32 if bits == 32 else (torch.bfloat16 if D["raw_bf16"] else torch.float16)
                data = x.to(dtype).view(torch.uint8)
            else:
                groups = D[f"{which}_groups"]
                pair, meta_bits = _meta_format(D)
                codes, s, z = quant.quantize_per_token(x, bits, D[f"{which}_group"] if groups > 1 else None,
                                                       meta_bits, _level_row(plan.levels, D, int(plan.head[i]), which))
                data = quant.pack(codes, bits)
                off = D[f"{which}_meta_off"] + pair * groups * t
                page[off:off + pair * groups] = quant.meta_to_bytes(s, z)
            off = D[f"{which}_off"] + t * nbytes
            page[off:off + nbytes] = data
        if D["pos_off"] >= 0:                                                              # tracked tiers only
            page[D["score_off"] + 4 * t:D["score_off"] + 4 * t + 4] = score[i:i + 1].float().view(torch.uint8)
            page[D["pos_off"] + 4 * t:D["pos_off"] + 4 * t + 4] = pos[i:i + 1].to(torch.int32).view(torch.uint8)


def emulate_channel_keys(descs: torch.Tensor, arena: torch.Tensor, base: torch.Tensor, rows: torch.Tensor,
                         keys: torch.Tensor, heads: torch.Tensor, levels: torch.Tensor | None) -> None:
    """write_channel_keys on the CPU: per-channel key codes and (scale, zero) of one whole low page per entry.
    base int64 [n] page byte offsets; rows [n] descriptor rows; keys float32 [n, T, >= r_k]; heads [n] KV heads;
    levels: the level table (`plan.level_table`) or None."""
    flat = arena.view(-1)
    for i in range(len(base)):
        D = _desc(descs, int(rows[i]))
        r, bits, T = D["r_k"], D["k_bits"], D["tokens"]
        pair, meta_bits = _meta_format(D)
        lut = _level_row(levels, D, int(heads[i]), "k")
        codes, s, z = quant.quantize_per_channel(keys[i, :T, :r].float()[None], bits, meta_bits=meta_bits,
                                                 levels=lut)                                          # [1, T, r]
        page = flat[int(base[i]):int(base[i]) + D["end"]]
        data = quant.pack(codes[0], bits).reshape(-1)
        page[D["k_off"]:D["k_off"] + len(data)] = data
        page[D["k_meta_off"]:D["k_meta_off"] + pair * r] = quant.meta_to_bytes(s[0], z[0])


class EmulatedCudaBackend(CudaBackend):
    """CudaBackend with each kernel replaced by its CPU emulation above: the same plans, descriptor tables, format
    limits and store bookkeeping, run on the CPU. It lets the whole serving path of the CUDA backend (CompressedKV,
    token policies, page writes) run and be compared with TorchBackend where no GPU exists. Not chosen by `auto`."""

    @classmethod
    def name(cls) -> str:
        return "cuda-emulated"

    @classmethod
    def supports(cls, device: torch.device) -> list[str]:
        return [] if torch.device(device).type == "cpu" else [f"the emulation runs on the CPU, not `{device}`"]

    @staticmethod
    def attend(store, layer, query, exact_keys, exact_values, scale, track_scores=True, exact_from=None, *,
               chunk: int | None = None):
        plan = build_decode_plan(store, layer, chunk=chunk)
        return emulate_decode(plan, store.arena.arena, query, exact_keys, exact_values, scale, track_scores,
                              exact_from)

    @staticmethod
    def write(store, layer, side, b, h, slot, keys, values, pos, score) -> None:
        if len(b):
            emulate_write(build_write_plan(store, layer, side, b, h, slot), store.arena.arena, keys, values, pos,
                          score)

    @staticmethod
    def write_pages(store, layer, b, h, keys, values, pos, score) -> None:
        descs, levels = desc_table(store, layer), level_table(store, layer)
        for g, sel in store.group_rows(layer, h):
            gi = store.groups[layer].index(g)
            lay = g.layouts[LOW]
            bs, hs, T = b[sel], h[sel], lay.tokens
            base = store.reserve_low_page(layer, bs, hs, lay)
            rows = torch.full((len(bs),), 2 * gi + LOW, dtype=torch.int64)
            emulate_channel_keys(descs, store.arena.arena, base, rows, keys[sel], hs, levels)
            slot = torch.arange(T).repeat(len(bs))
            plan = WritePlan(descs, base.repeat_interleave(T), slot.to(torch.int32), rows.repeat_interleave(T),
                             hs.repeat_interleave(T), levels)
            emulate_write(plan, store.arena.arena, keys[sel].reshape(len(bs) * T, -1),
                          values[sel].reshape(len(bs) * T, -1), pos[sel].reshape(-1), score[sel].reshape(-1),
                          write_keys=False)
