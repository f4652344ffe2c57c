"""Closing the high sections' holes (`Scores.compact`): the same tokens, bytes as stored, in fewer pages; attention
reads them as before (up to float order); a decode whose per-channel low pages take a page of tokens out of the high
section at once leaves it without holes."""

import copy

import pytest
import torch
from conftest import decode_logits, make_model, random_bundle, random_text
from test_cpu_backend import TOL, assert_decode_matches, decode_inputs, random_store

from kvcal.runtime.backends import TorchBackend
from kvcal.runtime.backends.cpu.backend import CpuBackend
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.storage.layout import TierFormat
from kvcal.runtime.storage.pages import HIGH

pytestmark = pytest.mark.usefixtures("one_thread")


def _tokens(store, b, h):
    """Every live high token of entries (b, h), by (entry, position): (key, value, score), as the store reads them."""
    scores, pos = store.section_meta(0, HIGH, b, h)
    e, s = torch.nonzero(pos >= 0, as_tuple=True)
    k, v, sc, ps = store.read(0, HIGH, b[e], h[e], s)
    return {(int(i), int(p)): (k[j], v[j], sc[j]) for j, (i, p) in enumerate(zip(e, ps))}


def _decoded_store(steps: int):
    """The store of a tiny llama's cache after `steps` decode steps with per-channel low pages of 8 tokens."""
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    config = CompressionConfig(high=TierFormat.parse("K8V8"), low=TierFormat.parse("K4cV4"), page_tokens=8,
                               tiering=TieringConfig(window=4, alpha_high=2.0))
    ids = tok([random_text(80, seed=1), random_text(80, seed=2)], return_tensors="pt").input_ids[:, :72]
    cache = KvcalCache.from_bundle(bundle, model, config, raw_tokens=0)
    decode_logits(model, cache, ids, steps)
    return cache.kv.store


@pytest.mark.parametrize("high,low", [("K8V4", "K4cV2"), ("K16V16", "K2cV2m8"), ("K8nV8kg4m8", "K4cnV4nm8"),
                                      ("K4V2g4", "K4V2")])
