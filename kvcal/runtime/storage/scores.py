"""Score and position words of the stored slots: what token policies read and change (cumulative significance,
cache index), the holes a drop leaves, and crop.

Each tracked page holds one float32 score and one int32 position per slot (`layout.py`); a slot below `fill` whose
position is -1 is a hole. High-section holes are reused by new tokens, and `compact` closes the many that a whole low
page leaves at once; per-channel low pages are written whole and never rewritten, so their holes stay until the
sequence ends.

An untracked low tier (`low_tracked=False`) stores no score or position: its tokens never move, so it has no holes.
Reads give its slots below the fill position `HELD` (a token is there; its cache index is not recorded) and score 0,
and their score word is -1 (`set_scores` skips it).
"""

from __future__ import annotations

import torch

from kvcal.runtime.storage.codec import HELD
from kvcal.runtime.storage.layout import PageLayout
from kvcal.runtime.storage.page_table import PageTable
from kvcal.runtime.storage.pages import HIGH


class Scores(PageTable):
    """The page table plus reads and writes of its slots' score and position words (module docstring)."""

    def section_meta(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor):
        """(score float32 [n, S], pos int64 [n, S]) of the entries' sections; pos -1 beyond `fill` and in holes.
        Reads only the score and position segments."""
        return self.section_scores(layer, side, b, h)[:2]

    def section_scores(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor):
        """`section_meta` and where each score lives: (score float32 [n, S], pos int64 [n, S], word int64 [n, S]
        the score's index in the arena as float32 words, for `set_scores`; -1 in an untracked tier). Slots with pos
        -1 hold no token: their score and word are not to be read. For every entry (`every_entry`'s own tensors, the
        decode step's read) the word indices are made once per page change (`_words`), not on every read."""
        every = self._every is not None and b is self._every[0] and h is self._every[1]
        if not every:
            words = self._entry_words(layer, side, b, h)
        elif (words := self._words.get((layer, side))) is None:
            words = self._words[layer, side] = self._entry_words(layer, side, b, h)
        score_at, pos_at, word, untracked = words
        score, pos = self._read_words(torch.float32, score_at), self._read_words(torch.int32, pos_at).long()
        if untracked is not None:
            score, pos = score.masked_fill(untracked, 0.0), pos.masked_fill(untracked, HELD)
        fill = self.fill[layer, :, :, side].reshape(-1, 1) if every else self.fill[layer, b, h, side][:, None]
        return score, torch.where(torch.arange(word.shape[1], device=self.device) < fill, pos, -1), word

    def _entry_words(self, layer: int, side: int, b: torch.Tensor, h: torch.Tensor):
        """Where `section_scores` reads for entries (b, h) [n], whatever the layer's head groups: (score word int64
        [n, S], position word int64 [n, S], both >= 0 so a gather can read them; the score word for `set_scores`,
        -1 in untracked rows; untracked rows bool [n, 1] or None). A row's slots past its group's pages read word 0
        and are masked by the fill."""
        groups = self.groups[layer]
        rows = [(groups[0], None)] if len(groups) == 1 else list(self.group_rows(layer, h))
        slots = [(sel, g.layouts[side], self._slot_words(self.section_pages(
            layer, side, *((b, h) if sel is None else (b[sel], h[sel]))), g.layouts[side])) for g, sel in rows]
        width = max((s.shape[1] for _, _, s in slots), default=0)
        score_at = torch.zeros((len(b), width), dtype=torch.int64, device=self.device)
        pos_at = torch.zeros_like(score_at)
        untracked = torch.zeros((len(b), 1), dtype=torch.bool, device=self.device)
        for sel, lay, s in slots:
            at = slice(None) if sel is None else sel
            if lay.tracked:
                score_at[at, :s.shape[1]] = s + lay.score_off // 4
                pos_at[at, :s.shape[1]] = s + lay.pos_off // 4
            else:
                untracked[at] = True
        if not bool(untracked.any()):
            return score_at, pos_at, score_at, None
        return score_at, pos_at, score_at.masked_fill(untracked, -1), untracked

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

    def set_scores(self, layer: int, word: torch.Tensor, pos: torch.Tensor, score: torch.Tensor) -> None:
        """Write `score` into the slots at score words `word` where pos >= 0 and word >= 0 (all the same shape). The
        words come from `gather` or `section_scores` of `layer` with no page change since, read after
        `own_layer(layer)`: copy on write moves a shared page, so words read before it would write into the page the
        other sequence keeps."""
        valid = (pos >= 0) & (word >= 0)
        self._flat(torch.float32)[word[valid]] = score[valid].float()

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
            self._flat(torch.int32).index_fill_(0, (base + lay.pos_off) // 4 + idx, -1)

    # ------------------------------------------------------------------------------------------------- crop

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
        self.holes[layer, b, h, HIGH] -= old - live                                     # trimmed slots were holes
        return self._trim_high(layer, b, h, live)

    def seal_low_pages(self, layer: int, b: torch.Tensor, h: torch.Tensor, slots: torch.Tensor) -> None:
        """Move high slots [e, T] of entries (b, h) [e] (distinct, of one head group; T its low pages' tokens) into one
        new per-channel low page per entry, and close the holes they leave (`compact`). The writer's kernel does the
        moves where it has one (the cpu backend), else torch reads, writes and drops them."""
        fused = getattr(self.writer, "seal_low_pages", None)
        per_token = all(g.layouts[HIGH].fmt.k_mode == "token" and g.layouts[HIGH].tracked for g in self.groups[layer])
        if fused is not None and per_token and not self.arena.shared:
            fused(self, layer, b, h, slots)
        else:
            e, T = slots.shape
            rb, rh = b.repeat_interleave(T), h.repeat_interleave(T)
            k, v, sc, ps = self.read(layer, HIGH, rb, rh, slots.reshape(-1))
            self.write_pages(layer, b, h, k.view(e, T, -1), v.view(e, T, -1), ps.view(e, T), sc.view(e, T))
            self.drop(layer, HIGH, rb, rh, slots.reshape(-1))
        self._holey.add((layer, HIGH))
        self.compact(layer, b, h)

    def compact(self, layer: int, b: torch.Tensor, h: torch.Tensor) -> int:
        """Close the holes of entries (b, h) [n] (distinct) in their high sections: each entry's newest tokens past
        its live count move, bytes as stored, into its holes below it, so the section is dense again, and the
        emptied tail pages are freed. A decode step reuses one hole per entry, but a per-channel low page takes a
        page of tokens out of the high section at once (`DiffKVTiers`), and those holes would stay. Slot order is
        not a token's order (every read goes by position), so only float order in attention changes. Returns the
        number of pages freed."""
        fused = getattr(self.writer, "compact_high", None)
        count = fused(self, layer, b, h) if fused is not None and not self.arena.shared else None
        if count is None:
            count = self._compact_torch(layer, b, h)
        self.holes[layer, b, h, HIGH] = 0
        if not bool(self.holes[layer, :, :, HIGH].any()):    # no hole left: inserts append again (`insert`)
            self._holey.discard((layer, HIGH))
        return self._trim_high(layer, b, h, count)

    def _compact_torch(self, layer: int, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """`compact`'s byte moves in torch; returns the entries' live counts [n]."""
        pos = self.section_meta(layer, HIGH, b, h)[1]                                    # [n, S]
        live = pos >= 0
        count = live.sum(-1)                                                             # new fill [n]
        at = torch.arange(pos.shape[1], device=self.device)
        # as many holes below an entry's count as live tokens at or past it: row-major order pairs them up
        he, hs = torch.nonzero(~live & (at < count[:, None]), as_tuple=True)
        te, ts = torch.nonzero(live & (at >= count[:, None]), as_tuple=True)
        if len(he):
            self._own(layer, HIGH, b[he], h[he], hs)
            flat = self._flat(torch.uint8)
            for g, sel in self.group_rows(layer, h[he]):
                lay = g.layouts[HIGH]
                src, i = self.page_of(layer, HIGH, b[te][sel], h[te][sel], ts[sel], lay)
                dst, j = self.page_of(layer, HIGH, b[he][sel], h[he][sel], hs[sel], lay)
                for off, row in _token_segments(lay):
                    cols = torch.arange(row, device=self.device)
                    flat[(dst + off + j * row)[:, None] + cols] = flat[(src + off + i * row)[:, None] + cols]
        return count

    def _trim_high(self, layer: int, b: torch.Tensor, h: torch.Tensor, fill: torch.Tensor) -> int:
        """Set the high sections' fill of entries (b, h) [n] to `fill` [n] (every slot past it empty) and free the
        pages past it. Returns the number of pages freed."""
        self.fill[layer, b, h, HIGH] = fill
        freed = 0
        for g, sel in self.group_rows(layer, h):
            T = g.layouts[HIGH].tokens
            gb, gh = b[sel], h[sel]
            extra = self.arena.num_pages_used[gb, layer, gh, HIGH].long() - (-(-fill[sel] // T))
            nz = extra > 0
            if bool(nz.any()):
                n, before = int(nz.sum()), self.arena.num_free
                if self.arena.shared:           # a page another sequence holds stays: counted references
                    self.arena.free_last(gb[nz], torch.full((n,), layer, device=self.device), gh[nz],
                                         torch.full((n,), HIGH, device=self.device), extra[nz])
                else:
                    self.arena.shrink(gb[nz], layer, gh[nz], HIGH, extra[nz], int(extra[nz].sum()))
                freed += self.arena.num_free - before
        self._forget_room(layer, HIGH)      # only this layer's high pages changed: the other bounds and words hold
        self._forget_words(layer, HIGH)
        return freed


def _token_segments(lay: PageLayout) -> list[tuple[int, int]]:
    """(offset, bytes per slot) of every segment a per-token layout stores per slot: codes, their pairs, score and
    position."""
    assert lay.fmt.k_mode != "channel", "per-channel pages are written whole"
    pair = lay.fmt.meta_pair_bytes
    segments = [(lay.k_off, lay.k_bytes), (lay.k_meta_off, lay.k_groups * pair), (lay.v_off, lay.v_bytes),
                (lay.v_meta_off, lay.v_groups * pair)]
    if lay.tracked:
        segments += [(lay.score_off, 4), (lay.pos_off, 4)]
    return [(off, row) for off, row in segments if row]
