"""Compressed K/V of every (sequence, layer, KV head), held in one page arena: `CompressedStore`.

The store is three layers, one file each: `page_table.PageTable` allocates pages and addresses slots,
`scores.Scores` reads and writes the slots' score and position words (holes, crop), and `CompressedStore` here
writes and reads the tokens themselves, through each format's encode/decode pair (`codec.py`).

Static keys (k_mode "static"): each (layer, KV head) has one per-channel fp16 (scale, zero) per static tier, made
once from the bundle's calibrated clip ranges (`key_ranges`) and held here, not in the pages (`static_key_bytes`).
Calibrated levels (formats with an `n` after a side's bits): the rows of the bundle's `levels.{k,v}.{bits}` that the
layers' formats use, held here as float32 [H, 2**bits] per (layer, side, bits) (`levels.served_levels`); both are
the bundle's fixed bytes (`fixed_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcal.runtime.storage import codec, quant
from kvcal.runtime.storage.codec import HELD
from kvcal.runtime.storage.layout import RAW_BITS, TierFormat
from kvcal.runtime.storage.levels import served_levels
from kvcal.runtime.storage.page_table import HeadGroup
from kvcal.runtime.storage.pages import HIGH, LOW
from kvcal.runtime.storage.scores import Scores

__all__ = ["HELD", "CompressedStore", "Gathered", "HeadGroup", "SectionRead"]


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


class CompressedStore(Scores):
    """Page-arena storage for the compressed layers of one batch of sequences (`PageTable` for the arguments it
    shares).

    writer: an attention backend that writes the cache itself (`AttentionBackend.writes_cache`): `write` and
    `write_pages` hand it the bytes, after the store did the bookkeeping (pages reserved, slots counted). None: the
    torch writer here.
    key_ranges: (low, high) float32 [L, H, >= r_k] per-channel clip ranges of the stored keys (bundle
    `k.range_low` / `k.range_high`); required when a tier has static keys, ignored otherwise.
    levels: bundle tensors by name (`levels.k.{bits}`, `levels.v.{bits}`, float32 [L, H, 2**bits]); required for
    each calibrated side of a layer's formats, ignored otherwise.
    Every reader and writer takes the format from the page layout, so a layer's pages are self-describing.
    """

    def __init__(self, rank_k: torch.Tensor, rank_v: torch.Tensor, layers: list[int], *, high: TierFormat,
                 low: TierFormat, head_dim: int, batch: int, device: torch.device | str = "cpu",
                 page_bytes: int | None = None, raw16: torch.dtype = torch.float16, initial_pages: int = 1,
                 initial_tokens: int = 256, writer=None,
                 key_ranges: tuple[torch.Tensor, torch.Tensor] | None = None, low_tracked: bool = True,
                 low_of: Callable[[int, int], TierFormat] | None = None,
                 levels: dict[str, torch.Tensor] | None = None):
        if high.k_mode == "channel":
            raise ValueError("the high tier needs keys written token by token (per-token or static keys): it holds "
                             "the recent window")
        super().__init__(rank_k, rank_v, layers, high=high, low=low, head_dim=head_dim, batch=batch, device=device,
                         page_bytes=page_bytes, initial_pages=initial_pages, initial_tokens=initial_tokens,
                         low_tracked=low_tracked, low_of=low_of)
        self.writer = writer
        self.raw16 = raw16
        self.static_keys = self._static_keys(key_ranges, rank_k)
        formats = {layer: [g.layouts[side].fmt for g in self.groups[layer] for side in (HIGH, LOW)]
                   for layer in self.layers}
        self.levels = served_levels(levels, formats, *rank_k.shape, self.device)

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
        """What `codec.decode_pages` needs to read group g's keys on `side`: `static_key_params` for static keys, else
        None."""
        return self.static_key_params(layer, side, h, g.r_k) if g.layouts[side].fmt.k_mode == "static" else None

    def static_key_bytes(self) -> int:
        """Bytes of the static key (scale, zero) pairs: a fixed cost per model and tier format, not per token (fp16
        scale and zero per stored key channel of each (layer, KV head), per static tier)."""
        return sum(4 * int(self.rank_k_of(layer).sum()) for layer, _ in self.static_keys)

    def level_params(self, layer: int, side: int, h: torch.Tensor, fmt: TierFormat):
        """(key levels, value levels) float32 [n, 2**bits] of KV heads h [n] for tier format `fmt` on `side` of
        `layer`; None for a uniform side (what `codec.decode_pages` takes)."""
        return tuple(self.levels[layer, name, bits][h] if kind == "calibrated" else None
                     for name, bits, kind in (("k", fmt.k_bits, fmt.k_levels), ("v", fmt.v_bits, fmt.v_levels)))

    def level_bytes(self) -> int:
        """Bytes of the calibrated levels held (float32, one row per KV head per (layer, side, bits) in use)."""
        return sum(t.numel() * 4 for t in self.levels.values())

    def fixed_bytes(self) -> int:
        """The bundle's constants this store holds, a per-model cost apart from the pages: static key scales and
        calibrated levels."""
        return self.static_key_bytes() + self.level_bytes()

    # ------------------------------------------------------------------------------------------------- writing

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
            k_lut, v_lut = self.level_params(layer, side, h[sel], fmt)
            if fmt.k_mode == "static":
                scale, zero = self.static_key_params(layer, side, h[sel], g.r_k)
                self._put_bytes(base, idx, codec.encode_static_keys(k, scale, zero, fmt.k_bits, k_lut), lay.k_off,
                                lay.k_bytes)
            else:
                self._put_vectors(base, idx, k, fmt.k_bits, fmt.k_group, lay.k_off, lay.k_meta_off, lay.k_bytes,
                                  fmt.meta_bits, k_lut)
            self._put_vectors(base, idx, v, fmt.v_bits, fmt.v_group, lay.v_off, lay.v_meta_off, lay.v_bytes,
                              fmt.meta_bits, v_lut)
            if lay.tracked:
                self._flat(torch.float32)[(base + lay.score_off) // 4 + idx] = score[sel].float()
                self._flat(torch.int32)[(base + lay.pos_off) // 4 + idx] = pos[sel].to(torch.int32)

    def _put_vectors(self, base, idx, x, bits, group, off, meta_off, nbytes, meta_bits=16, levels=None) -> None:
        """Per-token vectors x float32 [n, r] (`codec.encode_tokens`; levels [n, 2**bits] or None) into slot idx [n]
        of the pages at byte offsets base [n]: codes at segment `off`, (scale, zero) bytes at `meta_off`."""
        data, meta = codec.encode_tokens(x, bits, group, meta_bits, self.raw16, levels)
        if meta is not None:                                                       # [n, groups * pair]
            width = meta.shape[1]
            self._flat(torch.uint8)[(base + meta_off)[:, None] + idx[:, None] * width
                                    + torch.arange(width, device=x.device)] = meta
        self._put_bytes(base, idx, data, off, nbytes)

    def _put_bytes(self, base, idx, data: torch.Tensor, off: int, nbytes: int) -> None:
        """data uint8 [n, nbytes] into slot idx [n] of the segment at `off` of the pages at byte offsets base [n]."""
        self._flat(torch.uint8)[(base + off)[:, None] + idx[:, None] * nbytes + torch.arange(nbytes,
                                                                                          device=data.device)] = data

    def write_pages(self, layer: int, b: torch.Tensor, h: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    pos: torch.Tensor, score: torch.Tensor) -> None:
        """Per-channel low tier: append one whole new low page per row (an entry's rows: its new pages, in row order).
        b, h [n]; keys [n, T, >= r_k]; values [n, T, >= r_v]; pos, score [n, T] (T = the group's low-page capacity)."""
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
            fmt = lay.fmt
            k_lut, v_lut = self.level_params(layer, LOW, hs, fmt)
            data, meta = codec.encode_channel_keys(keys[sel, :, :g.r_k].float(), fmt.k_bits, fmt.meta_bits, k_lut)
            ar = lambda n: torch.arange(n, device=self.device)                         # noqa: E731
            self._flat(torch.uint8)[(base + lay.k_off)[:, None] + ar(T * lay.k_bytes)] = data   # [n, T * k_bytes]
            self._flat(torch.uint8)[(base + lay.k_meta_off)[:, None] + ar(meta.shape[1])] = meta   # [n, r_k * pair]
            idx = ar(T).expand(len(bs), T).reshape(-1)
            v = values[sel, :, :g.r_v].reshape(-1, g.r_v).float()
            self._put_vectors(base.repeat_interleave(T), idx, v, fmt.v_bits, fmt.v_group, lay.v_off,
                              lay.v_meta_off, lay.v_bytes, fmt.meta_bits,
                              None if v_lut is None else v_lut.repeat_interleave(T, 0))
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
            self._reserve_next(layer, side, b, h, start)
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

    def _reserve_next(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, start: torch.Tensor) -> None:
        """Pages for one more slot at `start` [n] of each distinct entry (b, h) [n] on `side` (the `_room` bound
        spares the page tables most steps); the caller counts the slots (`fill`)."""
        for i, g in enumerate(self.groups[layer]):
            if self._room.get((layer, side, i), 0) < 1:
                sel = torch.isin(h, g.heads)
                if bool(sel.any()):
                    self.reserve_pages(layer, side, b[sel], h[sel], start[sel] + 1, g.layouts[side])
                self._room[layer, side, i] = self._free_slots(layer, side, g)
            self._room[layer, side, i] -= 1

    def insert(self, layer: int, side: int, b, h, keys, values, pos, score, every_entry: bool = False) -> None:
        """One token per entry (b, h distinct), per-token formats: reuse the entry's first hole, else append. pos
        [n] or one int for all. every_entry: (b, h) are `every_entry()` (the decode step), which allows the
        writer's fused insert (`_insert_every`), else the torch append (`_append_every`) where no entry has a hole."""
        assert side == HIGH or self.low.k_mode != "channel", "per-channel low pages are written whole"
        fused = getattr(self.writer, "insert_every", None)
        if every_entry and fused is not None and not self.arena.shared and isinstance(pos, int):
            self._insert_every(layer, side, fused, keys, values, pos, score)
            return
        if (layer, side) not in self._holey:                           # the common case: nothing to reuse
            if every_entry:
                self._append_every(layer, side, keys, values, pos, score)
            else:
                self.append(layer, side, b, h, keys, values, _positions(pos, len(b), self.device), score,
                            distinct=True)
            return
        # every entry: plain slices of the counts, no gathers
        at = (layer, slice(None), slice(None), side) if every_entry else (layer, b, h, side)
        if not bool((self.holes[at] > 0).any()):
            self.append(layer, side, b, h, keys, values, _positions(pos, len(b), self.device), score, distinct=True)
            return
        pos = _positions(pos, len(b), self.device)
        sec_pos = self.section_meta(layer, side, b, h)[1]                               # [n, S]
        fill = self.fill[at].reshape(-1).clone()            # a copy: `fill` is updated below
        holes = (sec_pos < 0) & (torch.arange(sec_pos.shape[1], device=self.device) < fill[:, None])
        has = holes.any(-1)
        if not self.arena.shared:
            # one write for both kinds of entry: hole fillers at their first hole, the others appended at `fill`
            new = ~has
            if bool(new.any()):
                self._reserve_next(layer, side, b[new], h[new], fill[new])
            self.fill[at] = (fill + new).view(self.fill[at].shape)
            self.holes[at] -= has.long().view(self.holes[at].shape)
            slot = torch.where(has, holes.to(torch.int8).argmax(-1), fill)
            self.write(layer, side, b, h, slot, keys, values, pos, score)
            return
        if bool(has.any()):       # shared pages: in two writes, so that copy on write picks as it always did
            slot = holes.to(torch.int8).argmax(-1)
            self.write(layer, side, b[has], h[has], slot[has], keys[has], values[has], pos[has], score[has])
            self.holes[layer, b[has], h[has], side] -= 1
        new = ~has
        if bool(new.any()):
            self.append(layer, side, b[new], h[new], keys[new], values[new], pos[new], score[new], distinct=True)

    def _insert_every(self, layer: int, side: int, fused, keys, values, pos: int, score) -> None:
        """`insert` of every entry through the writer's `insert_every` (the cpu backend): the writer finds each
        entry's slot, takes the new pages it needs from the free list and writes. Where the free list or a page-table
        row is too short, the entries that need a page get it here first (the arena grows), in the order `append`
        reserves them, so the pages are the ones the torch path takes."""
        while (need := fused(self, layer, side, keys, values, pos, score)) is not None:
            b, h = self.every_entry()
            nb, nh = b[need], h[need]
            for g, sel in self.group_rows(layer, nh):
                self.reserve_pages(layer, side, nb[sel], nh[sel], self.fill[layer, nb[sel], nh[sel], side] + 1,
                                   g.layouts[side])
        self._forget_room(layer, side)        # the `_room` bound was not kept: `_append_every` measures it again

    def _append_every(self, layer: int, side: int, keys, values, pos: int | torch.Tensor, score) -> None:
        """One token at the end of every entry's section (the decode step without holes): keys [B * H, >= r_k],
        values [B * H, >= r_v], score [B * H] in `every_entry` order; pos [B * H] or one int. The `_room` bound
        (free slots of the group's fullest entry) spares the page tables most steps."""
        for i, g in enumerate(self.groups[layer]):
            if self._room.get((layer, side, i), 0) < 1:
                gb, gh = self.entries(layer, g)
                self.reserve_pages(layer, side, gb, gh, self.fill[layer, gb, gh, side] + 1, g.layouts[side])
                self._room[layer, side, i] = self._free_slots(layer, side, g)
            self._room[layer, side, i] -= 1
        b, h = self.every_entry()
        start = self.fill[layer, :, :, side].reshape(-1).clone()
        self.fill[layer, :, :, side] += 1
        self.write(layer, side, b, h, start, keys, values, _positions(pos, len(b), self.device), score)

    def add_scores(self, layer: int, gathered: Gathered, delta: torch.Tensor) -> None:
        """score += delta [B, H, S] for every stored token of `gathered` (the same layer, unchanged since, gathered
        after `own_layer`: see `set_scores`)."""
        self.set_scores(layer, gathered.word, gathered.pos, gathered.score + delta)

    # ------------------------------------------------------------------------------------------------- reading

    def read(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor):
        """Dequantized (keys [n, r_k max], values [n, r_v max], score [n], pos [n]) of given slots."""
        n = len(b)
        keys = torch.zeros(n, self.r_k_max[layer], device=self.device)
        values = torch.zeros(n, self.r_v_max[layer], device=self.device)
        score, pos = torch.zeros(n, device=self.device), torch.full((n,), -1, dtype=torch.int64, device=self.device)
        for g, sel in self.group_rows(layer, h):
            lay = g.layouts[side]
            base, idx = self.page_of(layer, side, b[sel], h[sel], slot[sel], lay)
            scales = self._key_scales(layer, side, h[sel], g)
            luts = self.level_params(layer, side, h[sel], lay.fmt)
            if lay.fmt.k_mode != "channel":                   # per-token formats: only the slots' own bytes
                keys[sel, :g.r_k], values[sel, :g.r_v], score[sel], pos[sel] = self._read_slots(base, idx, lay,
                                                                                                scales, luts)
                continue
            pages = (base // self.page_bytes)[:, None]
            k, v, sc, ps = codec.decode_pages(self.arena.arena[pages], lay, self.raw16, scales, luts)   # [m, T, ...]
            pick = idx[:, None]
            keys[sel, :g.r_k] = k.gather(1, pick[..., None].expand(-1, -1, g.r_k)).squeeze(1)
            values[sel, :g.r_v] = v.gather(1, pick[..., None].expand(-1, -1, g.r_v)).squeeze(1)
            score[sel] = sc.gather(1, pick).squeeze(1)
            pos[sel] = ps.gather(1, pick).squeeze(1)
        return keys, values, score, pos

    def _read_slots(self, base: torch.Tensor, idx: torch.Tensor, lay, key_scales, luts=(None, None)):
        """`read` of per-token formats: slot idx [m] of the pages at byte offsets base [m] -> keys [m, r_k], values
        [m, r_v] float32, score [m], pos [m] int64 (decoded as `codec.decode_pages` decodes them, from those slots'
        bytes alone rather than their whole pages; luts: `level_params` of those slots' heads)."""
        fmt, pair = lay.fmt, lay.fmt.meta_pair_bytes

        def seg(off: int, nbytes: int) -> torch.Tensor:                             # uint8 [m, nbytes]
            return self._read_words(torch.uint8, (base + off + idx * nbytes)[:, None]
                                    + torch.arange(nbytes, device=self.device))

        def vectors(off, meta_off, nbytes, ngroups, bits, group, r, lut):
            meta = None if bits in RAW_BITS else seg(meta_off, ngroups * pair)
            return codec.decode_tokens(seg(off, nbytes), meta, bits, group, r, ngroups, fmt.meta_bits, self.raw16,
                                       lut)

        if fmt.k_mode == "static":
            keys = codec.decode_static_keys(seg(lay.k_off, lay.k_bytes), *key_scales, fmt.k_bits, lay.r_k, luts[0])
        else:
            keys = vectors(lay.k_off, lay.k_meta_off, lay.k_bytes, lay.k_groups, fmt.k_bits, fmt.k_group, lay.r_k,
                           luts[0])
        values = vectors(lay.v_off, lay.v_meta_off, lay.v_bytes, lay.v_groups, fmt.v_bits, fmt.v_group, lay.r_v,
                         luts[1])
        if not lay.tracked:
            return keys, values, torch.zeros(len(idx), device=self.device), torch.full_like(idx, HELD)
        return (keys, values, self._read_words(torch.float32, (base + lay.score_off) // 4 + idx),
                self._read_words(torch.int32, (base + lay.pos_off) // 4 + idx).long())

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
                k, v, score, pos = codec.decode_pages(self.arena.arena[pages.clamp(min=0)], lay, self.raw16,
                                                      self._key_scales(layer, side, h, g),
                                                      self.level_params(layer, side, h, lay.fmt))
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

    # ------------------------------------------------------------------------------------------------- accounting

    def held_bytes(self) -> int:
        """Every byte this store holds: the whole arena (free pages included), its tables, the fill and hole counts,
        and the bundle's constants (`fixed_bytes`: static key scales, calibrated levels)."""
        counts = sum(t.numel() * t.element_size() for t in (self.fill, self.holes))
        return self.arena.held_bytes() + counts + self.fixed_bytes()
