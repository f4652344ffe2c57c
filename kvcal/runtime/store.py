"""Compressed K/V of every (sequence, layer, KV head), held in one page arena.

Per token and KV head, K after RoPE is kept as K·R[:, :r_k] and V as V·B[:, :r_v] (ranks per head from the bundle),
quantized at the token's tier. The high section of an entry grows from the left of its page-table row, the low
section from the right (kvcal.runtime.pages); page byte layouts come from kvcal.runtime.layout.

Heads of one layer may have different ranks and therefore different page layouts; heads sharing (r_k, r_v) form a
*group* and are processed together (vectorized over sequences and heads; a layer has at most H groups, usually one).
Rotated vectors are passed around zero-padded to the layer's largest rank, which leaves dot products unchanged.

Static keys (k_mode "static"): each (layer, KV head) has one per-channel fp16 (scale, zero) per static tier, made
once from the bundle's calibrated clip ranges (`key_ranges`) and held here, not in the pages (`static_key_bytes`).

Slots: a section's slot s lives in its page s // T at index s % T. `fill[layer, b, h, side]` counts slots ever
written; a slot below `fill` with position -1 is a hole (a pruned or moved token). High-section holes are reused by
new tokens; per-channel low pages are written whole and never rewritten, so their holes stay until the sequence ends.

An untracked low tier (`low_tracked=False`, kvcal.runtime.layout) stores no score or position: its tokens never move,
so it has no holes. Reads give its slots below the fill position `HELD` (a token is there; its cache index is not
recorded) and score 0, and their score word is -1 (`set_scores` skips it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvcal.runtime import quant
from kvcal.runtime.layout import RAW_BITS, PageLayout, TierFormat, default_page_bytes
from kvcal.runtime.pages import HIGH, LOW, PageArena

_RAW_DTYPES = {32: torch.float32, 16: torch.float16}
HELD = 2**31 - 1       # the position read from an untracked slot that holds a token: >= 0, but no cache index


@dataclass
class HeadGroup:
    heads: torch.Tensor        # int64 [n] KV heads of this group
    layouts: tuple[PageLayout, PageLayout]   # (high, low)
    r_k: int
    r_v: int


@dataclass(frozen=True)
class SectionRead:
    """One side of one head group, dequantized (`gather`); n = the group's entries, S = slots of the longest."""

    side: int
    group: HeadGroup
    b: torch.Tensor          # int64 [n]
    h: torch.Tensor          # int64 [n]
    keys: torch.Tensor       # float32 [n, S, r_k]
    values: torch.Tensor     # float32 [n, S, r_v]
    score: torch.Tensor      # float32 [n, S]
    pos: torch.Tensor        # int64 [n, S], -1 = no token
    slot: torch.Tensor       # int64 [S]
    word: torch.Tensor       # int64 [n, S] index of each slot's score in the arena as float32 words


@dataclass
class Gathered:
    """All stored tokens of one layer, dequantized. S = slots of the longest entry (both sections)."""

    keys: torch.Tensor      # float32 [B, H, S, r_k max]
    values: torch.Tensor    # float32 [B, H, S, r_v max]
    pos: torch.Tensor       # int64 [B, H, S]  cache index, -1 = no token
    score: torch.Tensor     # float32 [B, H, S] cumulative significance
    side: torch.Tensor      # int64 [B, H, S]  HIGH / LOW
    slot: torch.Tensor      # int64 [B, H, S]  slot within its section
    word: torch.Tensor      # int64 [B, H, S]  index of the slot's score in the arena as float32 words


def _positions(pos, n: int, device) -> torch.Tensor:
    """pos as int64 [n]: a tensor as given, or one int for all n tokens."""
    return torch.full((n,), pos, dtype=torch.int64, device=device) if isinstance(pos, int) else pos


