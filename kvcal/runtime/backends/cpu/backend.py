"""CpuBackend: fused decode attention and token writes on the compressed page arena, for CPUs.

    attend   one call per layer into csrc/paged_attention.cpp `kvcal_decode`: it walks the layer's page tables
             itself, dequantizes a page at a time into a small buffer (no dequantized K/V of the layer ever exists),
             runs an online softmax split over page chunks (OpenMP threads), merges the chunks with the exact block,
             and adds each stored token's probability to its score in the page in the same call.
    write    `kvcal_write`: quantize + pack + write the new tokens (per-token formats), bit for bit what
             CompressedStore.write writes (`writes_cache`: a store made with this backend hands it its writes).
    insert   `kvcal_insert_every`: the decode step's new tokens, one per entry: each entry's first hole where it has
             one (tiers moved tokens out of the high pages), else its end (fill += 1), found and written in one call
             instead of a dozen torch ops per layer; the entries that need a new page are named, not guessed.
    prefill  `kvcal_prefill`: attention and significance in one pass over the scores, a few query rows at a time
             (each logit computed and exponentiated once, no [n, n] block in memory); prompts with padding take the
             torch reference.
    sliding  `kvcal_sliding_decode`: a sliding-window layer's decode step, read from its codes in place.
    pages    `kvcal_write_pages`: per-channel low pages, a whole page per entry (keys quantized per channel over the
             page's tokens), as the torch writer writes them.
    seal     `kvcal_seal_low_pages`: such a page made of high tokens, read as the torch store reads them, and their
             high slots emptied; `kvcal_compact_high` then closes those holes (`Scores.seal_low_pages`).

The library is compiled at first use (`build.py` here); where it cannot be built, `supports` says why and
`select_backend("auto")` falls back to the torch reference. TorchBackend stays the oracle: tests compare the two.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
import torch.nn.functional as F

from kvcal.runtime.backends.base import AttentionBackend
from kvcal.runtime.backends.reference import TorchBackend
from kvcal.runtime.storage.levels import kernel_table
from kvcal.runtime.storage.pages import LOW

from .build import CpuBuildError, load_library

# struct Desc in csrc/paged_attention.cpp, in declaration order (all int32)
DESC_FIELDS = ("tokens", "r_k", "r_v", "k_bits", "v_bits", "k_channel", "k_group", "v_group", "k_bytes", "v_bytes",
               "k_groups", "v_groups", "k_off", "k_meta_off", "v_off", "v_meta_off", "score_off", "pos_off",
               "raw_bf16", "meta8", "k_levels", "v_levels")
GRAIN = 1 << 17       # multiply-adds per thread below which a layer's decode uses fewer threads
# relative widening of the thresholds in `low_pages_due`, far above the ulp or two by which its float order differs
# from the torch policy's, so the kernel never reports no page due where the policy would seal one
DUE_SLACK = 1e-5
MAX_RANK = 512        # per-channel key scales live in a stack buffer of this many channels (paged_attention.cpp)

_FP16_MAX = 65504.0


def fused_prefill(query, keys, values, mask, scale, lib: ctypes.CDLL | None = None):
    """As TorchBackend.prefill: query [B, H, g, n, d], keys [B, H, n, d], values [B, H, n, r_v], mask bool [B, n, n]
    -> out [B, H, g, n, r_v], score [B, H, n] (each key's probability summed over queries, max over the group).

    `kvcal_prefill` computes each logit once and uses its probability for both the output and the significance. The
    same sums as the reference up to float order: each row's softmax over its keys in one block (its max, then the
    sum of the kernel's exp, within 2 ulp of std::exp; relative error ~1e-6). Prompts with padding (a masked key
    column the causal rule alone would allow) take the reference. `lib`: the kernels to call (default `load_library()`;
    tests pass variants built apart)."""
    B, H, g, n, d = query.shape
    if not bool(mask[:, -1].all()):
        return TorchBackend.prefill(query, keys, values, mask, scale)
    r_v = values.shape[-1]
    r_pad = -(-r_v // 16) * 16                  # the kernel's value rows: whole vectors of 16 floats
    q32, k32 = query.float().contiguous(), keys.float().contiguous()
    v32 = F.pad(values.float(), (0, r_pad - r_v)).contiguous()
    out = torch.empty(B, H, g, n, r_pad, device=query.device)
    score = torch.empty(B, H, n, device=query.device)
    rc = (lib or load_library()).kvcal_prefill(_ptr(q32), _ptr(k32), _ptr(v32), _ptr(out), _ptr(score), B, H, g, n,
                                               d, r_pad, scale, torch.get_num_threads())
    assert rc == 0, "value rows not padded to whole vectors of 16 floats"
    return (out if r_pad == r_v else out[..., :r_v].contiguous()), score


def _desc_row(lay, raw_bf16: bool) -> list[int]:
    fmt = lay.fmt
    values = dict(tokens=lay.tokens, r_k=lay.r_k, r_v=lay.r_v, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
                  k_channel=int(fmt.k_mode == "channel"), k_group=max(1, lay.r_k // max(1, lay.k_groups)),
                  v_group=max(1, lay.r_v // max(1, lay.v_groups)), k_bytes=lay.k_bytes, v_bytes=lay.v_bytes,
                  k_groups=lay.k_groups, v_groups=lay.v_groups, k_off=lay.k_off, k_meta_off=lay.k_meta_off,
                  v_off=lay.v_off, v_meta_off=lay.v_meta_off, score_off=lay.score_off, pos_off=lay.pos_off,
                  raw_bf16=int(raw_bf16), meta8=int(fmt.meta_bits == 8),
                  k_levels=int(fmt.k_levels == "calibrated"), v_levels=int(fmt.v_levels == "calibrated"))
    return [values[f] for f in DESC_FIELDS]


class _LayerTables:
    """Per layer, what never changes for a store: descriptor rows int32 [2 * groups, len(DESC_FIELDS)] (row
    2 * group + side), each KV head's group int32 [H] and the level table (`levels.kernel_table`, None if uniform)."""

    def __init__(self, store):
        self.descs, self.head_group, self.levels = {}, {}, {}
        for layer, groups in store.groups.items():
            rows = []
            head_group = torch.empty(store.num_kv_heads, dtype=torch.int32)
            for gi, g in enumerate(groups):
                if max(g.r_k, g.r_v) > MAX_RANK:
                    raise ValueError(f"stored rank ({g.r_k}, {g.r_v}) exceeds the CPU kernels' limit of {MAX_RANK}; "
                                     "use backend `torch`")
                head_group[g.heads.cpu()] = gi
                rows += [_desc_row(g.layouts[side], store.raw16 == torch.bfloat16) for side in (0, 1)]
            self.descs[layer] = torch.tensor(rows, dtype=torch.int32)
            self.head_group[layer] = head_group
            self.levels[layer] = kernel_table(store, layer)


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tables(store) -> _LayerTables:
    tables = _TABLES.get(store)
    if tables is None:
        tables = _TABLES[store] = _LayerTables(store)
    return tables


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _levels_ptr(store, layer: int) -> int | None:
    """The layer's level table for the kernels (NULL when every side is uniform)."""
    return _ptr(_tables(store).levels[layer])


