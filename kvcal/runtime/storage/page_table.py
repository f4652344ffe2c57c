"""The page table of a compressed store: which pages each (sequence, layer, KV head) entry holds, and how many slots
of each section are filled.

Per token and KV head, K after RoPE is kept as K·R[:, :r_k] and V as V·B[:, :r_v] (ranks per head from the bundle),
quantized at the token's tier. The high section of an entry grows from the left of its page-table row, the low
section from the right (`pages.py`); page byte layouts come from `layout.py`.

Heads of one layer may have different ranks and therefore different page layouts; heads sharing (r_k, r_v) form a
*group* and are processed together (vectorized over sequences and heads; a layer has at most H groups, usually one).
Rotated vectors are passed around zero-padded to the layer's largest rank, which leaves dot products unchanged.

Slots: a section's slot s lives in its page s // T at index s % T. `fill[layer, b, h, side]` counts slots ever
written; a slot below `fill` with position -1 is a hole (a pruned or moved token): `scores.py` keeps those.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcal.runtime.storage.layout import PageLayout, TierFormat, default_page_bytes
from kvcal.runtime.storage.pages import HIGH, LOW, PageArena


@dataclass
class HeadGroup:
    heads: torch.Tensor        # int64 [n] KV heads of this group
    layouts: tuple[PageLayout, PageLayout]   # (high, low)
    r_k: int
    r_v: int


class PageTable:
    """Page allocation and addressing for the compressed layers of one batch of sequences (no bytes are encoded
    here: `store.CompressedStore` does that).

    rank_k, rank_v: int [L, H] stored ranks per (layer, KV head); layers: indices of the layers stored here.
    low_tracked: False when low tokens never move (`CompressionConfig.low_tracked`): low pages then hold no score or
    position. low_of: (layer, KV head) -> that head's low-tier format (`CompressionConfig.low_of`); None: `low`
    everywhere. A layer's heads form one group per (key rank, value rank, low-tier format).

    Public addressing for backends: `entries` (the (sequence, head) pairs of a head group), `section_pages`,
    `page_of` (byte offset of a slot's page), `reserve_pages`, `reserve_low_page`.
    """

    def __init__(self, rank_k: torch.Tensor, rank_v: torch.Tensor, layers: list[int], *, high: TierFormat,
                 low: TierFormat, head_dim: int, batch: int, device: torch.device | str = "cpu",
                 page_bytes: int | None = None, initial_pages: int = 1, initial_tokens: int = 256,
                 low_tracked: bool = True, low_of: Callable[[int, int], TierFormat] | None = None):
        self.high, self.low = high, low
        self.layers = list(layers)
        self.batch, self.device = batch, torch.device(device)
        self.page_bytes = page_bytes or default_page_bytes(head_dim, high)
        L, H = rank_k.shape
        self.num_kv_heads = H
        self.groups: dict[int, list[HeadGroup]] = {}
        min_tokens = []
        for layer in self.layers:
            def key(h: int, layer: int = layer) -> tuple[int, int, TierFormat]:
                return int(rank_k[layer, h]), int(rank_v[layer, h]), low_of(layer, h) if low_of else low
            groups = []
            for r_k, r_v, fmt in sorted({key(h) for h in range(H)}, key=lambda k: (k[0], k[1], k[2].name)):
                heads = [h for h in range(H) if key(h) == (r_k, r_v, fmt)]
                lay = (PageLayout.build(high, r_k, r_v, self.page_bytes),
                       PageLayout.build(fmt, r_k, r_v, self.page_bytes, low_tracked))
                groups.append(HeadGroup(torch.tensor(heads, device=self.device), lay, r_k, r_v))
                min_tokens += [lay[HIGH].tokens, lay[LOW].tokens]
            self.groups[layer] = groups
        self.r_k_max = {layer: max(g.r_k for g in gs) for layer, gs in self.groups.items()}
        self.r_v_max = {layer: max(g.r_v for g in gs) for layer, gs in self.groups.items()}
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
        # (layer, side) -> arena word indices of every entry's slots (`Scores.section_scores`): the decode step reads
        # each layer's scores and positions twice per token, and the indices change only when pages are reserved,
        # copied or freed (`_forget_words` at each of those)
        self._words: dict[tuple[int, int], tuple] = {}     # `Scores._entry_words` of every entry, per (layer, side)

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

    def entries(self, layer: int, g: HeadGroup) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(g.heads)
        b = torch.arange(self.batch, device=self.device).repeat_interleave(n)
        return b, g.heads.repeat(self.batch)

    def group_rows(self, layer: int, h: torch.Tensor):
        """(head group, bool [n] rows of `h` [n] in it) for each group of `layer` that has rows in `h`."""
        for g in self.groups[layer]:
            sel = torch.isin(h, g.heads)
            if bool(sel.any()):
                yield g, sel

    def _flat(self, dtype: torch.dtype) -> torch.Tensor:
        return self.arena.arena.view(-1).view(dtype)

    def _read_words(self, dtype: torch.dtype, index: torch.Tensor) -> torch.Tensor:
        """`_flat(dtype)[index]` (index int64, any shape) through index_select: advanced indexing sets up over the
        whole arena and costs several times more on the small reads of a decode step."""
        return self._flat(dtype).index_select(0, index.reshape(-1)).view(index.shape)

    def page_of(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor,
                 lay: PageLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Byte offset of the page holding each slot, and the slot's index in that page; all [n]."""
        k = slot // lay.tokens
        col = k if side == HIGH else self.arena.max_pages_per_entry - 1 - k
        page = self.arena.page_table[b, layer, h, col].long()
        assert bool((page >= 0).all()), "slot without a page"
        return page * self.page_bytes, slot % lay.tokens

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

    # ------------------------------------------------------------------------------------------------- allocation

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
                self._forget_words()                  # every low page moved to the new right end of its row
            if need > self.arena.num_free:
                # geometric growth by an eighth: a growth copies the whole arena (tens of ms at 1k x 8 on 2 cores), so
                # it should be rare, but free pages are bytes the cache holds (`held_bytes`): doubling would let
                # them reach the bytes in use, and a fixed floor would be most of a short sequence's bytes
                self.arena.grow(max(need - self.arena.num_free, self.arena.num_pages // 8))
            self.arena.extend(b[nz], layer, h[nz], side, count[nz], need)     # checked above: no validation
            self._forget_words(layer, side)
        self.page_seconds += time.perf_counter() - t0

    def reserve_low_page(self, layer: int, b: torch.Tensor, h: torch.Tensor, lay: PageLayout) -> torch.Tensor:
        """Per-channel low tier: the bookkeeping of one whole new low page per row (b, h) [n] of one head group
        (pages allocated, slots counted as filled). An entry may appear in several rows: its new pages follow each
        other in row order. Returns each row's new page's byte offset [n] for the writer."""
        T = lay.tokens
        entry = b * self.num_kv_heads + h
        unique, first, count = torch.unique(entry, return_inverse=True, return_counts=True)
        if len(unique) == len(entry):                 # one page per entry (decode): no ranks to count
            start = self.fill[layer, b, h, LOW]
            self.reserve_pages(layer, LOW, b, h, start + T, lay)
            self.fill[layer, b, h, LOW] = start + T
        else:
            # the k-th row of an entry takes its k-th new page: k = the row's rank among its entry's rows
            order = torch.argsort(entry, stable=True)
            starts = torch.cumsum(count, 0) - count                                   # each entry's first sorted row
            k = torch.empty_like(entry)
            k[order] = torch.arange(len(entry), device=self.device) - starts.repeat_interleave(count)
            ub, uh = unique // self.num_kv_heads, unique % self.num_kv_heads
            before = self.fill[layer, ub, uh, LOW]
            self.reserve_pages(layer, LOW, ub, uh, before + count * T, lay)
            self.fill[layer, ub, uh, LOW] = before + count * T
            start = before[first] + k * T
        self._forget_room(layer, LOW)
        return self.page_of(layer, LOW, b, h, start, lay)[0]

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

    def _forget_words(self, layer: int | None = None, side: int | None = None) -> None:
        """Drop the cached slot words (`Scores.section_scores`) of (layer, side), of both sides of `layer`, or of
        everything (None): their pages changed."""
        if layer is None:
            self._words.clear()
            return
        for s in (HIGH, LOW) if side is None else (side,):
            self._words.pop((layer, s), None)

    # ------------------------------------------------------------------------------------------------- beams

    def _own(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor) -> None:
        """Copy on write before slots [n] of entries (b, h) change: pages that `select` left shared by several
        sequences are copied for the writer (PageArena.unshare). Nothing to do, and no sync, when none is shared."""
        if not self.arena.shared:
            return
        t0 = time.perf_counter()
        self._forget_words(layer)                     # copied pages get new ids
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
        self._forget_words(layer)                     # copied pages get new ids
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
        self._forget_words()
        return freed

    def release(self) -> int:
        """Return every page to the free list (the batch finished); returns the number of pages freed."""
        freed = self.arena.free_slots(torch.arange(self.batch, device=self.device))
        self.fill.zero_()
        self.holes.zero_()
        self._holey.clear()
        self._room.clear()
        self._forget_words()
        return freed

    # ------------------------------------------------------------------------------------------------- accounting

    def bytes_in_use(self) -> int:
        """Bytes of the pages this store holds (metadata and fragmentation included)."""
        return self.arena.used_bytes()

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
