"""CpuBackend (the fused C++/OpenMP kernels) against the torch reference: decode attention and fused score updates at
every tier format, token writes byte for byte, whole decodes with tier moves / FastGen / ragged ranks, selection."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import make_model, random_bundle, random_text

from kvcal.runtime import backends as attention
from kvcal.runtime.backends import TorchBackend, select_backend
from kvcal.runtime.backends.cpu import backend as cpu_backend
from kvcal.runtime.backends.cpu import build
from kvcal.runtime.backends.cpu.backend import CpuBackend
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.policies.fastgen import FastGenConfig
from kvcal.runtime.storage.codec import HELD
from kvcal.runtime.storage.layout import TierFormat
from kvcal.runtime.storage.pages import HIGH, LOW
from kvcal.runtime.storage.store import CompressedStore

# (high, low) tier formats: precisions, per-token / per-channel keys, value and key groups, raw tiers
MIXES = [("K8V4", "K4cV2"), ("K8V4", "K2V2"), ("K4V2", "K2cV2"), ("K8V8", "K8cV4"), ("K16V16", "K4cV2"),
         ("K8V3", "K3cV3"), ("K4V3kg4m8", "K3V2g4m8"),     # 3-bit codes straddle bytes
         ("K32V32", "K8V8"), ("K8V4g4", "K2V2g4"), ("K8V4kg4", "K4cV4g4"), ("K2V2", "K2V2"),
         ("K8V4m8", "K4cV2m8"), ("K16V16", "K4cV4m8"), ("K8V4kg4m8", "K2V2g4m8"),
         ("K8V8m8", "K4cV4m8")]     # m8: 8-bit scales and zeros
TOL = dict(rtol=1e-5, atol=1e-6)
pytestmark = pytest.mark.float_order      # fused kernels against torch: rerun per instruction set


def random_store(high: str, low: str, *, seed: int = 0, B: int = 2, H: int = 3, d: int = 16, max_high: int = 40,
                 max_low_pages: int = 2, holes: float = 0.15, raw16: torch.dtype = torch.float16,
                 levels: dict | None = None) -> CompressedStore:
    """Ragged lengths per (sequence, head), three rank groups, both tiers, several pages, and holes (pos -1).
    levels: calibrated levels by bundle name, for formats with calibrated sides (tests/test_levels.py)."""
    gen = torch.Generator().manual_seed(seed)
    rank_k, rank_v = torch.tensor([[16, 8, 12][:H]]), torch.tensor([[12, 16, 8][:H]])
    store = CompressedStore(rank_k, rank_v, [0], high=TierFormat.parse(high), low=TierFormat.parse(low), head_dim=d,
                            batch=B, page_bytes=512, initial_pages=4, raw16=raw16, levels=levels)
    pos = 0
    for side, fmt in ((LOW, store.low), (HIGH, store.high)):
        for bi in range(B):
            for hi in range(H):
                b, h = torch.tensor([bi]), torch.tensor([hi])
                if side == LOW and fmt.k_mode == "channel":
                    T = next(g for g in store.groups[0] if hi in g.heads.tolist()).layouts[LOW].tokens
                    for _ in range(int(torch.randint(0, max_low_pages + 1, (1,), generator=gen))):
                        store.write_pages(0, b, h, torch.randn(1, T, d, generator=gen), torch.randn(1, T, d,
                                          generator=gen), torch.arange(pos, pos + T)[None], torch.rand(1, T,
                                                                                                   generator=gen))
                        pos += T
                    continue
                n = int(torch.randint(0, max_high + 1, (1,), generator=gen)) if (bi, hi) != (0, 0) else max_high
                store.append(0, side, b.repeat(n), h.repeat(n), torch.randn(n, d, generator=gen) * 2,
                             torch.randn(n, d, generator=gen), torch.arange(pos, pos + n), torch.rand(n, generator=gen))
                pos += n
    for side in (HIGH, LOW):
        b, h = torch.arange(B).repeat_interleave(H), torch.arange(H).repeat(B)
        _, p = store.section_meta(0, side, b, h)
        e, s = torch.nonzero((p >= 0) & (torch.rand(p.shape, generator=gen) < holes), as_tuple=True)
        if len(e):
            store.drop(0, side, b[e], h[e], s)
    return store


def decode_inputs(store: CompressedStore, g: int, n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    B, H, r, rv = store.batch, store.num_kv_heads, store.r_k_max[0], store.r_v_max[0]
    return (torch.randn(B, H, g, n, r, generator=gen), torch.randn(B, H, n, r, generator=gen) * 2,
            torch.randn(B, H, n, rv, generator=gen))


def assert_same_scores(got: CompressedStore, want: CompressedStore) -> None:
    a, b = got.gather(0), want.gather(0)
    assert torch.equal(a.pos, b.pos)
    live = b.pos >= 0
    torch.testing.assert_close(a.score[live], b.score[live], **TOL)


# ---------------------------------------------------------------- decode attention + fused scores


@pytest.mark.parametrize("g,n", [(2, 1), (3, 3)])
@pytest.mark.parametrize("high,low", MIXES)
def test_decode_matches_torch_reference(high, low, g, n):
    assert_decode_matches(random_store(high, low, seed=MIXES.index((high, low)) * 10 + g + n), g, n)


def assert_decode_matches(store, g: int, n: int, backend=CpuBackend) -> None:
    """`backend`'s attention, new scores and score update of the stored tokens equal the torch reference's on a copy
    of `store` (float32 tolerance: only the order of the sums differs)."""
    ref = copy.deepcopy(store)
    q, kn, vn = decode_inputs(store, g, n)
    out_ref, score_ref = TorchBackend.attend(ref, 0, q, kn, vn, 16 ** -0.5)
    out, score = backend.attend(store, 0, q, kn, vn, 16 ** -0.5)
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(score, score_ref, **TOL)
    assert_same_scores(store, ref)                                   # the score update of the stored tokens


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_is_the_same_at_any_thread_count(threads, monkeypatch):
    """The split over page chunks follows the thread count; the result must not."""
    monkeypatch.setattr(cpu_backend, "GRAIN", 1)                  # every thread gets work, however small the layer
    store = random_store("K8V4", "K4cV2", seed=4, max_high=120, max_low_pages=4)
    ref = copy.deepcopy(store)
    q, kn, vn = decode_inputs(store, 2, 2)
    want = TorchBackend.attend(ref, 0, q, kn, vn, 0.3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = CpuBackend.attend(store, 0, q, kn, vn, 0.3)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    assert_same_scores(store, ref)


def test_decode_reads_bfloat16_raw_tiers():
    store = random_store("K16V16", "K4cV2", seed=6, raw16=torch.bfloat16)
    ref = copy.deepcopy(store)
    q, kn, vn = decode_inputs(store, 2, 1)
    for a, b in zip(CpuBackend.attend(store, 0, q, kn, vn, 0.25), TorchBackend.attend(ref, 0, q, kn, vn, 0.25)):
        torch.testing.assert_close(a, b, **TOL)


def test_decode_without_score_tracking_leaves_the_arena():
    store = random_store("K8V4", "K4cV2", seed=7)
    before = store.arena.arena.clone()
    q, kn, vn = decode_inputs(store, 2, 2)
    out_ref, s_ref = TorchBackend.attend(copy.deepcopy(store), 0, q, kn, vn, 0.25, track_scores=False)
    out, s = CpuBackend.attend(store, 0, q, kn, vn, 0.25, track_scores=False)
    torch.testing.assert_close(out, out_ref, **TOL)
    assert torch.equal(s, s_ref) and torch.equal(store.arena.arena, before)


def test_decode_on_an_empty_store():
    store = random_store("K8V4", "K4V2", seed=8, max_high=0, max_low_pages=0)
    store.release()
    q, kn, vn = decode_inputs(store, 2, 3)
    for a, b in zip(CpuBackend.attend(store, 0, q, kn, vn, 0.5),
                    TorchBackend.attend(copy.deepcopy(store), 0, q, kn, vn, 0.5)):
        torch.testing.assert_close(a, b, **TOL)


# ---------------------------------------------------------------- token writes


@pytest.mark.parametrize("high,low", [m for m in MIXES if "c" not in m[1]] + [("K8V4", "K4cV2")])
def test_write_bytes_equal_store_write(high, low):
    """Quantization, packing, metadata, score and position: the same bytes as CompressedStore.write."""
    ref = random_store(high, low, seed=5, holes=0.0)
    store = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(9)
    B, H = store.batch, store.num_kv_heads
    for side in (HIGH, LOW) if ref.low.k_mode == "token" else (HIGH,):
        b, h = torch.arange(B).repeat_interleave(H), torch.arange(H).repeat(B)
        fill = store.fill[0, b, h, side]
        keep = fill > 0
        b, h, slot = b[keep], h[keep], (torch.rand(int(keep.sum()), generator=gen) * fill[keep]).long()
        n = len(b)
        keys, values = torch.randn(n, 16, generator=gen) * 3, torch.randn(n, 16, generator=gen)
        keys[0] = 1.5                                           # a constant vector: scale 0, codes 0
        values[-1, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, 3.5, 4.5, -1.5, 0.0])   # ties at the rounding step
        pos, score = torch.arange(n) + 1000, torch.rand(n, generator=gen)
        ref.write(0, side, b, h, slot, keys, values, pos, score)
        CpuBackend.write(store, 0, side, b, h, slot, keys, values, pos, score)
        assert torch.equal(store.arena.arena, ref.arena.arena)


@pytest.mark.parametrize("spare", [0, 400])
@pytest.mark.parametrize("high,low", [("K8V4", "K4cV2"), ("K4V2", "K2V2"), ("K16V16", "K8V8")])
def test_decode_append_equals_the_torch_append(high, low, spare):
    """The decode step's fused insert where no entry has a hole (kvcal_insert_every: write at fill, fill += 1, new
    pages from the free list in the call) writes the bytes, counts and pages the store's torch path does, across page
    boundaries and on both per-token sides: with `spare` free pages every page comes from the kernel, with none the
    arena grows in Python on the way."""
    ref = random_store(high, low, seed=11, holes=0.0)
    if spare:
        ref.arena.grow(spare)
    store = copy.deepcopy(ref)
    store.writer = CpuBackend
    gen = torch.Generator().manual_seed(12)
    b, h = ref.every_entry()
    sides = (HIGH, LOW) if ref.low.k_mode == "token" else (HIGH,)
    for step in range(40):                                      # 40 > a page's tokens: new pages on the way
        side = sides[step % len(sides)]
        keys, values = torch.randn(len(b), 16, generator=gen) * 2, torch.randn(len(b), 16, generator=gen)
        score = torch.rand(len(b), generator=gen)
        for s in (ref, store):
            s.insert(0, side, b, h, keys, values, 500 + step, score, every_entry=True)
    assert ref.writer is None and torch.equal(store.fill, ref.fill)
    assert int(ref.fill[0, :, :, HIGH].min()) >= 40 // len(sides)
    used = store.arena.num_pages_used.sum()
    assert torch.equal(store.arena.page_table, ref.arena.page_table) and int(used) > 0
    assert torch.equal(store.arena.arena, ref.arena.arena)
    assert (store.arena.num_pages, store.arena.num_free, store.arena.start) == (ref.arena.num_pages,
                                                                                ref.arena.num_free, ref.arena.start)
    assert torch.equal(store.arena.refs, ref.arena.refs)


@pytest.mark.parametrize("high,low", [("K8V4", "K4cV2"), ("K16V16", "K4cV4m8"), ("K4V2", "K2cV2"),
                                      ("K16V16", "K2cV2m8")])
def test_decode_insert_into_holes_equals_the_torch_insert(high, low):
    """The decode step's fused insert once a layer has holes (kvcal_insert_every: first hole, else the end; pages
    for the appending entries reserved in Python) writes the bytes, counts and pages the store's torch path does."""
    ref = random_store(high, low, seed=13, holes=0.3)
    store = copy.deepcopy(ref)
    store.writer = CpuBackend
    gen = torch.Generator().manual_seed(14)
    b, h = ref.every_entry()
    assert int(ref.holes[0, :, :, HIGH].sum()) > 0
    for step in range(40):                                      # fills every hole, then appends over new pages
        keys, values = torch.randn(len(b), 16, generator=gen) * 2, torch.randn(len(b), 16, generator=gen)
        score = torch.rand(len(b), generator=gen)
        for s in (ref, store):
            s.insert(0, HIGH, b, h, keys, values, 500 + step, score, every_entry=True)
    assert int(ref.holes[0, :, :, HIGH].sum()) == 0
    assert torch.equal(store.fill, ref.fill) and torch.equal(store.holes, ref.holes)
    assert torch.equal(store.arena.page_table, ref.arena.page_table)
    assert torch.equal(store.arena.arena, ref.arena.arena)


