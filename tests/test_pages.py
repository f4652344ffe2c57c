"""Tests for kvcal.runtime.storage.pages: bidirectional page tables over one arena with a circular free list."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcal.runtime.storage.pages import HIGH, LOW, PageArena


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def req(*rows):
    """rows of (slot, layer, head, side, count) -> five int64 tensors [n]."""
    cols = list(zip(*rows)) if rows else [[]] * 5
    return tuple(t(list(c)) for c in cols)


def snapshot(a: PageArena):
    return (a.free_list.clone(), a.start, a.num_free, a.page_table.clone(), a.num_pages_used.clone())


def assert_same_state(a: PageArena, snap) -> None:
    fl, start, num_free, pt, used = snap
    assert torch.equal(a.free_list, fl) and a.start == start and a.num_free == num_free
    assert torch.equal(a.page_table, pt) and torch.equal(a.num_pages_used, used)


class Model:
    """Pure-Python reference: a FIFO deque of free ids and per-entry lists of (high, low) ids in allocation order."""

    def __init__(self, num_pages: int):
        self.free = collections.deque(range(num_pages))
        self.pages = collections.defaultdict(lambda: ([], []))

    def allocate(self, rows) -> list[int]:
        out = []
        for s, l, h, side, c in rows:
            ids = [self.free.popleft() for _ in range(c)]
            self.pages[(s, l, h)][side].extend(ids)
            out.extend(ids)
        return out

    def free_last(self, rows) -> None:
        for s, l, h, side, c in rows:
            lst = self.pages[(s, l, h)][side]
            if c:
                self.free.extend(lst[-c:])
                del lst[-c:]

    def free_slots(self, slots) -> int:
        n = 0
        for key in sorted(k for k in self.pages if k[0] in set(slots)):  # (slot, layer, head) ascending
            high, low = self.pages.pop(key)
            self.free.extend(high + low[::-1])  # documented order: HIGH oldest first, then LOW newest first
            n += len(high) + len(low)
        return n

    def held(self, key) -> int:
        return sum(len(x) for x in self.pages.get(key, ([], [])))


def check_against_model(a: PageArena, m: Model) -> None:
    a.check_invariants()
    window = (a.start + torch.arange(a.num_free)) % a.num_pages
    assert a.free_list[window].tolist() == list(m.free)
    owned = a.page_table[a.page_table >= 0]
    assert a.num_free + owned.numel() == a.num_pages
    assert torch.unique(owned).numel() == owned.numel()
    for s in range(a.slots):
        for l in range(a.layers):
            for h in range(a.kv_heads):
                high, low = m.pages.get((s, l, h), ([], []))
                assert a.num_pages_used[s, l, h].tolist() == [len(high), len(low)]
                P = a.max_pages_per_entry
                row = a.page_table[s, l, h].tolist()
                assert row == high + [-1] * (P - len(high) - len(low)) + low[::-1]


# --------------------------------------------------------------------------- stateful random op sequences
S, L, H, P, N = 3, 2, 2, 5, 24
entry_keys = st.tuples(st.integers(0, S - 1), st.integers(0, L - 1), st.integers(0, H - 1),
                       st.sampled_from([HIGH, LOW]))


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = PageArena(N, 16, slots=S, layers=L, kv_heads=H, max_pages_per_entry=P)
        self.m = Model(N)

    @rule(data=st.data())
    def allocate(self, data):
        keys = data.draw(st.lists(entry_keys, unique=True, max_size=8))
        rows = [(*k, data.draw(st.integers(0, 3))) for k in keys]
        need = sum(r[4] for r in rows)
        per_entry = collections.Counter()
        for s, l, h, _, c in rows:
            per_entry[(s, l, h)] += c
        overflow = any(self.m.held(k) + c > P for k, c in per_entry.items())
        snap = snapshot(self.a)
        if need > len(self.m.free):
            with pytest.raises(RuntimeError, match="num_pages"):
                self.a.allocate(*req(*rows))
            assert_same_state(self.a, snap)
        elif overflow:
            with pytest.raises(ValueError, match="overflow"):
                self.a.allocate(*req(*rows))
            assert_same_state(self.a, snap)
        else:
            ids = self.a.allocate(*req(*rows))
            assert ids.dtype == torch.int32
            assert ids.tolist() == self.m.allocate(rows)

    @precondition(lambda self: any(self.m.held(k) for k in list(self.m.pages)))
    @rule(data=st.data())
    def free_last(self, data):
        held = [(s, l, h, side) for (s, l, h), lists in self.m.pages.items() for side in (HIGH, LOW) if lists[side]]
        keys = data.draw(st.lists(st.sampled_from(sorted(held)), unique=True, min_size=1, max_size=6))
        rows = [(s, l, h, side, data.draw(st.integers(0, len(self.m.pages[(s, l, h)][side]))))
                for s, l, h, side in keys]
        self.a.free_last(*req(*rows))
        self.m.free_last(rows)

    @rule(slots=st.lists(st.integers(0, S - 1), max_size=3))
    def free_slots(self, slots):
        assert self.a.free_slots(t(slots)) == self.m.free_slots(slots)

    @invariant()
    def consistent(self):
        check_against_model(self.a, self.m)


ArenaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestArenaMachine = ArenaMachine.TestCase


def test_random_batches_seeded():
    """Larger arena, seeded random batches (complements the shrinking state machine)."""
    rng = random.Random(0)
    a = PageArena(200, 8, slots=4, layers=3, kv_heads=2, max_pages_per_entry=12)
    m = Model(200)
    all_keys = [(s, l, h, d) for s in range(4) for l in range(3) for h in range(2) for d in (HIGH, LOW)]
    for _ in range(60):
        op = rng.random()
        if op < 0.55:
            rows = [(*k, rng.randint(0, 3)) for k in rng.sample(all_keys, rng.randint(0, 20))]
            per_entry = collections.Counter()
            for s, l, h, _, c in rows:
                per_entry[(s, l, h)] += c
            if sum(r[4] for r in rows) > len(m.free) or any(m.held(k) + c > 12 for k, c in per_entry.items()):
                with pytest.raises((RuntimeError, ValueError)):
                    a.allocate(*req(*rows))
            else:
                assert a.allocate(*req(*rows)).tolist() == m.allocate(rows)
        elif op < 0.9:
            keys = [k for k in all_keys if m.pages.get(k[:3], ([], []))[k[3]]]
            rows = [(*k, rng.randint(0, len(m.pages[k[:3]][k[3]]))) for k in rng.sample(keys, min(len(keys), 10))]
            a.free_last(*req(*rows))
            m.free_last(rows)
        else:
            slots = rng.sample(range(4), rng.randint(1, 2))
            assert a.free_slots(t(slots)) == m.free_slots(slots)
        check_against_model(a, m)


# --------------------------------------------------------------------------- targeted tests
def test_grow_table_keeps_every_page_on_its_side():
    """Widening the page table keeps each entry's high pages left and low pages right, in rank order, and later
    allocations and frees keep working against the model."""
    rng = random.Random(1)
    a = PageArena(300, 8, slots=2, layers=2, kv_heads=2, max_pages_per_entry=4)
    m = Model(300)
    all_keys = [(s, l, h, d) for s in range(2) for l in range(2) for h in range(2) for d in (HIGH, LOW)]
    for step in range(40):
        rows = [(*k, rng.randint(0, 2)) for k in rng.sample(all_keys, 4)]
        per_entry = collections.Counter()
        for s, l, h, _, c in rows:
            per_entry[(s, l, h)] += c
        need = max(m.held(k) + c for k, c in per_entry.items())
        if need > a.max_pages_per_entry:
            a.grow_table(need + step % 3)          # sometimes exactly enough, sometimes more
        assert a.allocate(*req(*rows)).tolist() == m.allocate(rows)
        if step % 5 == 4:
            keys = [k for k in all_keys if m.pages.get(k[:3], ([], []))[k[3]]]
            rows = [(*k, rng.randint(0, len(m.pages[k[:3]][k[3]]))) for k in rng.sample(keys, min(len(keys), 3))]
            a.free_last(*req(*rows))
            m.free_last(rows)
        check_against_model(a, m)
    assert a.max_pages_per_entry > 4


def test_exclusive_cumsum():
    off = PageArena.exclusive_cumsum(torch.tensor([3, 0, 2, 5], dtype=torch.int32))
    assert off.dtype == torch.int64 and off.tolist() == [0, 3, 3, 5]
    assert PageArena.exclusive_cumsum(torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_initial_state():
    a = PageArena(10, 32, slots=2, layers=3, kv_heads=4, max_pages_per_entry=6)
    assert a.arena.shape == (10, 32) and a.arena.dtype == torch.uint8 and not a.arena.any()
    assert a.free_list.dtype == torch.int32 and a.page_table.dtype == torch.int32
    assert a.page_table.shape == (2, 3, 4, 6) and a.num_pages_used.shape == (2, 3, 4, 2)
    assert a.num_free == 10 and a.num_used == 0 and a.used_bytes() == 0
    a.check_invariants()
    with pytest.raises(ValueError):
        PageArena(0, 32, slots=1, layers=1, kv_heads=1, max_pages_per_entry=1)


def test_wraparound_fifo():
    """Small arena, many rounds: start/end wrap several times and ids come back in exactly FIFO order."""
    n = 7
    a = PageArena(n, 4, slots=2, layers=1, kv_heads=2, max_pages_per_entry=n)
    expected = collections.deque(range(n))
    allocated_total, wraps, prev_start = 0, 0, 0
    rng = random.Random(1)
    for _ in range(40):
        c0, c1 = rng.randint(0, 3), rng.randint(0, 2)
        if c0 + c1 > a.num_free:
            c0, c1 = a.num_free, 0
        ids = a.allocate(t([0, 0]), t([0, 0]), t([0, 1]), t([HIGH, LOW]), t([c0, c1]))
        assert ids.tolist() == [expected.popleft() for _ in range(c0 + c1)]
        allocated_total += c0 + c1
        # free the newest HIGH pages of head 0 and the LOW pages of head 1 (in allocation order within each)
        f0 = rng.randint(0, int(a.num_pages_used[0, 0, 0, HIGH]))
        f1 = int(a.num_pages_used[0, 0, 1, LOW])
        freed = a.pages_of(t([0, 0]), t([0, 0]), t([0, 1]), t([HIGH, LOW]))
        want = freed[0, int(a.num_pages_used[0, 0, 0, HIGH]) - f0:int(a.num_pages_used[0, 0, 0, HIGH])].tolist()
        want += freed[1, :f1].tolist()
        a.free_last(t([0, 0]), t([0, 0]), t([0, 1]), t([HIGH, LOW]), t([f0, f1]))
        expected.extend(want)
        a.check_invariants()
        wraps += a.start < prev_start
        prev_start = a.start
    assert allocated_total > 3 * n and wraps >= 3
    window = (a.start + torch.arange(a.num_free)) % n
    assert a.free_list[window].tolist() == list(expected)


def test_exhaustion_raises_and_leaves_state_unchanged():
    a = PageArena(6, 4, slots=2, layers=1, kv_heads=1, max_pages_per_entry=6)
    a.allocate(t([0]), t([0]), t([0]), t([HIGH]), t([4]))
    snap = snapshot(a)
    with pytest.raises(RuntimeError, match="num_pages") as err:
        a.allocate(t([0, 1]), t([0, 0]), t([0, 0]), t([LOW, HIGH]), t([1, 2]))
    msg = str(err.value)
    assert "\n" not in msg and "3" in msg and "2 free" in msg
    assert_same_state(a, snap)
    a.check_invariants()
    assert a.allocate(t([1]), t([0]), t([0]), t([HIGH]), t([2])).tolist() == [4, 5]
    assert a.num_free == 0


def test_bidirectional_layout_and_overflow():
    a = PageArena(20, 4, slots=1, layers=1, kv_heads=1, max_pages_per_entry=6)
    z = t([0])
    h1 = a.allocate(z, z, z, t([HIGH]), t([2])).tolist()
    l1 = a.allocate(z, z, z, t([LOW]), t([1])).tolist()
    h2 = a.allocate(z, z, z, t([HIGH]), t([1])).tolist()
    l2 = a.allocate(z, z, z, t([LOW]), t([1])).tolist()
    high, low = h1 + h2, l1 + l2
    row = a.page_table[0, 0, 0].tolist()
    assert row[:3] == high and row[3] == -1
    assert [row[6 - 1 - k] for k in range(2)] == low  # k-th LOW page at P-1-k
    assert a.num_pages_used[0, 0, 0].tolist() == [3, 2]
    assert a.pages_of(z, z, z, t([HIGH])).tolist() == [high]
    assert a.pages_of(z, z, z, t([LOW])).tolist() == [low]
    assert a.pages_of(t([0, 0]), t([0, 0]), t([0, 0]), t([LOW, LOW])).tolist() == [low, low]  # reads may repeat
    snap = snapshot(a)
    for side in (HIGH, LOW):  # 3 + 2 + 2 > 6
        with pytest.raises(ValueError):
            a.allocate(z, z, z, t([side]), t([2]))
    with pytest.raises(ValueError):  # both sides in one call: 1 + 1 on top of 5 > 6
        a.allocate(t([0, 0]), t([0, 0]), t([0, 0]), t([HIGH, LOW]), t([1, 1]))
    assert_same_state(a, snap)
    a.allocate(z, z, z, t([LOW]), t([1]))  # exactly full is fine
    assert -1 not in a.page_table[0, 0, 0].tolist()
    a.free_last(t([0, 0]), t([0, 0]), t([0, 0]), t([HIGH, LOW]), t([1, 2]))
    assert a.pages_of(z, z, z, t([HIGH])).tolist() == [high[:2]]
    assert a.page_table[0, 0, 0].tolist() == high[:2] + [-1, -1, -1] + [low[0]]
    a.check_invariants()


def test_scale_one_call():
    """8 slots x 30 layers x 8 heads x 2 sides = 3840 requests in ONE allocate and ONE free_last call."""
    S_, L_, H_, P_ = 8, 30, 8, 8
    a = PageArena(12_000, 16, slots=S_, layers=L_, kv_heads=H_, max_pages_per_entry=P_)
    g = torch.Generator().manual_seed(0)
    s, l, h, d = (x.reshape(-1) for x in torch.meshgrid(torch.arange(S_), torch.arange(L_), torch.arange(H_),
                                                          torch.tensor([HIGH, LOW]), indexing="ij"))
    count = torch.randint(0, 4, (s.numel(),), generator=g)
    ids = a.allocate(s, l, h, d, count)
    total = int(count.sum())
    assert ids.shape == (total,) and a.num_free == 12_000 - total
    assert torch.equal(ids, torch.arange(total, dtype=torch.int32))  # fresh arena hands out 0..total-1 in order
    off = PageArena.exclusive_cumsum(count)
    pages = a.pages_of(s, l, h, d)
    width = pages.shape[1]
    assert width == int(count.max())
    k = torch.arange(width)
    want = torch.where(k < count[:, None], (off[:, None] + k).to(torch.int32), torch.tensor(-1, dtype=torch.int32))
    assert torch.equal(pages, want)
    assert torch.equal(a.num_pages_used.reshape(-1), count.to(torch.int32))
    a.check_invariants()

    free = (torch.rand(count.shape, generator=g) * (count + 1)).long().clamp(max=count)
    a.free_last(s, l, h, d, free)
    keep = count - free
    pages = a.pages_of(s, l, h, d)
    k = torch.arange(pages.shape[1])
    want = torch.where(k < keep[:, None], (off[:, None] + k).to(torch.int32), torch.tensor(-1, dtype=torch.int32))
    assert torch.equal(pages, want)
    assert a.num_free == 12_000 - int(keep.sum())
    a.check_invariants()
    assert a.free_slots(torch.arange(S_)) == int(keep.sum())
    assert a.num_free == 12_000
    a.check_invariants()


def test_free_slots_returns_everything():
    a = PageArena(30, 64, slots=3, layers=2, kv_heads=2, max_pages_per_entry=5)
    a.allocate(t([1, 1, 1, 1]), t([0, 0, 1, 1]), t([0, 1, 0, 1]), t([HIGH, LOW, HIGH, LOW]), t([2, 3, 1, 4]))
    assert a.used_bytes() == 10 * 64 and a.used_bytes(t([1])) == 10 * 64 and a.used_bytes(t([0, 2])) == 0
    assert a.free_slots(t([1, 1])) == 10  # duplicates ignored, no double free
    assert a.num_free == 30 and a.num_used == 0
    assert (a.page_table == -1).all() and (a.num_pages_used == 0).all()
    a.check_invariants()
    assert a.free_slots(t([0])) == 0 and a.free_slots(t([])) == 0
    for bad in (t([3]), t([-1]), t([[0]]), torch.tensor([0.0])):
        with pytest.raises(ValueError):
            a.free_slots(bad)
        with pytest.raises(ValueError):
            a.used_bytes(bad)


def test_free_slots_keeps_other_sequences():
    a = PageArena(30, 8, slots=3, layers=1, kv_heads=1, max_pages_per_entry=5)
    a.allocate(t([0, 1, 2]), t([0, 0, 0]), t([0, 0, 0]), t([HIGH, LOW, HIGH]), t([2, 3, 4]))
    before = a.page_table[[0, 2]].clone()
    assert a.free_slots(t([1])) == 3
    assert torch.equal(a.page_table[[0, 2]], before) and a.num_used == 6
    a.check_invariants()


def test_duplicate_entry_rejected():
    a = PageArena(10, 4, slots=2, layers=1, kv_heads=1, max_pages_per_entry=4)
    with pytest.raises(ValueError, match="more than once"):
        a.allocate(t([0, 0]), t([0, 0]), t([0, 0]), t([HIGH, HIGH]), t([1, 1]))
    a.allocate(t([0, 0]), t([0, 0]), t([0, 0]), t([HIGH, LOW]), t([1, 1]))  # different sides are fine
    with pytest.raises(ValueError, match="more than once"):
        a.free_last(t([0, 0]), t([0, 0]), t([0, 0]), t([LOW, LOW]), t([1, 0]))
    a.check_invariants()


@pytest.mark.parametrize("bad", [
    {"slot": t([2])}, {"layer": t([-1])}, {"head": t([1])}, {"side": t([2])}, {"count": t([-1])},
    {"count": t([1, 1])}, {"slot": torch.tensor([0.0])}, {"slot": t([[0]])},
])
def test_bad_arguments(bad):
    a = PageArena(10, 4, slots=2, layers=1, kv_heads=1, max_pages_per_entry=4)
    args = {"slot": t([0]), "layer": t([0]), "head": t([0]), "side": t([HIGH]), "count": t([1])}
    args.update(bad)
    snap = snapshot(a)
    with pytest.raises(ValueError):
        a.allocate(**args)
    assert_same_state(a, snap)


def test_free_last_too_many_rejected():
    a = PageArena(10, 4, slots=1, layers=1, kv_heads=2, max_pages_per_entry=4)
    a.allocate(t([0, 0]), t([0, 0]), t([0, 1]), t([HIGH, LOW]), t([2, 1]))
    snap = snapshot(a)
    with pytest.raises(ValueError):
        a.free_last(t([0, 0]), t([0, 0]), t([0, 1]), t([HIGH, LOW]), t([1, 2]))
    assert_same_state(a, snap)


def test_empty_batches():
    a = PageArena(4, 4, slots=1, layers=1, kv_heads=1, max_pages_per_entry=4)
    e = t([])
    assert a.allocate(e, e, e, e, e).numel() == 0
    a.free_last(e, e, e, e, e)
    assert a.pages_of(e, e, e, e).shape == (0, 0)
    z = t([0])
    assert a.pages_of(z, z, z, t([LOW])).shape == (1, 0)
    a.check_invariants()


def test_check_invariants_detects_corruption():
    a = PageArena(6, 4, slots=1, layers=1, kv_heads=1, max_pages_per_entry=4)
    a.allocate(t([0]), t([0]), t([0]), t([HIGH]), t([2]))
    a.page_table[0, 0, 0, 1] = a.free_list[a.start]  # page owned twice, one lost
    with pytest.raises(AssertionError):
        a.check_invariants()
    b = PageArena(6, 4, slots=1, layers=1, kv_heads=1, max_pages_per_entry=4)
    b.allocate(t([0]), t([0]), t([0]), t([HIGH]), t([2]))
    b.num_pages_used[0, 0, 0, HIGH] = 1  # count disagrees with the table
    with pytest.raises(AssertionError):
        b.check_invariants()


def test_device_follows_arena():
    a = PageArena(4, 4, slots=1, layers=1, kv_heads=1, max_pages_per_entry=4, device=torch.device("cpu"))
    for x in (a.arena, a.free_list, a.page_table, a.num_pages_used):
        assert x.device == a.device
    assert a.allocate(t([0]), t([0]), t([0]), t([LOW]), t([2])).device == a.device


def test_grow_keeps_pages_and_fifo_order():
    arena = PageArena(4, 16, slots=1, layers=1, kv_heads=1, max_pages_per_entry=8)
    one = torch.tensor([0])
    first = arena.allocate(one, one * 0, one * 0, torch.tensor([HIGH]), torch.tensor([3]))
    arena.arena[first.long()] = 7
    arena.free_last(one * 0, one * 0, one * 0, torch.tensor([HIGH]), torch.tensor([1]))   # frees first[2]
    arena.grow(3)
    assert arena.num_pages == 7 and arena.num_free == 5
    arena.check_invariants()
    more = arena.allocate(one * 0, one * 0, one * 0, torch.tensor([HIGH]), torch.tensor([5]))
    # the free window before growth (page 3, then the freed page) comes first, then the new pages
    assert more.tolist() == [3, int(first[2]), 4, 5, 6]
    assert (arena.arena[first[:2].long()] == 7).all()
    arena.check_invariants()


def test_select_slots_shares_pages_and_unshare_copies_on_write():
    """Beam search re-indexes page tables: repeated rows share pages (refs), unselected rows' pages are freed, and
    `unshare` gives a writer its own copy while the other holder keeps the original bytes."""
    a = PageArena(16, 8, slots=2, layers=1, kv_heads=1, max_pages_per_entry=4)
    ids = a.allocate(*req((0, 0, 0, HIGH, 2), (1, 0, 0, HIGH, 1), (1, 0, 0, LOW, 1)))
    a.arena[ids.long()] = torch.arange(4, dtype=torch.uint8)[:, None] + 1          # page i holds byte i + 1
    assert a.select_slots(t([1, 1, 1])) == 2                                       # slot 0's two pages freed
    a.check_invariants()
    assert a.slots == 3 and a.shared and a.num_used == 2
    assert a.refs[ids[2].long()] == 3 and a.refs[ids[3].long()] == 3
    before = a.arena[ids[2].long()].clone()
    assert a.unshare(t([0, 2]), t([0, 0]), t([0, 0]), t([HIGH, HIGH]), t([0, 0])) == 2   # slot 1 keeps the page
    a.check_invariants()
    assert a.page_table[1, 0, 0, 0] == ids[2] and a.refs[ids[2].long()] == 1
    for s in (0, 2):
        own = a.page_table[s, 0, 0, 0].long()
        assert own != ids[2] and torch.equal(a.arena[own], before)                # a byte copy of the shared page
    assert a.shared                                                                # the LOW page is still shared
    assert a.unshare(t([1]), t([0]), t([0]), t([HIGH]), t([0])) == 0               # already its own: no copy
    assert a.free_slots(t([0, 1, 2])) == 4 and a.num_free == 16
    a.check_invariants()
    with pytest.raises(ValueError, match="index out of range"):
        a.select_slots(t([3]))


@pytest.mark.parametrize("counts", [[1, 1, 1, 1], [2, 1, 3, 1]])
def test_extend_is_allocate_without_the_checks(counts):
    """The store's unchecked page append (PageArena.extend) leaves the same tables, counts, references and free list
    as `allocate`, on both sides, after earlier allocations."""
    arenas = [PageArena(64, 32, slots=2, layers=2, kv_heads=2, max_pages_per_entry=12) for _ in range(2)]
    slot, head = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1])
    count = torch.tensor(counts)
    for arena in arenas:
        arena.allocate(torch.tensor([1, 0]), torch.tensor([1, 1]), torch.tensor([0, 1]), torch.tensor([0, 1]),
                       torch.tensor([2, 1]))
    for side in (0, 1, 1):
        arenas[0].allocate(slot, torch.full((4,), 1), head, torch.full((4,), side), count)
        arenas[1].extend(slot, 1, head, side, count, int(count.sum()))
    a, b = arenas
    b.check_invariants()
    assert torch.equal(a.page_table, b.page_table) and torch.equal(a.num_pages_used, b.num_pages_used)
    assert torch.equal(a.refs, b.refs) and (a.start, a.num_free) == (b.start, b.num_free)
    assert int(b.num_pages_used[:, 1].sum()) == 3 + 3 * sum(counts)


@pytest.mark.parametrize("side", [HIGH, LOW])
def test_shrink_frees_what_free_last_frees(side):
    """`shrink` (no validation, no reference counting: unshared pages only) leaves the arena as `free_last` does:
    the same page-table cells cleared, counts, references and free list, ids in the same order."""
    rng = random.Random(side)
    a = PageArena(40, 4, slots=3, layers=2, kv_heads=2, max_pages_per_entry=8)
    for _ in range(3):                                   # interleaved allocations: each entry's ids are scattered
        rows = [(s, 1, h, side, rng.randint(1, 2)) for s in range(3) for h in range(2)]
        a.allocate(*req(*rows))
    b = PageArena(40, 4, slots=3, layers=2, kv_heads=2, max_pages_per_entry=8)
    for name in ("free_list", "page_table", "num_pages_used", "refs"):
        setattr(b, name, getattr(a, name).clone())
    b.start, b.num_free = a.start, a.num_free
    slot, head, count = t([0, 2, 1]), t([1, 0, 1]), t([2, 1, 3])
    a.free_last(slot, t([1, 1, 1]), head, t([side] * 3), count)
    b.shrink(slot, 1, head, side, count, int(count.sum()))
    assert_same_state(b, snapshot(a))
    assert torch.equal(b.refs, a.refs)
    b.check_invariants()
