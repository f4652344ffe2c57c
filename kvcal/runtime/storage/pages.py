"""Paged byte arena with bidirectional page tables and a circular free list (DiffKV, SOSP'25 §5).

Layout
------
* ``arena``: uint8 ``[num_pages, page_bytes]`` -- ONE byte arena shared by every sequence, layer, KV head and
  precision. A page holds a fixed number of tokens of one precision; the store module decides what the bytes mean.
* ``page_table``: int32 ``[slots, layers, kv_heads, P]`` (``P = max_pages_per_entry``), ``-1`` = empty. One row is
  the *bidirectional* entry of one (sequence slot, layer, KV head): HIGH-precision page ids fill from the left
  (``[..., 0:n_high]`` in allocation order), LOW-precision page ids from the right (the k-th LOW page sits at
  ``P-1-k``). The two sides share the P cells, so a head that keeps many high-precision tokens and one that keeps
  mostly low-precision tokens both fit in the same fixed row width; only ``n_high + n_low <= P`` is required.
* ``num_pages_used``: int32 ``[slots, layers, kv_heads, 2]`` -- (n_high, n_low) of every entry.
* ``refs``: int32 ``[num_pages]`` -- how many page-table cells point at each page. A page is normally owned by one
  cell; `select_slots` (beam search, batch selection) copies page-table rows, so beams that share a prefix share its
  pages (refs > 1) and no byte is copied. A writer must call `unshare` on a page before changing it (copy on write);
  a page returns to the free list when its last cell lets go of it.
* ``free_list``: int32 ``[num_pages]``, a circular buffer. The free ids occupy positions ``start, start+1, ...,
  start+num_free-1`` (mod ``num_pages``). Allocation pops from ``start``; freeing pushes at the end pointer
  ``(start + num_free) % num_pages``. Pages are therefore reused in FIFO order.

Batched operations
------------------
``allocate`` / ``free_last`` / ``free_slots`` serve many (slot, layer, head, side) requests in one call without a
Python loop: an exclusive prefix sum over the per-request counts gives each request a disjoint range of the free
list (``offsets[i] .. offsets[i]+count[i]``), ``repeat_interleave`` expands requests to pages, and advanced
indexing scatters the ids into the page tables. Only a handful of scalar host syncs remain per call (the total page
count is needed to size the outputs and to check for exhaustion).
"""

from __future__ import annotations

import torch