@pytest.mark.parametrize("low", ["K4cV2", "K2cV2", "K3cV3m8", "K4cV4m8", "K2cV2m8", "K8cV4g4"])
def test_write_pages_bytes_equal_the_torch_writer(low):
    """kvcal_write_pages: per-channel key scales over the page, per-token values, score and position, in the same
    pages with the same bytes as CompressedStore.write_pages_torch."""
    ref = random_store("K8V4", low, seed=15, holes=0.0)
    store = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(16)
    b, h = torch.tensor([0, 1, 1, 0]), torch.tensor([0, 2, 1, 1])           # two rank groups, one page each
    T = max(g.layouts[LOW].tokens for g in ref.groups[0])
    keys, values = torch.randn(4, T, 16, generator=gen) * 3, torch.randn(4, T, 16, generator=gen)
    keys[0, :, 2] = 1.5                                          # a constant channel: scale 0, codes 0
    pos, score = torch.arange(4 * T).view(4, T) + 900, torch.rand(4, T, generator=gen)
    for g in ref.groups[0]:                                      # a page of each group's own capacity
        rows = torch.isin(h, g.heads)
        Tg = g.layouts[LOW].tokens
        args = (b[rows], h[rows], keys[rows, :Tg], values[rows, :Tg], pos[rows, :Tg], score[rows, :Tg])
        ref.write_pages_torch(0, *args)
        CpuBackend.write_pages(store, 0, *args)
    assert torch.equal(store.fill, ref.fill) and torch.equal(store.arena.page_table, ref.arena.page_table)
    assert torch.equal(store.arena.arena, ref.arena.arena)


