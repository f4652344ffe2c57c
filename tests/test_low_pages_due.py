"""The CPU kernel's check for a per-channel low page due (`kvcal_low_pages_due`), which lets DiffKV's decode step
skip the torch check on most steps: it must count what the policy counts, and skipping must change nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_bundle, random_text
from test_cpu_backend import _decode_logits, random_store

from kvcal.runtime.backends.cpu.backend import CpuBackend, _layer_args, _ptr
from kvcal.runtime.backends.cpu.build import load_library
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies.diffkv import TieringConfig, pending_low
from kvcal.runtime.storage.pages import HIGH, LOW

pytestmark = pytest.mark.float_order      # a kernel against torch: rerun per instruction set


@pytest.mark.parametrize("threshold_base", ["length", "position"])
def test_the_kernel_counts_the_entries_with_a_low_page_due_as_the_policy_does(threshold_base):
    """Ragged high sections with holes, three rank groups (three low-page sizes), left padding: for every window,
    threshold and cache length, the kernel counts each entry's pending high tokens as the policy's own `pending_low`
    does, and the entries whose pending tokens fill a low page; the backend's answer is whether there are any."""
    store = random_store("K8V4", "K4cV2", seed=5, max_high=40)
    B, H = store.batch, store.num_kv_heads
    b, h = store.every_entry()
    score, pos = (t.view(B, H, -1) for t in store.section_meta(0, HIGH, b, h))
    page = torch.tensor([next(g for g in store.groups[0] if i in g.heads.tolist()).layouts[LOW].tokens
                         for i in range(H)])
    n_pad = torch.tensor([0, 3])
    counts = []
    for extra in (1, 8, 40):
        length = int(pos.max()) + extra
        for window in (1, 4, 16):
            for alpha in (0.25, 1.0, 4.0, 16.0):
                tiering = TieringConfig(window=window, alpha_high=alpha, threshold_base=threshold_base)
                pending = pending_low(tiering, score, pos, n_pad, torch.full((B,), length))
                want = int((pending.sum(-1) >= page).sum())
                each = torch.empty(B * H, dtype=torch.int64)
                got = load_library().kvcal_low_pages_due(*_layer_args(store, 0), _ptr(n_pad), length, window, alpha,
                                                         0.0, int(threshold_base == "position"), 0.0, _ptr(each))
                assert torch.equal(each, pending.sum(-1).view(-1)) and got == want, (length, window, alpha)
                assert CpuBackend.low_pages_due(store, 0, n_pad, length, tiering) == (want > 0)
                counts.append(want)
    assert min(counts) == 0 and max(counts) > 1          # the grid has steps with none, one and several due


def test_decoding_with_the_kernel_check_equals_decoding_with_the_torch_check(monkeypatch):
    """Tiny Llama, tiers with per-channel low pages and nothing pruned (the calibrated settings' path), small pages
    so that pages are sealed during decode: the cpu backend with the kernel's check and with the torch check on every
    step give the same logits bit for bit and the same tokens in the same slots."""
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    ids = tok([random_text(60, seed=1), random_text(60, seed=2)], return_tensors="pt").input_ids[:, :56]
    config = CompressionConfig(tiering=TieringConfig(window=4, alpha_high=1.5))
    runs, calls = {}, {"due": 0, "asked": 0}
    real = CpuBackend.low_pages_due

    def counted(*args):
        calls["asked"] += 1
        due = real(*args)
        calls["due"] += due
        return due

    for check in ("kernel", "torch"):
        monkeypatch.setattr(CpuBackend, "low_pages_due", staticmethod(counted if check == "kernel" else
                                                                      lambda *args: True))
        cache = KvcalCache.from_bundle(bundle, model, config, tokenizer=tok, raw_tokens=0,
                                       serve=ServeOptions("cpu", 256))
        runs[check] = (_decode_logits(model, cache, ids, 24), cache)
    (got, cache), (want, ref) = runs["kernel"], runs["torch"]
    assert torch.equal(got, want)
    assert 0 < calls["due"] < calls["asked"]              # some steps sealed a page, most skipped the check
    assert cache.kv.tier_counts() == ref.kv.tier_counts() and cache.kv.tier_counts()["low"] > 0
    b, h = cache.kv.store.every_entry()
    for layer in cache.kv.layers:
        for side in (HIGH, LOW):
            assert torch.equal(cache.kv.store.section_meta(layer, side, b, h)[1],
                               ref.kv.store.section_meta(layer, side, b, h)[1])