HIGH, LOW = 0, 1  # page-table sides (last index of num_pages_used)

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class PageArena:
    """Fixed-size page allocator over one byte arena; see the module docstring for the layout."""

    def __init__(self, num_pages: int, page_bytes: int, *, slots: int, layers: int, kv_heads: int,
                 max_pages_per_entry: int, device: torch.device | str = "cpu"):
        for name, value in (("num_pages", num_pages), ("page_bytes", page_bytes), ("slots", slots),
                            ("layers", layers), ("kv_heads", kv_heads), ("max_pages_per_entry", max_pages_per_entry)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_pages, self.page_bytes = int(num_pages), int(page_bytes)
        self.slots, self.layers, self.kv_heads = int(slots), int(layers), int(kv_heads)
        self.max_pages_per_entry = int(max_pages_per_entry)
        self.device = torch.device(device)
        self.arena = torch.zeros(self.num_pages, self.page_bytes, dtype=torch.uint8, device=self.device)
        self.free_list = torch.arange(self.num_pages, dtype=torch.int32, device=self.device)
        self.start = 0
        self.num_free = self.num_pages
        shape = (self.slots, self.layers, self.kv_heads)
        self.page_table = torch.full((*shape, self.max_pages_per_entry), -1, dtype=torch.int32, device=self.device)
        self.num_pages_used = torch.zeros((*shape, 2), dtype=torch.int32, device=self.device)
        self.refs = torch.zeros(self.num_pages, dtype=torch.int32, device=self.device)
        self.shared = False      # some page may have refs > 1 (cleared by `unshare` once none has)
        self.copied = 0          # pages copied on write so far (experiments/beams_crop.py reports it)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
        """offsets int64 [n]: offsets[i] = sum(counts[:i]) -- start of request i's disjoint range."""
        counts = counts.to(torch.int64)
        return torch.cumsum(counts, 0) - counts

    @property
    def end(self) -> int:
        """Recycling pointer: position where the next freed page id is written."""
        return (self.start + self.num_free) % self.num_pages

    def _requests(self, slot, layer, head, side, count=None, *, unique: bool = True):
        """Validate a batch of requests; returns int64 tensors [n] on the arena's device (+ flat entry ids)."""
        names = ("slot", "layer", "head", "side") + (("count",) if count is not None else ())
        values = (slot, layer, head, side) + ((count,) if count is not None else ())
        out = []
        for name, value in zip(names, values):
            t = torch.as_tensor(value, device=self.device)
            if t.dtype not in _INT_DTYPES:
                raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
            if t.dim() != 1:
                raise ValueError(f"{name} must be 1-D [n], got shape {tuple(t.shape)}")
            out.append(t.to(torch.int64))
        if len({t.shape[0] for t in out}) != 1:
            raise ValueError(f"request tensors must have equal shapes, got {[tuple(t.shape) for t in out]}")
        # One host sync for all range checks instead of one per argument.
        limits = (self.slots, self.layers, self.kv_heads, 2) + ((None,) if count is not None else ())
        bad = torch.stack([((t < 0) | (t >= hi)).any() if hi is not None else (t < 0).any()
                           for t, hi in zip(out, limits)]).tolist()
        for name, hi, is_bad in zip(names, limits, bad):
            if is_bad:
                raise ValueError(f"{name} out of range [0, {hi if hi is not None else 'inf'})")
        s, l, h, sd = out[:4]
        entry = (s * self.layers + l) * self.kv_heads + h  # flat (slot, layer, head) id
        # A repeated entry/side would get two overlapping column ranges (or free the same pages twice).
        if unique and torch.unique(entry * 2 + sd).numel() != entry.numel():
            raise ValueError("the same (slot, layer, head, side) appears more than once in one call")
        return (*out, entry)

    def _slot_ids(self, slots) -> torch.Tensor:
        """Validate sequence slots (integer [k]); returns the distinct ones, int64, on the arena's device."""
        s = torch.as_tensor(slots, device=self.device)
        if s.dtype not in _INT_DTYPES or s.dim() != 1:
            raise ValueError(f"slots must be a 1-D integer tensor, got dtype {s.dtype} shape {tuple(s.shape)}")
        s = torch.unique(s.to(torch.int64))  # a duplicate slot would otherwise free (or count) its pages twice
        if s.numel() and bool(((s < 0) | (s >= self.slots)).any()):
            raise ValueError(f"slots out of range [0, {self.slots})")
        return s

    def _expand(self, count: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-page request index and rank within its request, both int64 [total]."""
        n = count.numel()
        req = torch.repeat_interleave(torch.arange(n, device=self.device), count, output_size=total)
        j = torch.arange(total, device=self.device) - self.exclusive_cumsum(count)[req]
        return req, j

    def _column(self, side: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Page-table column of the k-th page (allocation order) of a side: HIGH -> k, LOW -> P-1-k."""
        return torch.where(side == HIGH, k, self.max_pages_per_entry - 1 - k)

    def _release(self, ids: torch.Tensor) -> int:
        """Drop one reference per id (int [m], repeats allowed); pages left with none join the free list, in the
        order of their first occurrence in `ids`. Returns the number of pages freed."""
        if ids.numel() == 0:
            return 0
        ids = ids.to(torch.int64)
        self.refs.index_add_(0, ids, torch.full_like(ids, -1, dtype=torch.int32))
        assert bool((self.refs[ids] >= 0).all()), "freeing more pages than exist: double free"
        uniq, inv = torch.unique(ids, return_inverse=True)
        first = torch.full((uniq.numel(),), ids.numel(), dtype=torch.int64, device=self.device)
        first.scatter_reduce_(0, inv, torch.arange(ids.numel(), device=self.device), "amin")
        ids = ids[first.sort().values]                      # distinct, in order of first occurrence
        ids = ids[self.refs[ids] == 0]
        self._push_free(ids)
        return ids.numel()

    def _pop_free(self, total: int) -> torch.Tensor:
        """Take `total` ids (int32) from the start of the free list, with one reference each."""
        pos = (self.start + torch.arange(total, device=self.device)) % self.num_pages
        ids = self.free_list[pos]
        self.refs[ids.long()] = 1
        self.start = (self.start + total) % self.num_pages
        self.num_free -= total
        return ids

    def _push_free(self, ids: torch.Tensor) -> None:
        """Append ids (int32 [m]) to the free list at the end pointer."""
        m = ids.numel()
        assert self.num_free + m <= self.num_pages, "freeing more pages than exist: double free"
        pos = (self.end + torch.arange(m, device=self.device)) % self.num_pages
        self.free_list[pos] = ids.to(torch.int32)
        self.num_free += m

    def grow(self, extra_pages: int) -> None:
        """Add `extra_pages` zeroed pages at the end of the arena; they join the free list after the current free
        pages (FIFO order is kept). Page ids, tables and contents of pages in use are unchanged."""
        if extra_pages < 1:
            raise ValueError(f"extra_pages must be >= 1, got {extra_pages}")
        free_ids = self.free_list[(self.start + torch.arange(self.num_free, device=self.device)) % self.num_pages]
        new_ids = torch.arange(self.num_pages, self.num_pages + extra_pages, dtype=torch.int32, device=self.device)
        arena = torch.zeros(self.num_pages + extra_pages, self.page_bytes, dtype=torch.uint8, device=self.device)
        arena[:self.num_pages] = self.arena          # one copy (torch.cat also copied the zeroed new pages)
        self.arena = arena
        self.refs = torch.cat([self.refs, torch.zeros(extra_pages, dtype=torch.int32, device=self.device)])
        self.num_pages += extra_pages
        self.free_list = torch.zeros(self.num_pages, dtype=torch.int32, device=self.device)
        self.free_list[:self.num_free + extra_pages] = torch.cat([free_ids, new_ids])
        self.start, self.num_free = 0, self.num_free + extra_pages

    def grow_table(self, max_pages_per_entry: int) -> None:
        """Widen every page-table row to `max_pages_per_entry` columns. High pages keep their columns; low pages move
        to the new right end, so each page keeps its rank k on its side. Page ids and contents are unchanged."""
        P, Q = self.max_pages_per_entry, int(max_pages_per_entry)
        if Q <= P:
            return
        col = torch.arange(P, device=self.device)
        n_high, n_low = self.num_pages_used[..., HIGH, None], self.num_pages_used[..., LOW, None]
        table = torch.full((*self.page_table.shape[:-1], Q), -1, dtype=torch.int32, device=self.device)
        table[..., :P] = torch.where(col < n_high, self.page_table, -1)
        low = torch.where(col >= P - n_low, self.page_table, -1)      # n_high + n_low <= P: no row overlaps
        table[..., Q - P:] = torch.where(low >= 0, low, table[..., Q - P:])
        self.page_table, self.max_pages_per_entry = table, Q

    # ------------------------------------------------------------------ batched operations
    def allocate(self, slot, layer, head, side, count) -> torch.Tensor:
        """Append ``count[i]`` pages to side ``side[i]`` of entry (slot[i], layer[i], head[i]).

        All arguments are integer tensors [n]; an entry/side may appear at most once per call (ValueError). Returns
        the new page ids int32 [sum(count)] in request order: request i owns ``ids[offsets[i]:offsets[i]+count[i]]``
        with ``offsets = exclusive_cumsum(count)``. RuntimeError if the arena has too few free pages, ValueError if an
        entry would exceed ``max_pages_per_entry``; in both cases nothing changes. Pages are not zeroed.
        """
        slot, layer, head, side, count, entry = self._requests(slot, layer, head, side, count)
        total = int(count.sum().item()) if count.numel() else 0
        if total > self.num_free:
            raise RuntimeError(f"page arena exhausted: {total} pages needed, {self.num_free} free of "
                               f"{self.num_pages}; raise `num_pages`")
        # Overflow check per entry, summing both sides: HIGH and LOW requests of one entry may share a call.
        used = self.num_pages_used.view(-1, 2).to(torch.int64)
        uniq, inv = torch.unique(entry, return_inverse=True)
        after = used[uniq].sum(-1).index_add_(0, inv, count)
        if bool((after > self.max_pages_per_entry).any()):
            raise ValueError(f"page-table entry overflow: n_high + n_low would exceed max_pages_per_entry="
                             f"{self.max_pages_per_entry}")
        if total == 0:
            return torch.empty(0, dtype=torch.int32, device=self.device)
        some = count > 0                             # requests for no page change nothing
        return self._place(slot[some], layer[some], head[some], side[some], count[some], total)

    def extend(self, slot: torch.Tensor, layer: int, head: torch.Tensor, side: int, count: torch.Tensor,
               total: int) -> None:
        """`allocate` for a caller that has checked its requests itself (CompressedStore.reserve_pages, every page
        boundary of a decode): distinct entries (slot, head) [n] of one layer and side, count int64 [n] >= 1 summing
        to `total`, room in their rows and on the free list. No validation and no host sync: `allocate`'s checks
        cost more than the allocation, and they ran once per layer at each page boundary."""
        self._place(slot, layer, head, side, count, total)

    def _place(self, slot, layer, head, side, count: torch.Tensor, total: int) -> torch.Tensor:
        """Append count[i] >= 1 pages, `total` in all, to side[i] of entry (slot[i], layer[i], head[i]); layer and
        side may also be ints shared by every request. The requests are checked (distinct entries, room). Returns the
        page ids int32 [total] in request order: request i's j-th page is free-list slot start + offsets[i] + j."""
        k = self.num_pages_used[slot, layer, head, side].to(torch.int64)     # rank of each request's first new page
        rows = (slot, layer, head, side)
        if total != len(count):                      # (counts >= 1) an entry takes several pages: one row per page
            req, j = self._expand(count, total)
            rows = tuple(x[req] if torch.is_tensor(x) and x.dim() else x for x in rows)
            k = k[req] + j
        ids = self._pop_free(total)
        s, lay, h, sd = rows
        self.page_table[s, lay, h, self._column(torch.as_tensor(sd, device=self.device), k)] = ids
        self.num_pages_used[slot, layer, head, side] += count.to(torch.int32)  # entries are unique: no collisions
        return ids

    def free_last(self, slot, layer, head, side, count) -> None:
        """Return the last (most recently allocated) ``count[i]`` pages of each entry's side to the free list.

        Freed ids are appended at the end pointer in request order and, within a request, in allocation order.
        ValueError if ``count`` exceeds the pages on that side (nothing changes). Page-table cells become -1.
        """
        slot, layer, head, side, count, _ = self._requests(slot, layer, head, side, count)
        used = self.num_pages_used[slot, layer, head, side].to(torch.int64)
        if bool((count > used).any()):
            raise ValueError("free_last: count exceeds the pages held on that side of the entry")
        total = int(count.sum().item()) if count.numel() else 0
        if total == 0:
            return
        req, j = self._expand(count, total)
        k = (used - count)[req] + j  # ranks used-count .. used-1, oldest first
        idx = (slot[req], layer[req], head[req], self._column(side[req], k))
        ids = self.page_table[idx]
        self.page_table[idx] = -1
        self.num_pages_used[slot, layer, head, side] -= count.to(torch.int32)
        self._release(ids)

    def shrink(self, slot: torch.Tensor, layer: int, head: torch.Tensor, side: int, count: torch.Tensor,
               total: int) -> None:
        """`free_last` for a caller that has checked its requests itself (Scores._trim_high, after each compaction of
        a decode): distinct entries (slot, head) [n] of one layer and side, count int64 [n] >= 1 summing to `total`,
        at most their pages, none of them shared. The same pages join the free list in the same order, without
        `free_last`'s validation and reference counting."""
        used = self.num_pages_used[slot, layer, head, side].to(torch.int64)
        req, j = self._expand(count, total)
        k = (used - count)[req] + j                         # ranks used-count .. used-1, oldest first
        col = k if side == HIGH else self.max_pages_per_entry - 1 - k
        rows = (slot[req], layer, head[req], col)
        ids = self.page_table[rows]
        self.page_table[rows] = -1
        self.num_pages_used[slot, layer, head, side] -= count.to(torch.int32)
        self.refs[ids.long()] = 0
        self._push_free(ids)

    def free_slots(self, slots) -> int:
        """Return every page of the given sequence slots (int tensor [k]; duplicates ignored) to the free list.

        Freed ids are appended in (slot ascending, layer, head, column) order: per entry the HIGH pages oldest first,
        then the LOW pages newest first (a page another slot still shares stays). Page-table rows become -1 and counts
        0. Returns the number of pages freed.
        """
        s = self._slot_ids(slots)
        rows = self.page_table[s]  # [k, layers, kv_heads, P]
        ids = rows[rows >= 0]
        self.page_table[s] = -1
        self.num_pages_used[s] = 0
        return self._release(ids)

    def select_slots(self, index) -> int:
        """New slot i takes old slot index[i]'s page-table rows (int [k], repeats allowed, k may differ from the
        slot count): beam-search reordering, batch selection and repetition. No page byte moves: pages used by
        several new slots are shared (`refs`), pages no new slot uses are freed. Returns the number freed."""
        index = torch.as_tensor(index, device=self.device)
        if index.dtype not in _INT_DTYPES or index.dim() != 1 or index.numel() == 0:
            raise ValueError(f"index must be a non-empty 1-D integer tensor, got dtype {index.dtype} shape "
                             f"{tuple(index.shape)}")
        index = index.to(torch.int64)
        if bool(((index < 0) | (index >= self.slots)).any()):
            raise ValueError(f"index out of range [0, {self.slots})")
        old = self.page_table[self.page_table >= 0]
        self.page_table, self.num_pages_used = self.page_table[index], self.num_pages_used[index]
        self.slots = index.numel()
        new = self.page_table[self.page_table >= 0].long()
        self.refs.index_add_(0, new, torch.ones_like(new, dtype=torch.int32))   # take the new references first,
        freed = self._release(old)                                              # so kept pages never reach 0
        self.shared = bool((self.refs > 1).any())
        return freed

    def unshare(self, slot, layer, head, side, k) -> torch.Tensor:
        """Copy on write: make the k-th page (allocation order) on `side` of each entry (slot, layer, head) its own
        before the caller changes it. All arguments int [n] (repeats allowed). A page shared by m cells is copied
        for all but one of them, only for writers that share it; returns the number of pages copied."""
        if not self.shared:
            return 0
        slot, layer, head, side, k = (torch.as_tensor(t, device=self.device).to(torch.int64)
                                      for t in (slot, layer, head, side, k))
        col = self._column(side, k)
        cell = ((slot * self.layers + layer) * self.kv_heads + head) * self.max_pages_per_entry + col
        cell = torch.unique(cell)
        ids = self.page_table.view(-1)[cell].long()
        assert bool((ids >= 0).all()), "unshare of a cell without a page"
        ids, order = ids.sort(stable=True)
        cell = cell[order]
        uniq, inv, counts = torch.unique_consecutive(ids, return_inverse=True, return_counts=True)
        rank = torch.arange(ids.numel(), device=self.device) - (torch.cumsum(counts, 0) - counts)[inv]
        # the j-th writer of a page with r references copies it if j < r - 1: one holder (writer or not) keeps it
        copy = rank < (self.refs[ids] - 1)
        n = int(copy.sum())
        if n:
            if n > self.num_free:         # grow as the store does for new tokens (CompressedStore.reserve_pages)
                self.grow(max(n - self.num_free, self.num_pages // 2, 16))
            fresh = self._pop_free(n)
            self.arena[fresh.long()] = self.arena[ids[copy]]
            self.refs.index_add_(0, ids[copy], torch.full((n,), -1, dtype=torch.int32, device=self.device))
            self.page_table.view(-1)[cell[copy]] = fresh
            self.copied += n
        if not bool((self.refs > 1).any()):
            self.shared = False
        return n

    # ------------------------------------------------------------------ queries
    def pages_of(self, slot, layer, head, side) -> torch.Tensor:
        """Page ids int32 [n, Pn] of the entries' side in allocation order, padded with -1 (Pn = max count)."""
        slot, layer, head, side, _ = self._requests(slot, layer, head, side, unique=False)  # reads may repeat
        used = self.num_pages_used[slot, layer, head, side].to(torch.int64)
        width = int(used.max().item()) if used.numel() else 0
        k = torch.arange(width, device=self.device).expand(used.numel(), width)
        cols = self._column(side[:, None], k)
        ids = self.page_table[slot[:, None], layer[:, None], head[:, None], cols]
        return torch.where(k < used[:, None], ids, torch.full_like(ids, -1))

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def held_bytes(self) -> int:
        """Every byte this allocator holds: the whole arena (pages in use and free pages) and its tables."""
        return sum(t.numel() * t.element_size() for t in (self.arena, self.free_list, self.page_table,
                                                          self.num_pages_used, self.refs))

    def used_bytes(self, slots=None) -> int:
        """Bytes of arena pages held in total, or by the given slots (int tensor [k], duplicates ignored)."""
        if slots is None:
            return self.num_used * self.page_bytes
        s = self._slot_ids(slots)
        return int(self.num_pages_used[s].sum().item()) * self.page_bytes

    def check_invariants(self) -> None:
        """Assert the allocator state is consistent (tests and debugging; syncs and scans everything)."""
        n, P = self.num_pages, self.max_pages_per_entry
        assert 0 <= self.start < n and 0 <= self.num_free <= n, (self.start, self.num_free)
        free = self.free_list[(self.start + torch.arange(self.num_free, device=self.device)) % n].to(torch.int64)
        owned = self.page_table[self.page_table >= 0].to(torch.int64)
        assert bool(((owned >= 0) & (owned < n)).all()) and bool(((free >= 0) & (free < n)).all()), "page id range"
        cells = torch.bincount(owned, minlength=n)
        assert torch.equal(cells, self.refs.to(torch.int64)), "refs do not count the page-table cells"
        assert self.shared or bool((cells <= 1).all()), "a page is shared but `shared` is off"
        every = torch.cat([free, torch.unique(owned)])
        assert every.numel() == n, f"{free.numel()} free + {torch.unique(owned).numel()} in tables != {n} pages"
        assert bool((torch.bincount(every, minlength=n) == 1).all()), "a page is both free and owned, or lost"
        n_high, n_low = self.num_pages_used[..., HIGH, None], self.num_pages_used[..., LOW, None]
        assert bool((self.num_pages_used >= 0).all()) and bool((n_high + n_low <= P).all()), "bad page counts"
        col = torch.arange(P, device=self.device)
        expected = (col < n_high) | (col >= P - n_low)  # cells that must hold a page
        assert torch.equal(self.page_table >= 0, expected), "page table does not match num_pages_used"