def _layer_args(store, layer: int) -> tuple:
    """The kernels' common leading arguments: arena, descriptors, page table, fill, head groups, L, B, H, P, layer,
    page bytes. The arena and page table are read fresh: growing them replaces the tensors."""
    arena = store.arena
    table, fill = arena.page_table, store.fill
    assert arena.arena.is_contiguous() and table.is_contiguous() and fill.is_contiguous()
    t = _tables(store)
    B, L, H, P = table.shape                                                # [slots, layers, kv_heads, P]
    return (_ptr(arena.arena), _ptr(t.descs[layer]), _ptr(table), _ptr(fill), _ptr(t.head_group[layer]), L, B, H, P,
            layer, store.page_bytes)


def _check_write(rc: int, bad: ctypes.c_float) -> None:
    """kvcal_write's return code as the torch writer's errors (quant._check_values)."""
    if rc == 1:
        raise ValueError("x must be finite, got NaN or inf")
    if rc == 2:
        raise ValueError(f"x has max abs value {bad.value:g}, beyond the float16 range (max {_FP16_MAX:g}) of "
                         "scale/zero")
    assert rc == 0, "slot without a page"


class CpuBackend(AttentionBackend):
    """Fused compressed paged attention on CPUs through a small C++/OpenMP library (see the module docstring)."""

    writes_cache = True

    @classmethod
    def name(cls) -> str:
        return "cpu"

    @classmethod
    def supports(cls, device: torch.device) -> list[str]:
        if torch.device(device).type != "cpu":
            return [f"device `{device}` is not the CPU"]
        try:
            load_library()
        except CpuBuildError as e:
            return [str(e)]
        return []

    @classmethod
    def supports_formats(cls, formats: tuple, head_dim: int) -> list[str]:
        reasons = [f"{fmt.name}: the CPU kernels read per-token or per-page key scales, not static calibrated ones"
                   for fmt in formats if fmt.k_mode == "static"]
        if head_dim > MAX_RANK:
            reasons.append(f"head dim {head_dim} exceeds the CPU kernels' limit of {MAX_RANK} stored dims")
        return reasons

    prefill = staticmethod(fused_prefill)

    @staticmethod
    def attend(store, layer, query, exact_keys, exact_values, scale, track_scores=True, exact_from=None):
        """As TorchBackend.attend. query [B, H, g, n, r]; exact_keys [B, H, m, r]; exact_values [B, H, m, rv];
        exact_from int64 [B] or None."""
        B, H, g, n, r = query.shape
        m, rv = exact_keys.shape[2], exact_values.shape[-1]
        query, exact_keys, exact_values = (t.float().contiguous() for t in (query, exact_keys, exact_values))
        if exact_from is not None:
            exact_from = exact_from.to(torch.int64).contiguous()
        out = torch.empty(B, H, g, n, rv)
        exact_score = torch.empty(B, H, m)
        rc = load_library().kvcal_decode(*_layer_args(store, layer), _ptr(query), _ptr(exact_keys),
                                         _ptr(exact_values), _ptr(exact_from), g, n, m, r, rv, float(scale),
                                         int(track_scores), torch.get_num_threads(), GRAIN, _ptr(out),
                                         _ptr(exact_score), _levels_ptr(store, layer))
        if rc != 0:
            raise RuntimeError(f"layer {layer}: a page the fill counts promise is missing from the page table")
        return out, exact_score

    @staticmethod
    def sliding_decode(window, query, tail_keys, tail_values, scale, visible=None):
        """As AttentionBackend.sliding_decode, by `kvcal_sliding_decode`: the codes read in place, where the torch
        reference dequantizes the window and rotates nothing back but still makes four [B, H, n, d] tensors."""
        fmt = window.fmt
        B, H, g, d = query.shape
        keys, key_scales, values = (t.contiguous() for t in (window.keys, window.key_scales, window.values))
        query, tail_keys, tail_values = (t.float().contiguous() for t in (query, tail_keys, tail_values))
        seen = None if visible is None else visible.to(torch.uint8).contiguous()
        levels = [None if lv is None else lv.float().contiguous() for lv in window.levels]     # [H, 2**bits] each
        out = torch.empty(B, H, g, d)
        load_library().kvcal_sliding_decode(
            _ptr(query), _ptr(keys), _ptr(key_scales), _ptr(values), _ptr(tail_keys), _ptr(tail_values), _ptr(seen),
            _ptr(out),
            B, H, g, d, keys.shape[2], values.shape[2], tail_keys.shape[2], fmt.k_bits, int(fmt.k_mode == "channel"),
            fmt.k_group or 0, fmt.v_bits, fmt.v_group or 0, int(fmt.meta_bits == 8), window.block, float(scale),
            torch.get_num_threads(), _ptr(levels[0]), _ptr(levels[1]))
        return out

    @staticmethod
    def low_pages_due(store, layer, n_pad, length, tiering) -> bool:
        """As AttentionBackend.low_pages_due, by `kvcal_low_pages_due` in one call: the torch check is a score and
        position read of every high slot and a dozen tensor ops, per layer and decode step."""
        n_pad = n_pad.to(torch.int64).contiguous()
        due = load_library().kvcal_low_pages_due(*_layer_args(store, layer), _ptr(n_pad), length, tiering.window,
                                                 tiering.alpha_high, tiering.alpha_low,
                                                 int(tiering.threshold_base == "position"), DUE_SLACK, None)
        return due != 0                         # -1: the kernel cannot tell (an untracked high tier)

    @staticmethod
    def write(store, layer, side, b, h, slot, keys, values, pos, score) -> None:
        """As CompressedStore.write: b, h, slot, pos [n]; keys [n, >= r_k]; values [n, >= r_v]; score [n]."""
        if len(b) == 0:
            return
        assert side != LOW or store.low.k_mode != "channel", "per-channel pages are written whole (write_pages)"
        b, h, slot, pos = (t.to(torch.int64).contiguous() for t in (b, h, slot, pos))
        keys, values, score = (t.float().contiguous() for t in (keys, values, score))
        bad = ctypes.c_float(0.0)
        rc = load_library().kvcal_write(*_layer_args(store, layer), side, len(b), _ptr(b), _ptr(h), _ptr(slot),
                                        _ptr(keys), keys.shape[-1], _ptr(values), values.shape[-1], _ptr(pos),
                                        _ptr(score), ctypes.byref(bad), _levels_ptr(store, layer))
        _check_write(rc, bad)

    @staticmethod
    def insert_every(store, layer, side, keys, values, pos: int, score) -> torch.Tensor | None:
        """The decode step's insert (CompressedStore.insert): one token per entry, in every_entry order, into the
        entry's first hole on `side` where its `holes` count says it has one (holes -= 1), else at its end
        (fill += 1), in one call. keys [B * H, >= r_k]; values [B * H, >= r_v]; score [B * H]; pos: every token's
        position. An appending entry whose slot has no page takes one from the free list in the same call, as
        `reserve_pages` would give it. Where the free list or a page-table row is too short, writes nothing and
        returns those entries (int64 [m], every_entry indices, ascending): the caller reserves their pages (growing
        the arena) and calls again. None once written. No page may be shared."""
        keys, values, score = (t.float().contiguous() for t in (keys, values, score))
        W, arena = keys.shape[0], store.arena
        need, n_need, placed = torch.empty(W, dtype=torch.int64), ctypes.c_int64(0), ctypes.c_int64(0)
        start, num_free = ctypes.c_int64(arena.start), ctypes.c_int64(arena.num_free)
        holes, used = store.holes, arena.num_pages_used
        assert all(t.is_contiguous() for t in (holes, used, arena.free_list, arena.refs))
        bad = ctypes.c_float(0.0)
        rc = load_library().kvcal_insert_every(*_layer_args(store, layer), side, _ptr(holes), _ptr(used), _ptr(keys),
                                               keys.shape[-1], _ptr(values), values.shape[-1], pos, _ptr(score),
                                               ctypes.byref(bad), _ptr(need), ctypes.byref(n_need),
                                               _levels_ptr(store, layer), _ptr(arena.free_list), arena.num_pages,
                                               ctypes.byref(start), ctypes.byref(num_free), _ptr(arena.refs),
                                               ctypes.byref(placed))
        arena.start, arena.num_free = start.value, num_free.value
        if placed.value:
            store._forget_words(layer, side)
        if rc == 3:
            return need[:n_need.value]
        _check_write(rc, bad)
        return None

    @staticmethod
    def seal_low_pages(store, layer, b, h, slots) -> None:
        """`Scores.seal_low_pages`' moves before its compaction, one kernel call per head group: the high slots
        [e, T] of entries (b, h) [e] (distinct) read as the torch store reads them, written as one new low page per
        entry as `write_pages` writes it, and emptied (holes += T). The store reserves the pages. No page may be
        shared; the high keys must be per-token (`Scores.seal_low_pages` checks)."""
        for g, sel in store.group_rows(layer, h):
            base = store.reserve_low_page(layer, b[sel], h[sel], g.layouts[LOW]).to(torch.int64).contiguous()
            gb, gh, gs = (t[sel].to(torch.int64).contiguous() for t in (b, h, slots))
            bad = ctypes.c_float(0.0)
            rc = load_library().kvcal_seal_low_pages(*_layer_args(store, layer), len(gb), _ptr(gb), _ptr(gh),
                                                     _ptr(gs), _ptr(base), _ptr(store.holes),
                                                     _levels_ptr(store, layer), ctypes.byref(bad))
            assert rc != -1, "a high slot without a page, or high keys that are not per-token"
            _check_write(rc, bad)

    @staticmethod
    def compact_high(store, layer, b, h) -> torch.Tensor | None:
        """`Scores.compact`'s byte moves in one call: the live tokens past each entry's live count into its holes
        below it, for entries (b, h) [n] (distinct). Returns the live counts int64 [n] (the new fills; the caller
        trims), or None where the kernel cannot (no positions kept, a page missing): nothing moved then. No page
        may be shared."""
        b, h = b.to(torch.int64).contiguous(), h.to(torch.int64).contiguous()
        count = torch.empty(len(b), dtype=torch.int64)
        rc = load_library().kvcal_compact_high(*_layer_args(store, layer), len(b), _ptr(b), _ptr(h), _ptr(count))
        return count if rc == 0 else None

    @staticmethod
    def write_pages(store, layer, b, h, keys, values, pos, score) -> None:
        """As CompressedStore.write_pages (one whole new low page per entry), bit for bit what
        `write_pages_torch` writes: the store reserves the pages, `kvcal_write_pages` encodes and writes them. b, h
        [n]; keys [n, T, >= r_k]; values [n, T, >= r_v]; pos, score [n, T]."""
        keys, values, score = (t.float().contiguous() for t in (keys, values, score))
        pos = pos.to(torch.int64).contiguous()
        descs, head_group = _tables(store).descs[layer], _tables(store).head_group[layer]
        for g, sel in store.group_rows(layer, h):
            base = store.reserve_low_page(layer, b[sel], h[sel], g.layouts[LOW]).to(torch.int64).contiguous()
            hs = h[sel].to(torch.int64).contiguous()
            k, v, p, s = (t[sel].contiguous() for t in (keys, values, pos, score))
            bad = ctypes.c_float(0.0)
            rc = load_library().kvcal_write_pages(_ptr(store.arena.arena), _ptr(descs), _ptr(head_group), len(hs),
                                                  _ptr(base), _ptr(hs), _ptr(k), k.shape[-1], _ptr(v), v.shape[-1],
                                                  _ptr(p), _ptr(s), ctypes.byref(bad), _levels_ptr(store, layer),
                                                  store.num_kv_heads)
            _check_write(rc, bad)