class CompressedStore:
    """Page-arena storage for the compressed layers of one batch of sequences.

    rank_k, rank_v: int [L, H] stored ranks per (layer, KV head); layers: indices of the layers stored here.
    writer: an attention backend that writes the cache itself (`AttentionBackend.writes_cache`): `write` and
    `write_pages` hand it the bytes, after the store did the bookkeeping (pages reserved, slots counted). None: the
    torch writer here.
    key_ranges: (low, high) float32 [L, H, >= r_k] per-channel clip ranges of the stored keys (bundle
    `k.range_low` / `k.range_high`); required when a tier has static keys, ignored otherwise.
    low_tracked: False when low tokens never move (`CompressionConfig.low_tracked`): low pages then hold no score or
    position. low_layers: layer -> low-tier format of that layer instead of `low` (`CompressionConfig.low_layers`);
    every reader and writer takes the format from the page layout, so a layer's pages are self-describing.

    Public addressing for backends: `entries` (the (sequence, head) pairs of a head group), `section_pages`,
    `page_of` (byte offset of a slot's page), `reserve_pages`, `reserve_low_page`.
    """

    def __init__(self, rank_k: torch.Tensor, rank_v: torch.Tensor, layers: list[int], *, high: TierFormat,
                 low: TierFormat, head_dim: int, batch: int, device: torch.device | str = "cpu",
                 page_bytes: int | None = None, raw16: torch.dtype = torch.float16, initial_pages: int = 1,
                 initial_tokens: int = 256, writer=None,
                 key_ranges: tuple[torch.Tensor, torch.Tensor] | None = None, low_tracked: bool = True,
                 low_layers: dict[int, TierFormat] | None = None):
        if high.k_mode == "channel":
            raise ValueError("the high tier needs keys written token by token (per-token or static keys): it holds "
                             "the recent window")
        self.high, self.low = high, low
        self.writer = writer
        self.layers = list(layers)
        self.batch, self.device = batch, torch.device(device)
        self.raw16 = raw16
        self.page_bytes = page_bytes or default_page_bytes(head_dim, high)
        L, H = rank_k.shape
        self.num_kv_heads = H
        self.groups: dict[int, list[HeadGroup]] = {}
        min_tokens = []
        for layer in self.layers:
            pairs = sorted({(int(rank_k[layer, h]), int(rank_v[layer, h])) for h in range(H)})
            groups = []
            for r_k, r_v in pairs:
                heads = [h for h in range(H) if (int(rank_k[layer, h]), int(rank_v[layer, h])) == (r_k, r_v)]
                lay = (PageLayout.build(high, r_k, r_v, self.page_bytes),
                       PageLayout.build((low_layers or {}).get(layer, low), r_k, r_v, self.page_bytes, low_tracked))
                groups.append(HeadGroup(torch.tensor(heads, device=self.device), lay, r_k, r_v))
                min_tokens += [lay[HIGH].tokens, lay[LOW].tokens]
            self.groups[layer] = groups
        self.r_k_max = {layer: max(g.r_k for g in gs) for layer, gs in self.groups.items()}
        self.r_v_max = {layer: max(g.r_v for g in gs) for layer, gs in self.groups.items()}
        self.static_keys = self._static_keys(key_ranges, rank_k)
        # page-table rows start with room for `initial_tokens` per entry and widen on demand (PageArena.grow_table):
        # a row sized for any context up front costs [B, L, H, 65536] int32 = hundreds of MB per cache. The arena
        # starts with `initial_pages` (one by default) and grows as pages are reserved: bytes allocated and never
        # used would count against the cache (`held_bytes`)
        max_pages = -(-initial_tokens // min(min_tokens)) * 2
        self.initial_table_width = max_pages
        self.arena = PageArena(initial_pages, self.page_bytes, slots=batch, layers=L, kv_heads=H,
                               max_pages_per_entry=max_pages, device=self.device)
        self.fill = torch.zeros(L, batch, H, 2, dtype=torch.int64, device=self.device)
        self.holes = torch.zeros(L, batch, H, 2, dtype=torch.int64, device=self.device)   # empty slots below fill
        self.page_seconds = 0.0   # time spent in page allocation (for the page-management share of a step)
        # (layer, side, group index) -> a lower bound on the free slots of every entry of the group. Decode appends
        # one token per entry per step and pages are freed only at release, so the bound drops by one per step and
        # the page tables need checking only when it reaches zero (every page's worth of steps, not every step)
        self._room: dict[tuple[int, int, int], int] = {}
        # (layer, side) pairs that may hold holes (a `drop` since the last release): `insert` looks for a hole to
        # reuse only there, so the common decode step (no tiers, no eviction) never reads `holes`
        self._holey: set[tuple[int, int]] = set()
        self._every: tuple[torch.Tensor, torch.Tensor] | None = None       # every_entry, until the batch changes

    def _static_keys(self, key_ranges, rank_k) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """(layer, side) -> fp16 (scale, zero) [H, r_k max] of each static-key tier (empty when none is static)."""
        static = [(side, fmt) for side, fmt in ((HIGH, self.high), (LOW, self.low)) if fmt.k_mode == "static"]
        if not static:
            return {}
        names = " and ".join(fmt.name for _, fmt in static)
        if key_ranges is None:
            raise ValueError(f"tier {names} needs calibrated static key ranges, and none were given; use a bundle "
                             "with `k.range_low` / `k.range_high` (written by `kvcal calibrate`)")
        low, high = key_ranges
        L, H = rank_k.shape
        need = max(self.r_k_max.values(), default=0)
        if low.shape != high.shape or low.dim() != 3 or tuple(low.shape[:2]) != (L, H) or low.shape[2] < need:
            raise ValueError(f"static key ranges have shapes {tuple(low.shape)} and {tuple(high.shape)}; tier {names} "
                             f"needs two of [{L}, {H}, >= {need}] (layers, KV heads, stored key channels)")
        out = {}
        for layer in self.layers:
            r = self.r_k_max[layer]
            for side, fmt in static:
                scale, zero = quant.static_scale_zero(low[layer, :, :r], high[layer, :, :r], fmt.k_bits)
                out[layer, side] = (scale.to(self.device), zero.to(self.device))
        return out

    def static_key_params(self, layer: int, side: int, h: torch.Tensor, r_k: int):
        """fp16 (scale, zero) [n, r_k] of the static-key tier on `side` for KV heads h [n]."""
        scale, zero = self.static_keys[layer, side]
        return scale[h, :r_k], zero[h, :r_k]

    def _key_scales(self, layer: int, side: int, h: torch.Tensor, g: HeadGroup):
        """What `_dequantize` needs to read group g's keys on `side`: `static_key_params` for static keys, else None."""
        return self.static_key_params(layer, side, h, g.r_k) if g.layouts[side].fmt.k_mode == "static" else None

    def static_key_bytes(self) -> int:
        """Bytes of the static key (scale, zero) pairs: a fixed cost per model and tier format, not per token (fp16
        scale and zero per stored key channel of each (layer, KV head), per static tier)."""
        return sum(4 * int(self.rank_k_of(layer).sum()) for layer, _ in self.static_keys)

    def rank_k_of(self, layer: int) -> torch.Tensor:
        """int64 [H]: stored key rank of each KV head of `layer`."""
        r = torch.zeros(self.num_kv_heads, dtype=torch.int64)
        for g in self.groups[layer]:
            r[g.heads.cpu()] = g.r_k
        return r

    # ------------------------------------------------------------------------------------------------- addressing

    def every_entry(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, KV head) of every entry, sequence-major: b, h int64 [B * H]. Made once per batch size (each
        layer of each decode step asks); callers must not change them in place."""
        if self._every is None or len(self._every[0]) != self.batch * self.num_kv_heads:
            B, H = self.batch, self.num_kv_heads
            self._every = (torch.arange(B, device=self.device).repeat_interleave(H),
                           torch.arange(H, device=self.device).repeat(B))
        return self._every

    def group_rows(self, layer: int, h: torch.Tensor):
        """(head group, bool [n] rows of `h` [n] in it) for each group of `layer` that has rows in `h`."""
        for g in self.groups[layer]:
            sel = torch.isin(h, g.heads)
            if bool(sel.any()):
                yield g, sel

    def _flat(self, dtype: torch.dtype) -> torch.Tensor:
        return self.arena.arena.view(-1).view(dtype)

    def page_of(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor,
                 lay: PageLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Byte offset of the page holding each slot, and the slot's index in that page; all [n]."""
        k = slot // lay.tokens
        col = k if side == HIGH else self.arena.max_pages_per_entry - 1 - k
        page = self.arena.page_table[b, layer, h, col].long()
        assert bool((page >= 0).all()), "slot without a page"
        return page * self.page_bytes, slot % lay.tokens

    def reserve_pages(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, need_slots: torch.Tensor,
                      lay: PageLayout) -> None:
        """Allocate pages so that each entry (b, h) [n] has at least `need_slots` [n] slots on `side`."""
        t0 = time.perf_counter()
        have = self.arena.num_pages_used[b, layer, h, side].long()
        count = (-(-need_slots // lay.tokens) - have).clamp(min=0)
        if bool((count > 0).any()):
            nz = count > 0
            need = int(count.sum())
            width = int((self.arena.num_pages_used[b[nz], layer, h[nz]].sum(-1) + count[nz]).max())
            if width > self.arena.max_pages_per_entry:
                self.arena.grow_table(max(width, 2 * self.arena.max_pages_per_entry))
            if need > self.arena.num_free:
                # geometric growth by an eighth: a growth copies the whole arena (tens of ms at 1k x 8 on 2 cores), so
                # it should be rare, but free pages are bytes the cache holds (`held_bytes`): doubling would let
                # them reach the bytes in use, and a fixed floor would be most of a short sequence's bytes
                self.arena.grow(max(need - self.arena.num_free, self.arena.num_pages // 8))
            self.arena.extend(b[nz], layer, h[nz], side, count[nz], need)     # checked above: no validation
        self.page_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------------- writing

    def _free_slots(self, layer: int, side: int, g: HeadGroup) -> int:
        """min over the group's entries of (allocated slots - filled slots) on `side`. Page management: timed."""
        t0 = time.perf_counter()
        if len(g.heads) == self.num_kv_heads:                       # the whole layer: plain slices, no gathers
            have, fill = self.arena.num_pages_used[:, layer, :, side], self.fill[layer, :, :, side]
        else:
            b, h = self.entries(layer, g)
            have, fill = self.arena.num_pages_used[b, layer, h, side], self.fill[layer, b, h, side]
        room = int((have.long() * g.layouts[side].tokens - fill).min())
        self.page_seconds += time.perf_counter() - t0
        return room

    def _forget_room(self, layer: int, side: int) -> None:
        for i in range(len(self.groups[layer])):
            self._room.pop((layer, side, i), None)

    def _raw(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        dtype = torch.float32 if bits == 32 else self.raw16
        return x.to(dtype).contiguous().view(torch.uint8)

    def write(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> None:
        """Write tokens one by one (per-token formats): b, h, slot, pos [n]; keys [n, >= r_k]; values [n, >= r_v];
        score [n]. Pages must exist (`append`). Tokens of different groups may be mixed."""
        self._own(layer, side, b, h, slot)
        if self.writer is not None:
            self.writer.write(self, layer, side, b, h, slot, keys, values, pos, score)
            return
        for g, sel in self.group_rows(layer, h):
            lay = g.layouts[side]
            base, idx = self.page_of(layer, side, b[sel], h[sel], slot[sel], lay)
            fmt = lay.fmt
            assert fmt.k_mode != "channel", "per-channel pages are written whole (write_pages)"
            k, v = keys[sel, :g.r_k].float(), values[sel, :g.r_v].float()
            if fmt.k_mode == "static":
                scale, zero = self.static_key_params(layer, side, h[sel], g.r_k)
                self._put_bytes(base, idx, quant.pack(quant.quantize_static(k, scale, zero, fmt.k_bits), fmt.k_bits),
                                lay.k_off, lay.k_bytes)
            else:
                self._put_vectors(base, idx, k, fmt.k_bits, fmt.k_group, lay.k_off, lay.k_meta_off, lay.k_bytes,
                                  lay.k_groups, fmt.meta_bits)
            self._put_vectors(base, idx, v, fmt.v_bits, fmt.v_group, lay.v_off, lay.v_meta_off, lay.v_bytes,
                              lay.v_groups, fmt.meta_bits)
            if lay.tracked:
                self._flat(torch.float32)[(base + lay.score_off) // 4 + idx] = score[sel].float()
                self._flat(torch.int32)[(base + lay.pos_off) // 4 + idx] = pos[sel].to(torch.int32)

    def _put_vectors(self, base, idx, x, bits, group, off, meta_off, nbytes, ngroups, meta_bits=16) -> None:
        if bits in RAW_BITS:
            data = self._raw(x, bits)
        else:
            codes, scale, zero = quant.quantize_per_token(x, bits, group, meta_bits)
            data = quant.pack(codes, bits)
            meta = quant.meta_to_bytes(scale, zero).reshape(len(x), -1)                # [n, groups * pair]
            width = meta.shape[1]
            self._flat(torch.uint8)[(base + meta_off)[:, None] + idx[:, None] * width
                                    + torch.arange(width, device=x.device)] = meta
        self._put_bytes(base, idx, data, off, nbytes)

    def _put_bytes(self, base, idx, data: torch.Tensor, off: int, nbytes: int) -> None:
        """data uint8 [n, nbytes] into slot idx [n] of the segment at `off` of the pages at byte offsets base [n]."""
        self._flat(torch.uint8)[(base + off)[:, None] + idx[:, None] * nbytes + torch.arange(nbytes,
                                                                                          device=data.device)] = data

    def reserve_low_page(self, layer: int, b: torch.Tensor, h: torch.Tensor, lay: PageLayout) -> torch.Tensor:
        """Per-channel low tier: the bookkeeping of one whole new low page per entry (b, h) [n] of one head group
        (pages allocated, slots counted as filled). Returns each new page's byte offset [n] for the writer."""
        T = lay.tokens
        start = self.fill[layer, b, h, LOW]
        self.reserve_pages(layer, LOW, b, h, start + T, lay)
        self.fill[layer, b, h, LOW] = start + T
        self._forget_room(layer, LOW)
        return self.page_of(layer, LOW, b, h, start, lay)[0]

    def write_pages(self, layer: int, b: torch.Tensor, h: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    pos: torch.Tensor, score: torch.Tensor) -> None:
        """Per-channel low tier: append one whole new low page per entry. b, h [n]; keys [n, T, >= r_k];
        values [n, T, >= r_v]; pos, score [n, T] (T = the group's low-page capacity)."""
        if self.writer is not None:
            self.writer.write_pages(self, layer, b, h, keys, values, pos, score)
        else:
            self.write_pages_torch(layer, b, h, keys, values, pos, score)

    def write_pages_torch(self, layer: int, b: torch.Tensor, h: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> None:
        """`write_pages` in torch, whatever the writer: for writers without a page kernel of their own."""
        for g, sel in self.group_rows(layer, h):
            lay = g.layouts[LOW]
            bs, hs = b[sel], h[sel]
            T = lay.tokens
            base = self.reserve_low_page(layer, bs, hs, lay)
            k = keys[sel, :, :g.r_k].float()
            fmt = lay.fmt
            codes, scale, zero = quant.quantize_per_channel(k, fmt.k_bits, meta_bits=fmt.meta_bits)   # [n, T, r_k]
            data = quant.pack(codes, fmt.k_bits).reshape(len(bs), -1)                  # [n, T * k_bytes]
            ar = lambda n: torch.arange(n, device=self.device)                         # noqa: E731
            self._flat(torch.uint8)[(base + lay.k_off)[:, None] + ar(T * lay.k_bytes)] = data
            meta = quant.meta_to_bytes(scale, zero).reshape(len(bs), -1)                       # [n, r_k * pair]
            self._flat(torch.uint8)[(base + lay.k_meta_off)[:, None] + ar(meta.shape[1])] = meta
            idx = ar(T).expand(len(bs), T).reshape(-1)
            v = values[sel, :, :g.r_v].reshape(-1, g.r_v).float()
            self._put_vectors(base.repeat_interleave(T), idx, v, fmt.v_bits, fmt.v_group, lay.v_off,
                              lay.v_meta_off, lay.v_bytes, lay.v_groups, fmt.meta_bits)
            if lay.tracked:
                self._flat(torch.float32)[(base + lay.score_off)[:, None] // 4 + ar(T)] = score[sel].float()
                self._flat(torch.int32)[(base + lay.pos_off)[:, None] // 4 + ar(T)] = pos[sel].to(torch.int32)

    def append(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, keys, values, pos, score,
               distinct: bool = False) -> None:
        """Append tokens (per-token formats) at the end of their entries' sections: b, h, pos, score [n] (several
        tokens per entry allowed, written in order; distinct: the caller knows each entry appears once);
        keys [n, >= r_k]; values [n, >= r_v]."""
        if len(b) == 0:
            return
        L, B, H = self.fill.shape[:3]
        entry = b * H + h
        if distinct or len(torch.unique(entry)) == len(entry):    # one token per entry (decode): no ordering needed
            start = self.fill[layer, b, h, side]
            for i, g in enumerate(self.groups[layer]):
                if self._room.get((layer, side, i), 0) < 1:
                    sel = torch.isin(h, g.heads)
                    if bool(sel.any()):
                        self.reserve_pages(layer, side, b[sel], h[sel], start[sel] + 1, g.layouts[side])
                    self._room[layer, side, i] = self._free_slots(layer, side, g)
                self._room[layer, side, i] -= 1
            self.fill[layer, b, h, side] = start + 1
            self.write(layer, side, b, h, start, keys, values, pos, score)
            return
        order = torch.argsort(entry, stable=True)
        b, h, entry = b[order], h[order], entry[order]
        keys, values, pos, score = keys[order], values[order], pos[order], score[order]
        uniq, counts = torch.unique_consecutive(entry, return_counts=True)
        rank = torch.arange(len(b), device=self.device) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts)
        ub, uh = uniq // H, uniq % H
        start = self.fill[layer, ub, uh, side]
        for g, sel in self.group_rows(layer, uh):
            self.reserve_pages(layer, side, ub[sel], uh[sel], (start + counts)[sel], g.layouts[side])
        self.fill[layer, ub, uh, side] = start + counts
        self._forget_room(layer, side)
        slot = torch.repeat_interleave(start, counts) + rank
        self.write(layer, side, b, h, slot, keys, values, pos, score)

    def insert(self, layer: int, side: int, b, h, keys, values, pos, score, every_entry: bool = False) -> None:
        """One token per entry (b, h distinct), per-token formats: reuse the entry's first hole, else append. pos
        [n] or one int for all. every_entry: (b, h) are `every_entry()` (the decode step), which allows the fused
        append (`_append_every`)."""
        assert side == HIGH or self.low.k_mode != "channel", "per-channel low pages are written whole"
        if (layer, side) not in self._holey:                           # the common case: nothing to reuse
            if every_entry:
                self._append_every(layer, side, keys, values, pos, score)
            else:
                self.append(layer, side, b, h, keys, values, _positions(pos, len(b), self.device), score,
                            distinct=True)
            return
        pos = _positions(pos, len(b), self.device)
        if not bool((self.holes[layer, b, h, side] > 0).any()):
            self.append(layer, side, b, h, keys, values, pos, score, distinct=True)
            return
        sec_pos = self.section_meta(layer, side, b, h)[1]                               # [n, S]
        fill = self.fill[layer, b, h, side]
        holes = (sec_pos < 0) & (torch.arange(sec_pos.shape[1], device=self.device) < fill[:, None])
        has = holes.any(-1)
        if bool(has.any()):
            slot = holes.to(torch.int8).argmax(-1)
            self.write(layer, side, b[has], h[has], slot[has], keys[has], values[has], pos[has], score[has])
            self.holes[layer, b[has], h[has], side] -= 1
        new = ~has
        if bool(new.any()):
            self.append(layer, side, b[new], h[new], keys[new], values[new], pos[new], score[new], distinct=True)

    def _append_every(self, layer: int, side: int, keys, values, pos: int | torch.Tensor, score) -> None:
        """One token at the end of every entry's section (the decode step without holes): keys [B * H, >= r_k],
        values [B * H, >= r_v], score [B * H] in `every_entry` order; pos [B * H] or one int. A writer with
        `append_every` (the cpu backend) writes at `fill` and advances it in one call."""
        for i, g in enumerate(self.groups[layer]):
            if self._room.get((layer, side, i), 0) < 1:
                gb, gh = self.entries(layer, g)
                self.reserve_pages(layer, side, gb, gh, self.fill[layer, gb, gh, side] + 1, g.layouts[side])
                self._room[layer, side, i] = self._free_slots(layer, side, g)
            self._room[layer, side, i] -= 1
        fused = getattr(self.writer, "append_every", None)
        if fused is not None and not self.arena.shared and isinstance(pos, int):
            fused(self, layer, side, keys, values, pos, score)
            return
        b, h = self.every_entry()
        start = self.fill[layer, :, :, side].reshape(-1).clone()
        self.fill[layer, :, :, side] += 1
        self.write(layer, side, b, h, start, keys, values, _positions(pos, len(b), self.device), score)

    def drop(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor) -> None:
        """Mark slots [n] empty (position -1): the token is pruned or has moved. Slots must hold a token, each once."""
        self._own(layer, side, b, h, slot)
        n = len(b)
        self._holey.add((layer, side))
        self.holes.index_put_((torch.full((n,), layer, device=self.device), b, h,
                               torch.full((n,), side, device=self.device)),
                              torch.ones(n, dtype=torch.int64, device=self.device), accumulate=True)
        for g, sel in self.group_rows(layer, h):
            lay = g.layouts[side]
            if not lay.tracked:
                raise RuntimeError("a token policy dropped a token of an untracked tier (CompressionConfig."
                                   "low_tracked is wrong for this policy)")
            base, idx = self.page_of(layer, side, b[sel], h[sel], slot[sel], lay)
            self._flat(torch.int32)[(base + lay.pos_off) // 4 + idx] = -1

    def add_scores(self, layer: int, gathered: Gathered, delta: torch.Tensor) -> None:
        """score += delta [B, H, S] for every stored token of `gathered` (the same layer, unchanged since, gathered
        after `own_layer`: see `set_scores`)."""
        self.set_scores(layer, gathered.word, gathered.pos, gathered.score + delta)

    def set_scores(self, layer: int, word: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> None:
        """Write `score` into the slots at score words `word` where pos >= 0 and word >= 0 (all the same shape). The
        words come from `gather` or `section_scores` of `layer` with no page change since, read after
        `own_layer(layer)`: copy on write moves a shared page, so words read before it would write into the page the
        other sequence keeps."""
        valid = (pos >= 0) & (word >= 0)
        self._flat(torch.float32)[word[valid]] = score[valid].float()

    # ------------------------------------------------------------------------------------------------- reading

    def entries(self, layer: int, g: HeadGroup) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(g.heads)
        b = torch.arange(self.batch, device=self.device).repeat_interleave(n)
        return b, g.heads.repeat(self.batch)

    def section_pages(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """page ids int64 [n, P] of the entries' side in slot order (-1 padded); P = the longest side asked for.

        Reads the page table directly (no argument validation): this runs for every layer of every decode step.
        """
        count = self.arena.num_pages_used[b, layer, h, side]                            # [n]
        P = int(count.max()) if len(b) else 0
        table = self.arena.page_table[:, layer]                                         # [slots, H, P_max]
        cols = table[..., :P] if side == HIGH else table[..., table.shape[-1] - P:].flip(-1)   # k-th low page at
        pages = cols[b, h]                                                              # P_max-1-k; [n, P]
        # an entry with fewer pages on this side must not read the other side's pages in those columns
        return torch.where(torch.arange(P, device=self.device) < count[:, None], pages, -1).long()

    def _slot_words(self, pages: torch.Tensor, lay: PageLayout) -> torch.Tensor:
        """pages int64 [n, P] (-1 = none) -> int64 [n, P * T]: each slot's index among the arena's 4-byte words,
        counted from its page's start (add a segment's offset // 4 to address its score or position)."""
        n, P = pages.shape
        return ((pages.clamp(min=0) * self.page_bytes // 4)[..., None]
                + torch.arange(lay.tokens, device=self.device)).reshape(n, P * lay.tokens)

    def _score_words(self, pages: torch.Tensor, lay: PageLayout) -> torch.Tensor:
        """int64 [n, P * T]: each slot's score as an arena float32 word; -1 in an untracked tier."""
        if not lay.tracked:
            return torch.full((pages.shape[0], pages.shape[1] * lay.tokens), -1, dtype=torch.int64,
                              device=self.device)
        return self._slot_words(pages, lay) + lay.score_off // 4

    def section_meta(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor):
        """(score float32 [n, S], pos int64 [n, S]) of the entries' sections; pos -1 beyond `fill` and in holes.
        Reads only the score and position segments."""
        return self.section_scores(layer, side, b, h)[:2]

    def section_scores(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor):
        """`section_meta` and where each score lives: (score float32 [n, S], pos int64 [n, S], word int64 [n, S]
        the score's index in the arena as float32 words, for `set_scores`)."""
        parts = []
        groups = self.groups[layer]
        rows = [(groups[0], None)] if len(groups) == 1 else self.group_rows(layer, h)
        for g, sel in rows:
            lay = g.layouts[side]
            eb, eh = (b, h) if sel is None else (b[sel], h[sel])
            pages = self.section_pages(layer, side, eb, eh)
            word = self._score_words(pages, lay)
            if lay.tracked:
                score = self._flat(torch.float32)[word]
                pos = self._flat(torch.int32)[self._slot_words(pages, lay) + lay.pos_off // 4].long()
            else:
                score, pos = torch.zeros(word.shape, device=self.device), torch.full_like(word, HELD)
            fill = self.fill[layer, eb, eh, side]
            pos = torch.where(torch.arange(word.shape[1], device=self.device) < fill[:, None], pos, -1)
            if sel is None:
                return score, pos, word
            parts.append((sel, score, pos, word))
        width = max([score.shape[1] for _, score, _, _ in parts], default=0)
        out_s = torch.zeros(len(b), width, device=self.device)
        out_p = torch.full((len(b), width), -1, dtype=torch.int64, device=self.device)
        out_w = torch.zeros((len(b), width), dtype=torch.int64, device=self.device)
        for sel, score, pos, word in parts:
            out_s[sel, :score.shape[1]] = score
            out_p[sel, :pos.shape[1]] = pos
            out_w[sel, :word.shape[1]] = word
        return out_s, out_p, out_w

    def read(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor):
        """Dequantized (keys [n, r_k max], values [n, r_v max], score [n], pos [n]) of given slots."""
        n = len(b)
        keys = torch.zeros(n, self.r_k_max[layer], device=self.device)
        values = torch.zeros(n, self.r_v_max[layer], device=self.device)
        score, pos = torch.zeros(n, device=self.device), torch.full((n,), -1, dtype=torch.int64, device=self.device)
        for g, sel in self.group_rows(layer, h):
            lay = g.layouts[side]
            base, idx = self.page_of(layer, side, b[sel], h[sel], slot[sel], lay)
            pages = (base // self.page_bytes)[:, None]
            scales = self._key_scales(layer, side, h[sel], g)
            k, v, sc, ps = self._dequantize(self.arena.arena[pages], lay, scales)              # [m, 1 * T, ...]
            pick = idx[:, None]
            keys[sel, :g.r_k] = k.gather(1, pick[..., None].expand(-1, -1, g.r_k)).squeeze(1)
            values[sel, :g.r_v] = v.gather(1, pick[..., None].expand(-1, -1, g.r_v)).squeeze(1)
            score[sel] = sc.gather(1, pick).squeeze(1)
            pos[sel] = ps.gather(1, pick).squeeze(1)
        return keys, values, score, pos

    def _dequantize(self, data: torch.Tensor, lay: PageLayout, key_scales=None):
        """data uint8 [n, P, page_bytes] -> keys [n, P*T, r_k], values [n, P*T, r_v] float32, score, pos [n, P*T].
        key_scales: static keys' fp16 (scale, zero) [n, r_k] of each row's head (`static_key_params`)."""
        n, P, _ = data.shape
        T, fmt = lay.tokens, lay.fmt

        def seg(off: int, nbytes: int) -> torch.Tensor:
            return data[..., off:off + nbytes].contiguous()

        def vectors(off, meta_off, nbytes, ngroups, bits, group, r) -> torch.Tensor:
            raw = seg(off, T * nbytes).view(n, P * T, nbytes)
            if bits in RAW_BITS:
                return raw.view(torch.float32 if bits == 32 else self.raw16).float()
            codes = quant.unpack(raw, bits, r)
            scale, zero = quant.meta_from_bytes(seg(meta_off, T * ngroups * pair), fmt.meta_bits, bits,
                                                (n, P * T, ngroups))
            return quant.dequantize_per_token(codes, scale, zero, group)

        pair = fmt.meta_pair_bytes
        if fmt.k_mode == "channel":
            codes = quant.unpack(seg(lay.k_off, T * lay.k_bytes).view(n, P, T, lay.k_bytes), fmt.k_bits, lay.r_k)
            scale, zero = quant.meta_from_bytes(seg(lay.k_meta_off, lay.r_k * pair), fmt.meta_bits, fmt.k_bits,
                                                (n, P, lay.r_k))
            keys = quant.dequantize_per_channel(codes, scale, zero).reshape(n, P * T, lay.r_k)
        elif fmt.k_mode == "static":
            codes = quant.unpack(seg(lay.k_off, T * lay.k_bytes).view(n, P * T, lay.k_bytes), fmt.k_bits, lay.r_k)
            keys = quant.dequantize_static(codes, key_scales[0][:, None], key_scales[1][:, None])
        else:
            keys = vectors(lay.k_off, lay.k_meta_off, lay.k_bytes, lay.k_groups, fmt.k_bits, fmt.k_group, lay.r_k)
        values = vectors(lay.v_off, lay.v_meta_off, lay.v_bytes, lay.v_groups, fmt.v_bits, fmt.v_group, lay.r_v)
        if not lay.tracked:
            return keys, values, torch.zeros(n, P * T, device=data.device), \
                torch.full((n, P * T), HELD, dtype=torch.int64, device=data.device)
        score = seg(lay.score_off, 4 * T).view(torch.float32).reshape(n, P * T)
        pos = seg(lay.pos_off, 4 * T).view(torch.int32).reshape(n, P * T).long()
        return keys, values, score, pos

    def gather(self, layer: int) -> Gathered:
        """Every stored token of `layer`, dequantized, high section first (see `Gathered`)."""
        B, H = self.batch, self.num_kv_heads
        parts = []
        for side in (HIGH, LOW):
            for g in self.groups[layer]:
                b, h = self.entries(layer, g)
                pages = self.section_pages(layer, side, b, h)
                if pages.shape[1] == 0:
                    continue
                lay = g.layouts[side]
                k, v, score, pos = self._dequantize(self.arena.arena[pages.clamp(min=0)], lay,
                                                    self._key_scales(layer, side, h, g))
                slot = torch.arange(pos.shape[1], device=self.device)
                pos = torch.where(slot < self.fill[layer, b, h, side][:, None], pos, -1)
                word = self._score_words(pages, lay)
                # never-written slots hold stale bytes (NaN as raw floats): zero them, 0 * NaN would poison attention
                live = (pos >= 0)[..., None]
                k, v = torch.where(live, k, 0.0), torch.where(live, v, 0.0)
                parts.append(SectionRead(side=side, group=g, b=b, h=h, keys=k, values=v, score=score, pos=pos,
                                         slot=slot, word=word))
        if len(self.groups[layer]) == 1:
            return self._gather_one_group(parts)
        widths = {}
        for part in parts:
            widths[part.side] = max(widths.get(part.side, 0), part.keys.shape[1])
        S = sum(widths.values())
        out = Gathered(
            keys=torch.zeros(B, H, S, self.r_k_max[layer], device=self.device),
            values=torch.zeros(B, H, S, self.r_v_max[layer], device=self.device),
            pos=torch.full((B, H, S), -1, dtype=torch.int64, device=self.device),
            score=torch.zeros(B, H, S, device=self.device),
            side=torch.zeros(B, H, S, dtype=torch.int64, device=self.device),
            slot=torch.zeros(B, H, S, dtype=torch.int64, device=self.device),
            word=torch.zeros(B, H, S, dtype=torch.int64, device=self.device),
        )
        for part in parts:
            start = 0 if part.side == HIGH else widths.get(HIGH, 0)
            cols = slice(start, start + part.keys.shape[1])
            b, h = part.b, part.h
            out.keys[b, h, cols, :part.group.r_k] = part.keys
            out.values[b, h, cols, :part.group.r_v] = part.values
            out.pos[b, h, cols] = part.pos
            out.score[b, h, cols] = part.score
            out.side[b, h, cols] = part.side
            out.slot[b, h, cols] = part.slot
            out.word[b, h, cols] = part.word
        return out

    def _gather_one_group(self, parts: list[SectionRead]) -> Gathered:
        """Fast path when every head of the layer shares one layout: entries are already [B * H] in order, so the
        sides only need reshaping and concatenating (no scatter)."""
        B, H = self.batch, self.num_kv_heads
        view = lambda t: t.reshape(B, H, *t.shape[1:])                                   # noqa: E731
        cat = lambda name: torch.cat([view(getattr(p, name)) for p in parts], dim=2)     # noqa: E731
        if not parts:
            r_k, r_v = self.groups[self.layers[0]][0].r_k, self.groups[self.layers[0]][0].r_v
            empty = torch.zeros(B, H, 0, dtype=torch.int64, device=self.device)
            return Gathered(torch.zeros(B, H, 0, r_k, device=self.device), torch.zeros(B, H, 0, r_v,
                            device=self.device), empty - 1, empty.float(), empty, empty, empty)
        side = torch.cat([torch.full((B, H, p.keys.shape[1]), p.side, dtype=torch.int64, device=self.device)
                          for p in parts], dim=2)
        slot = torch.cat([p.slot.expand(B, H, -1) for p in parts], dim=2)
        return Gathered(keys=cat("keys"), values=cat("values"), pos=cat("pos"), score=cat("score"), side=side,
                        slot=slot, word=cat("word"))

    # ------------------------------------------------------------------------------------------------- beams, crop

    def _own(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor) -> None:
        """Copy on write before slots [n] of entries (b, h) change: pages that `select` left shared by several
        sequences are copied for the writer (PageArena.unshare). Nothing to do, and no sync, when none is shared."""
        if not self.arena.shared:
            return
        t0 = time.perf_counter()
        for g, sel in self.group_rows(layer, h):
            n = int(sel.sum())
            self.arena.unshare(b[sel], torch.full((n,), layer, device=self.device), h[sel],
                               torch.full((n,), side, device=self.device), slot[sel] // g.layouts[side].tokens)
        self.page_seconds += time.perf_counter() - t0

    def own_layer(self, layer: int) -> None:
        """Copy on write for every page of `layer`: before a backend that writes scores into all of them
        (score tracking of the tiered policies)."""
        if not self.arena.shared:
            return
        for side in (HIGH, LOW):
            used = self.arena.num_pages_used[:, layer, :, side].reshape(-1).long()         # [B * H]
            if int(used.sum()) == 0:
                continue
            entry = torch.repeat_interleave(torch.arange(len(used), device=self.device), used)
            k = torch.arange(len(entry), device=self.device) - torch.repeat_interleave(
                torch.cumsum(used, 0) - used, used)
            n = len(entry)
            self.arena.unshare(entry // self.num_kv_heads, torch.full((n,), layer, device=self.device),
                               entry % self.num_kv_heads, torch.full((n,), side, device=self.device), k)

    def select(self, index: torch.Tensor) -> int:
        """Sequence i becomes old sequence index[i] (int [k], repeats allowed): beam-search reordering and batch
        selection/repetition by re-indexing the page tables and the fill counts; pages become shared instead of
        copied (copy on write, `_own`). Returns the number of pages freed (sequences no longer selected)."""
        index = torch.as_tensor(index, device=self.device).long()
        freed = self.arena.select_slots(index)
        self.fill, self.holes = self.fill[:, index].contiguous(), self.holes[:, index].contiguous()
        self.batch = len(index)
        self._room.clear()
        return freed

    def crop_check(self, layer: int, keep: int, n_pad: torch.Tensor, length: int) -> str | None:
        """Why the tokens at cache index >= keep of `layer` cannot all be removed exactly, or None: each must
        still sit in the high section (not moved low, not pruned). n_pad [B]: left padding of each sequence."""
        B, H = self.batch, self.num_kv_heads
        b = torch.arange(B, device=self.device).repeat_interleave(H)
        h = torch.arange(H, device=self.device).repeat(B)
        hi = self.section_meta(layer, HIGH, b, h)[1]
        expected = (length - torch.maximum(torch.full_like(n_pad, keep), n_pad)).clamp(min=0)   # real tokens [B]
        found = (hi >= keep).sum(-1).view(B, H)     # fewer than expected: one moved low or was pruned
        if bool((found < expected[:, None]).any()):
            return (f"layer {layer} holds a token at cache index >= {keep} that is no longer at the high tier (moved "
                    f"to the low tier or pruned)")
        return None

    def crop(self, layer: int, keep: int) -> int:
        """Remove the tokens at cache index >= keep of `layer` (all in the high sections: `crop_check`), trim the
        sections' fill and free their emptied tail pages. Returns the number of pages freed."""
        B, H = self.batch, self.num_kv_heads
        b = torch.arange(B, device=self.device).repeat_interleave(H)
        h = torch.arange(H, device=self.device).repeat(B)
        pos = self.section_meta(layer, HIGH, b, h)[1]                                    # [B * H, S]
        eb, slot = torch.nonzero(pos >= keep, as_tuple=True)
        if len(eb):
            self.drop(layer, HIGH, b[eb], h[eb], slot)
        pos = torch.where(pos >= keep, -1, pos)
        S = pos.shape[1]
        live = torch.where(pos >= 0, torch.arange(S, device=self.device), -1).max(-1).values + 1 if S else \
            torch.zeros(len(b), dtype=torch.int64, device=self.device)                     # new fill [B * H]
        old = self.fill[layer, b, h, HIGH]
        self.fill[layer, b, h, HIGH] = live
        self.holes[layer, b, h, HIGH] -= old - live                                     # trimmed slots were holes
        freed = 0
        for g, sel in self.group_rows(layer, h):
            T = g.layouts[HIGH].tokens
            gb, gh = b[sel], h[sel]
            extra = self.arena.num_pages_used[gb, layer, gh, HIGH].long() - (-(-live[sel] // T))
            nz = extra > 0
            if bool(nz.any()):
                n = int(nz.sum())
                before = self.arena.num_free
                self.arena.free_last(gb[nz], torch.full((n,), layer, device=self.device), gh[nz],
                                     torch.full((n,), HIGH, device=self.device), extra[nz])
                freed += self.arena.num_free - before
        self._room.clear()
        return freed

    # ------------------------------------------------------------------------------------------------- accounting

    def bytes_in_use(self) -> int:
        """Bytes of the pages this store holds (metadata and fragmentation included)."""
        return self.arena.used_bytes()

    def held_bytes(self) -> int:
        """Every byte this store holds: the whole arena (free pages included), its tables, the fill and hole counts,
        and the static key scales (`static_key_bytes`)."""
        counts = sum(t.numel() * t.element_size() for t in (self.fill, self.holes))
        return self.arena.held_bytes() + counts + self.static_key_bytes()

    def bookkeeping_bytes(self) -> int:
        """Bytes of the page tables and counters as the store made them (before any row widened): part of the fixed
        amount `CompressedKV.allowance_bytes`."""
        a = self.arena
        return a.slots * a.layers * a.kv_heads * (4 * self.initial_table_width + 8) + 2 * self.fill.numel() * 8

    def pages_estimate(self, tokens: int, high_tokens: int | None) -> int:
        """Bytes of the pages one sequence of `tokens` tokens holds when at most `high_tokens` of them sit in each
        entry's high section and the others in its low section (None: every token high), pages rounded up. The
        model behind `CompressedKV.raw_tokens` and `steady_state_ratio`; heavy hitters kept high, pruned and evicted
        tokens are not in it."""
        total = 0
        for groups in self.groups.values():
            for g in groups:
                hi, lo = g.layouts
                h = tokens if high_tokens is None else min(tokens, high_tokens)
                total += len(g.heads) * (-(-h // hi.tokens) + -(-(tokens - h) // lo.tokens)) * self.page_bytes
        return total

    def release(self) -> int:
        """Return every page to the free list (the batch finished); returns the number of pages freed."""
        freed = self.arena.free_slots(torch.arange(self.batch, device=self.device))
        self.fill.zero_()
        self.holes.zero_()
        self._holey.clear()
        self._room.clear()
        return freed