def test_compact_keeps_every_token_in_fewer_pages(high, low):
    levels = None
    if "n" in high + low:
        from test_levels import bundle_levels

        levels = bundle_levels(1, 3)
    store = random_store(high, low, seed=3, max_high=60, holes=0.3, levels=levels)
    B, H = store.batch, store.num_kv_heads
    b, h = torch.arange(B).repeat_interleave(H), torch.arange(H).repeat(B)
    before, pages_before = _tokens(store, b, h), int(store.arena.num_pages_used[..., HIGH].sum())
    holes = int(store.holes[0, ..., HIGH].sum())
    assert holes > 0
    ref = copy.deepcopy(store)
    freed = store.compact(0, b, h)
    after = _tokens(store, b, h)
    assert after.keys() == before.keys()
    for key, (k, v, sc) in before.items():                  # bytes moved, not re-coded: the same values exactly
        assert all(torch.equal(x, y) for x, y in zip(after[key], (k, v, sc))), key
    live = torch.tensor([sum(1 for (e, _) in before if e == i) for i in range(B * H)])
    assert torch.equal(store.fill[0, b, h, HIGH], live) and int(store.holes[0, ..., HIGH].sum()) == 0
    per_page = {int(hh): g.layouts[HIGH].tokens for g in store.groups[0] for hh in g.heads}
    need = sum(-(-int(n) // per_page[int(hh)]) for n, hh in zip(live, h))
    assert int(store.arena.num_pages_used[..., HIGH].sum()) == need == pages_before - freed
    assert store.bytes_in_use() == ref.bytes_in_use() - freed * store.page_bytes
    q, kn, vn = decode_inputs(store, 2, 1)
    got, want = TorchBackend.attend(store, 0, q, kn, vn, 0.25), TorchBackend.attend(ref, 0, q, kn, vn, 0.25)
    torch.testing.assert_close(got[0], want[0], **TOL)      # the same tokens, summed in another order
    assert_decode_matches(store, 2, 1)                      # and the cpu kernel reads the compacted pages


@pytest.mark.parametrize("high,low", [("K8V4", "K4cV2"), ("K16V16", "K2cV2m8"), ("K4V2g4", "K4V2")])
def test_the_cpu_kernels_compact_moves_the_bytes_the_torch_compact_moves(high, low):
    """kvcal_compact_high pairs holes and live tokens as `_compact_torch` does: the same arena, fills, holes and
    pages, for all entries or some of them."""
    ref = random_store(high, low, seed=4, max_high=60, holes=0.3)
    assert int(ref.holes[0, ..., HIGH].sum()) > 0
    store = copy.deepcopy(ref)
    store.writer = CpuBackend
    b, h = ref.every_entry()
    for pick in (torch.tensor([1, 4]), torch.arange(len(b))):
        assert ref.compact(0, b[pick], h[pick]) == store.compact(0, b[pick], h[pick])
        assert torch.equal(store.arena.arena, ref.arena.arena)
        assert torch.equal(store.fill, ref.fill) and torch.equal(store.holes, ref.holes)
        assert torch.equal(store.arena.page_table, ref.arena.page_table)
    assert int(store.holes[0, ..., HIGH].sum()) == 0 and (0, HIGH) not in store._holey


@pytest.mark.parametrize("high,low", [("K8V4", "K4cV2"), ("K16V16", "K2cV2m8"), ("K8nV8kg4m8", "K4cnV4nm8")])
def test_the_cpu_kernels_seal_writes_the_torch_seals_bytes(high, low):
    """kvcal_seal_low_pages reads the high tokens as the torch store reads them (no fused multiply-add) and writes the
    low page `write_pages_torch` writes: after the seal and its compaction, the same arena, fills, holes, pages and
    free list."""
    from test_levels import bundle_levels

    ref = random_store(high, low, seed=6, max_high=60, holes=0.2, levels=bundle_levels(1, 3))
    store = copy.deepcopy(ref)
    store.writer = CpuBackend
    gen = torch.Generator().manual_seed(7)
    sealed = 0
    for g in ref.groups[0]:
        T = g.layouts[1].tokens
        b, h = ref.entries(0, g)
        pos = ref.section_meta(0, HIGH, b, h)[1]
        ready = (pos >= 0).sum(-1) >= T
        if not bool(ready.any()):
            continue
        key = torch.where(pos[ready] >= 0, torch.rand(pos[ready].shape, generator=gen), 2.0)
        slots = key.argsort(-1)[:, :T]                       # T live slots of each ready entry, in random order
        for s in (ref, store):
            s.seal_low_pages(0, b[ready], h[ready], slots)
        sealed += int(ready.sum())
    assert sealed > 0
    assert torch.equal(store.arena.arena, ref.arena.arena)
    assert torch.equal(store.fill, ref.fill) and torch.equal(store.holes, ref.holes)
    assert torch.equal(store.arena.page_table, ref.arena.page_table)
    assert (store.arena.num_free, store.arena.start) == (ref.arena.num_free, ref.arena.start)


def test_a_decode_with_per_channel_low_pages_leaves_no_high_holes():
    """Tokens that belong low wait high until a page of them exists, then leave together: without `compact`, a
    page of holes each time, which one new token per step could not fill."""
    store = _decoded_store(48)
    low_pages = int(store.arena.num_pages_used[..., 1].sum())
    assert low_pages > 0 and int(store.holes[..., HIGH].sum()) == 0


def test_compact_forgets_only_its_own_layers_high_words():
    """A compact frees pages of one layer's high sections only, so the cached slot words and room bounds of every
    other (layer, side) stay: forgetting them all made each later decode step rebuild them (1.27x dense at 4k on
    smollm2-135m's bundle against 1.14x, docs/runtime.md)."""
    store = _decoded_store(8)
    b, h = store.every_entry()
    layers = range(store.fill.shape[0])
    assert len(layers) > 1
    for layer in layers:
        for side in (HIGH, 1):
            store.section_scores(layer, side, b, h)
    cached = dict(store._words)
    with torch.inference_mode():                            # the cache's tensors are inference tensors
        store.compact(0, b, h)
    assert (0, HIGH) not in store._words
    assert store._words == {k: v for k, v in cached.items() if k != (0, HIGH)}