@pytest.mark.parametrize("bad,message", [(float("nan"), "must be finite"), (1e6, "beyond the float16 range")])
def test_write_refuses_what_the_quantizer_refuses_and_writes_nothing(bad, message):
    store = random_store("K8V4", "K4V2", seed=3, holes=0.0)
    before = store.arena.arena.clone()
    keys, values = torch.randn(2, 16), torch.randn(2, 16)
    values[1, 3] = bad
    b, h, slot = torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match=message):
        CpuBackend.write(store, 0, HIGH, b, h, slot, keys, values, torch.tensor([5, 6]), torch.zeros(2))
    assert torch.equal(store.arena.arena, before)
    with pytest.raises(ValueError, match=message):                 # the reference says the same
        store.write(0, HIGH, b, h, slot, keys, values, torch.tensor([5, 6]), torch.zeros(2))


# ---------------------------------------------------------------- whole decodes through transformers


def _decode_logits(model, cache, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Prefill `prompt` tokens, then teacher-force the rest one token per step; logits [B, steps, vocab]."""
    with torch.inference_mode():
        model(input_ids=ids[:, :prompt], cache=cache, use_cache=True, logits_to_keep=1)
        steps = [model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits[:, -1]
                 for i in range(prompt, ids.shape[1])]
    return torch.stack(steps, 1)


TIERED = TieringConfig(window=4, alpha_high=1.5, alpha_low=0.5)
CONFIGS = {
    "K8V4 untiered": CompressionConfig(use_ranks=False),
    "tiers, per-channel low": CompressionConfig(tiering=TIERED),
    "tiers, per-token low": CompressionConfig(high=TierFormat.parse("K8V4g4"), low=TierFormat.parse("K4V2"),
                                              tiering=TIERED),
    "tiers + FastGen": CompressionConfig(tiering=TIERED, fastgen=FastGenConfig(recovery=0.5)),
    "raw": CompressionConfig.none(),
    "residual family, untracked low": CompressionConfig(high=TierFormat(16, 16), low=TierFormat.parse("K4cV4"),
                                                        tiering=TieringConfig(window=4, alpha_high=1.5),
                                                        page_tokens=8),
}


PAGE_BYTES = {"tiers, per-channel low": 256}     # small pages: some get sealed


@pytest.mark.parametrize("name", list(CONFIGS))
def test_whole_decode_matches_torch_backend(name):
    """Tiny Llama, ragged ranks, a batch of two: every step's logits, the tier moves (Algorithm 1, per-channel page
    sealing, FastGen evictions) and the stored scores agree with the torch backend."""
    model, tok = make_model("llama")
    H, L = model.config.num_key_value_heads, model.config.num_hidden_layers
    bundle = random_bundle(model, tok, rank_k=torch.tensor([[16, 12]] * L), rank_v=torch.tensor([[8, 16]] * L))
    ids = tok([random_text(60, seed=1), random_text(60, seed=2)], return_tensors="pt").input_ids[:, :56]
    runs = {}
    for backend in ("torch", "cpu"):
        # raw_tokens=0: the tier moves and stored scores compared are the pages' (the per-token low config would
        # hold all 56 tokens raw); the backends across the raw phase's hand-over: test_cache_bytes.py
        cache = KvcalCache.from_bundle(bundle, model, CONFIGS[name], tokenizer=tok, raw_tokens=0,
                                       serve=ServeOptions(backend, PAGE_BYTES.get(name)))
        runs[backend] = (_decode_logits(model, cache, ids, 24), cache)
    (want, ref), (got, cache) = runs["torch"], runs["cpu"]
    assert cache.kv.backend is CpuBackend and ref.kv.backend is TorchBackend
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cache.kv.tier_counts() == ref.kv.tier_counts()
    counts, seen = ref.kv.tier_counts(), 2 * H * L * ids.shape[1]
    if CONFIGS[name].tiering.tiered:                     # the tier moves and evictions did happen
        assert counts["low"] > 0 if CONFIGS[name].fastgen is None else counts["high"] + counts["low"] < seen
    b, h = torch.arange(2).repeat_interleave(H), torch.arange(H).repeat(2)
    for layer in cache.kv.layers:
        for side in (HIGH, LOW):
            s_got, p_got = cache.kv.store.section_meta(layer, side, b, h)
            s_want, p_want = ref.kv.store.section_meta(layer, side, b, h)
            assert torch.equal(p_got, p_want)
            torch.testing.assert_close(s_got[p_got >= 0], s_want[p_want >= 0], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- selection and build


def test_auto_picks_the_cpu_backend_on_cpu():
    assert select_backend.__wrapped__("auto", "cpu") is CpuBackend
    assert select_backend.__wrapped__("cpu", "cpu") is CpuBackend
    assert CpuBackend.supports(torch.device("cpu")) == []
    assert "`cuda` is not the CPU" in CpuBackend.supports(torch.device("cuda"))[0]


def test_auto_falls_back_to_torch_with_one_log_line_when_the_build_fails(monkeypatch, caplog):
    def fail():
        raise build.CpuBuildError("no C++ compiler on PATH (c++, g++ or clang++; or set $CXX)")

    monkeypatch.setattr(cpu_backend, "load_library", fail)
    with caplog.at_level(logging.INFO, logger="kvcal.runtime.backends.registry"):
        chosen = select_backend.__wrapped__("auto", "cpu")
    assert chosen is TorchBackend
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcal.runtime.backends.registry"]
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and lines[0].startswith("kvcal attention backend: torch")
    with pytest.raises(ValueError, match="attention backend `cpu` cannot run on cpu: no C\\+\\+ compiler"):
        select_backend.__wrapped__("cpu", "cpu")


def test_build_is_cached_on_disk_and_written_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path))
    build.load_library.cache_clear()
    try:
        lib = build.load_library()
        files = list((tmp_path / "cpu").iterdir())
        assert len(files) == 1 and files[0].suffix == ".so"           # no temporary file left behind
        assert lib.kvcal_desc_ints() == len(cpu_backend.DESC_FIELDS)
        stamp = files[0].stat().st_mtime_ns
        build.load_library.cache_clear()
        build.load_library()                                            # the second load reuses the file
        assert files[0].stat().st_mtime_ns == stamp
    finally:
        build.load_library.cache_clear()


def test_a_missing_compiler_is_a_one_line_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    build.load_library.cache_clear()
    try:
        with pytest.raises(build.CpuBuildError) as e:
            build.load_library()
        assert "\n" not in str(e.value) and "install one" in str(e.value)
        assert not (tmp_path / "cpu").exists()
    finally:
        build.load_library.cache_clear()


def test_registry_names_the_backend():
    assert attention.BACKENDS["cpu"] == "kvcal.runtime.backends.cpu.backend:CpuBackend"


@pytest.mark.parametrize("padded,shape,r_v", [(False, (2, 2, 3, 97, 16), 12), (True, (2, 2, 3, 97, 16), 12),
                                                (False, (1, 3, 1, 130, 64), 64), (False, (1, 1, 2, 5, 8), 8),
                                                (False, (1, 2, 6, 75, 128), 80), (False, (1, 1, 4, 70, 256), 256)])
def test_fused_prefill_equals_the_reference_prefill(padded, shape, r_v):
    """The CPU prefill (`kvcal_prefill`: each row's softmax in one block, its probabilities used for the output and
    the significance) against the reference's blocked softmax: the same sums in another float order, so within 1e-5
    relative (float32 eps 1.2e-7 times the few hundred terms a probability's exponent and sums gather); with left
    padding it is the reference itself. Shapes: keys over one tile and a part (97, 130, 75: the diagonal tile's
    causal mask, a part-filled last tile, query blocks cut by the end), under one tile (5, 70), groups of 1-6 query
    heads, value rows that are not whole vectors (12, 8, 80) and head sizes up to 256."""
    from kvcal.runtime.backends.cpu.backend import fused_prefill
    from kvcal.runtime.backends.reference import TorchBackend

    torch.manual_seed(0)
    B, H, g, n, d = shape
    q, k, v = torch.randn(B, H, g, n, d), torch.randn(B, H, n, d), torch.randn(B, H, n, r_v)
    real = torch.ones(B, n, dtype=torch.bool)
    if padded:
        real[0, :5] = False
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None] & real[:, None, :]
    want_out, want_score = TorchBackend.prefill(q, k, v, mask, d ** -0.5)
    out, score = fused_prefill(q, k, v, mask, d ** -0.5)
    if padded:
        assert torch.equal(out, want_out) and torch.equal(score, want_score)
    else:
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(score, want_score, rtol=1e-5, atol=1e-6)


def test_fused_prefill_does_not_depend_on_the_thread_count():
    """Each task sums its own query chunks' significance and the tasks' sums are added in task order, so the prefill
    gives the same bits at 1 and 2 threads (the calibration's determinism rests on it)."""
    from kvcal.runtime.backends.cpu.backend import fused_prefill

    torch.manual_seed(1)
    q, k, v = torch.randn(1, 3, 3, 600, 64), torch.randn(1, 3, 600, 64), torch.randn(1, 3, 600, 64)
    mask = torch.ones(600, 600, dtype=torch.bool).tril()[None]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_prefill(q, k, v, mask, 0.125)
        torch.set_num_threads(2)
        two = fused_prefill(q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_fused_prefill_gives_the_same_bits_with_either_register_block(tmp_path):
    """The prefill's register blocks are chosen by the instruction set (AVX-512's would spill AVX2's 16 registers);
    both sum every logit and output in the same order, so both builds give the same bits (this CPU runs both: the
    wide blocks need no AVX-512 instruction)."""
    import ctypes

    from kvcal.runtime.backends.cpu.backend import fused_prefill

    libs = []
    for wide in (0, 1):
        target = tmp_path / f"prefill-{wide}.so"
        build._compile(build.compiler(), target, (f"-DKVCAL_PREFILL_WIDE={wide}",))
        libs.append(ctypes.CDLL(str(target)))
        build._declare(libs[-1])
    torch.manual_seed(2)
    for B, H, g, n, d, r_v in [(1, 3, 3, 700, 64, 64), (2, 2, 4, 130, 128, 48), (1, 1, 1, 77, 32, 16)]:
        q, k, v = torch.randn(B, H, g, n, d), torch.randn(B, H, n, d), torch.randn(B, H, n, r_v)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None].expand(B, n, n)
        narrow, wide = (fused_prefill(q, k, v, mask, d ** -0.5, lib=lib) for lib in libs)
        assert torch.equal(narrow[0], wide[0]) and torch.equal(narrow[1], wide[1])


# ---------------------------------------------------------------------------------------------- store reads and writes


@pytest.mark.parametrize("low,tracked", [("K4cV2", True), ("K2V2", True), ("K4cV2", False)])
def test_cached_section_read_equals_the_uncached_read(low, tracked):
    """The decode step's read of every entry (one cached gather across the layer's rank groups) gives the scores,
    positions and score words that the per-group path gives for the same entries; an untracked low tier reads as
    held tokens with score 0 and no score word."""
    store = random_store("K8V4", low, seed=3) if tracked else _untracked_store(seed=3)
    assert len(store.groups[0]) > 1
    b, h = store.every_entry()
    for side in (HIGH, LOW):
        fast = store.section_scores(0, side, b, h)
        slow = store.section_scores(0, side, b.clone(), h.clone())      # not every_entry's tensors: per group
        assert fast[0].shape == slow[0].shape and torch.equal(fast[1], slow[1])
        held = slow[1] != -1
        assert torch.equal(fast[0][held], slow[0][held]) and torch.equal(fast[2][held], slow[2][held])
    if not tracked:
        score, pos, word = store.section_scores(0, LOW, b, h)
        held = pos == HELD
        assert bool(held.any()) and bool((score[held] == 0).all()) and bool((word[held] == -1).all())


def _untracked_store(seed: int) -> CompressedStore:
    """Three rank groups, per-token high pages and per-channel low pages that hold no scores or positions."""
    gen = torch.Generator().manual_seed(seed)
    d, B, H = 16, 2, 3
    store = CompressedStore(torch.tensor([[16, 8, 12]]), torch.tensor([[12, 16, 8]]), [0],
                            high=TierFormat.parse("K8V4"), low=TierFormat.parse("K4cV2"), head_dim=d, batch=B,
                            page_bytes=512, initial_pages=4, low_tracked=False)
    pos = 0
    for bi in range(B):
        for hi in range(H):
            b, h = torch.tensor([bi]), torch.tensor([hi])
            T = next(g for g in store.groups[0] if hi in g.heads.tolist()).layouts[LOW].tokens
            pages = (bi + hi) % 3
            if pages:
                store.write_pages(0, b.repeat(pages), h.repeat(pages), torch.randn(pages, T, d, generator=gen),
                                  torch.randn(pages, T, d, generator=gen), torch.arange(pos, pos + pages * T).view(
                                      pages, T), torch.rand(pages, T, generator=gen))
                pos += pages * T
            n = 5 + 7 * hi
            store.append(0, HIGH, b.repeat(n), h.repeat(n), torch.randn(n, d, generator=gen),
                         torch.randn(n, d, generator=gen), torch.arange(pos, pos + n), torch.rand(n, generator=gen))
            pos += n
    return store


@pytest.mark.parametrize("writer", [None, CpuBackend, "emulated-cuda"])
def test_write_pages_takes_several_pages_of_one_entry_in_one_call(writer):
    """A prefill seals an entry's low pages in one call: the store then holds byte for byte what one call per page
    (in the same order) writes, with the same fill."""
    if writer == "emulated-cuda":
        from kvcal.runtime.backends.cuda.emulate import EmulatedCudaBackend
        writer = EmulatedCudaBackend
    gen = torch.Generator().manual_seed(0)
    rank = torch.tensor([[16, 16, 16]])
    stores = [CompressedStore(rank, rank, [0], high=TierFormat.parse("K8V4"), low=TierFormat.parse("K4cV2"),
                              head_dim=16, batch=2, page_bytes=512, initial_pages=2, writer=writer) for _ in range(2)]
    T = stores[0].groups[0][0].layouts[LOW].tokens
    b, h = torch.tensor([0, 1, 0, 0, 1]), torch.tensor([2, 0, 2, 2, 0])       # entry (0, 2): three pages
    n = len(b)
    k, v = torch.randn(n, T, 16, generator=gen), torch.randn(n, T, 16, generator=gen)
    pos, score = torch.arange(n * T).view(n, T), torch.rand(n, T, generator=gen)
    stores[0].write_pages(0, b, h, k, v, pos, score)
    for i in range(n):
        stores[1].write_pages(0, b[i:i + 1], h[i:i + 1], k[i:i + 1], v[i:i + 1], pos[i:i + 1], score[i:i + 1])
    assert torch.equal(stores[0].fill, stores[1].fill)
    for side in (HIGH, LOW):
        e_b, e_h = stores[0].every_entry()
        for s in stores:
            s._words.clear()
        got, want = (s.section_scores(0, side, e_b.clone(), e_h.clone()) for s in stores)
        assert torch.equal(got[1], want[1])
    keys = [s.read(0, LOW, b.repeat_interleave(T), h.repeat_interleave(T), _slots(s, b, h, T))[0] for s in stores]
    assert torch.equal(keys[0], keys[1])


def _slots(store, b, h, T):
    """The slots of each row's page in row order: an entry's k-th row is its k-th page."""
    seen: dict = {}
    out = []
    for bi, hi in zip(b.tolist(), h.tolist()):
        k = seen[bi, hi] = seen.get((bi, hi), -1) + 1
        out.append(torch.arange(k * T, (k + 1) * T))
    return torch.cat(out)


# ---------------------------------------------------------------- the exact block: a window every query sees


def exact_inputs(store: CompressedStore, g: int, n: int, prior: int, seed: int = 2, padded: bool = True):
    """query [B, H, g, n, r] and an exact block of `prior` window tokens then n new ones; `padded`: the second
    sequence's first 3 window tokens left padding (else exact_from None)."""
    gen = torch.Generator().manual_seed(seed)
    B, H, r, rv = store.batch, store.num_kv_heads, store.r_k_max[0], store.r_v_max[0]
    m = prior + n
    exact_from = torch.tensor([0, 3] + [1] * (B - 2)) if padded and prior >= 3 else None
    return (torch.randn(B, H, g, n, r, generator=gen), torch.randn(B, H, m, r, generator=gen) * 2,
            torch.randn(B, H, m, rv, generator=gen), exact_from)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("g,n", [(2, 1), (3, 3)])
def test_decode_with_an_exact_window_matches_torch_reference(g, n, track, padded):
    store = random_store("K8V8", "K4cV2", seed=11 + n)
    ref = copy.deepcopy(store)
    q, kx, vx, exact_from = exact_inputs(store, g, n, prior=5, padded=padded)
    want = TorchBackend.attend(ref, 0, q, kx, vx, 0.25, track_scores=track, exact_from=exact_from)
    got = CpuBackend.attend(store, 0, q, kx, vx, 0.25, track_scores=track, exact_from=exact_from)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    assert_same_scores(store, ref)


def test_the_reference_exact_block_is_a_softmax_over_what_each_query_sees():
    """Query i sees every stored token, the window past its sequence's padding, and the new tokens up to its own."""
    store = random_store("K8V8", "K4cV2", seed=3)
    q, kx, vx, exact_from = exact_inputs(store, 2, 3, prior=5)
    stored = copy.deepcopy(store).gather(0)
    out, score = TorchBackend.attend(store, 0, q, kx, vx, 0.25, exact_from=exact_from)
    B, H, g, n, _ = q.shape
    for b in range(B):
        for h in range(H):
            live = stored.pos[b, h] >= 0
            for i in range(n):
                seen = torch.arange(8) >= int(exact_from[b])
                seen &= torch.arange(8) <= 5 + i
                keys = torch.cat([stored.keys[b, h, live], kx[b, h, seen]])
                values = torch.cat([stored.values[b, h, live], vx[b, h, seen]])
                p = torch.softmax(q[b, h, :, i] @ keys.T * 0.25, -1)                      # [g, seen]
                torch.testing.assert_close(out[b, h, :, i], p @ values, **TOL)
    assert bool((score[1, :, :3] == 0).all()) and bool((score[:, :, 5:] > 0).all())
