"""Mechanisms for CPU decode attention over compressed pages, one layer, timed against each other in the same run.

    python experiments/cpu_attention.py --contexts 1024 4096 8192 --batches 1 8 [--json docs/results/cpu-attention.json]

One layer of K8V4 pages (smollm2-135m geometry: 3 KV heads, 3 query heads per KV head, head dim 64), one new token:
  torch reference   TorchBackend.attend: dequantize every page of the layer, dense float32 attention, scores
  torch.compile     inductor (C++/OpenMP) on the dequantize + attend + score math, given the key/value codes and
                    metadata already cut out of the pages (the best case for it: no page-table walk, no byte views)
  fused C++         CpuBackend.attend: walks the page table, dequantizes a page at a time, online softmax, scores
Timings are medians over `--reps` calls, the three interleaved; all three produce the same output (checked).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from kvcal.runtime.backends.cpu.backend import CpuBackend
from kvcal.runtime.backends.reference import TorchBackend
from kvcal.runtime.storage.layout import TierFormat
from kvcal.runtime.storage.pages import HIGH
from kvcal.runtime.storage.store import CompressedStore

H, G, D = 3, 3, 64


def make_store(batch: int, context: int) -> CompressedStore:
    store = CompressedStore(torch.full((1, H), D), torch.full((1, H), D), [0], high=TierFormat(8, 4),
                            low=TierFormat(4, 2, "channel"), head_dim=D, batch=batch, initial_tokens=context)
    b, h = torch.arange(batch).repeat_interleave(H).repeat(context), torch.arange(H).repeat(batch * context)
    pos = torch.arange(context).repeat_interleave(batch * H)
    n = len(b)
    store.append(0, HIGH, b, h, torch.randn(n, D), torch.randn(n, D), pos, torch.zeros(n))
    return store


def segments(store: CompressedStore):
    """Codes and metadata of every stored token, cut out of the pages once: k uint8 [W, S, D], k_meta fp16
    [W, S, 2], v uint8 [W, S, D / 2], v_meta fp16 [W, S, 2], pos int32 [W, S]."""
    lay = store.groups[0][0].layouts[HIGH]
    b, h = store.entries(0, store.groups[0][0])
    pages = store.arena.arena[store.section_pages(0, HIGH, b, h)]                       # [W, P, page_bytes]
    W, P, _ = pages.shape
    T = lay.tokens
    seg = lambda off, n: pages[..., off:off + n].contiguous()                           # noqa: E731
    return (seg(lay.k_off, T * D).view(W, P * T, D), seg(lay.k_meta_off, T * 4).view(torch.float16).view(W, P * T, 2),
            seg(lay.v_off, T * D // 2).view(W, P * T, D // 2),
            seg(lay.v_meta_off, T * 4).view(torch.float16).view(W, P * T, 2),
            seg(lay.pos_off, T * 4).view(torch.int32).view(W, P * T))


def dequant_attend(k, k_meta, v, v_meta, pos, q, scale: float):
    """q [W, G, D] -> out [W, G, D], score delta [W, S] (max over G of each token's probability)."""
    kf = k.float() * k_meta[..., :1].float() + k_meta[..., 1:].float()
    codes = torch.stack([v & 15, v >> 4], -1).flatten(-2).float()
    vf = codes * v_meta[..., :1].float() + v_meta[..., 1:].float()
    logits = torch.einsum("wgd,wsd->wgs", q, kf) * scale
    logits = logits.masked_fill((pos < 0)[:, None], float("-inf"))
    p = torch.softmax(logits, -1)
    return torch.einsum("wgs,wsd->wgd", p, vf), p.amax(1)


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--threads", type=int, help="torch (and kernel) threads; default: torch's")
    ap.add_argument("--no-compile", action="store_true", help="time the uncompiled math in the torch.compile row "
                    "(no inductor build: a quick check that the script runs)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    compiled = dequant_attend if args.no_compile else torch.compile(dequant_attend, dynamic=True)
    rows = []
    for S in args.contexts:
        for B in args.batches:
            store = make_store(B, S)
            q, kn, vn = torch.randn(B, H, G, 1, D), torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
            segs = segments(store)
            qw = q.reshape(B * H, G, D)
            ref_out, _ = TorchBackend.attend(copy.deepcopy(store), 0, q, kn, vn, 0.125)
            fused_out, _ = CpuBackend.attend(copy.deepcopy(store), 0, q, kn, vn, 0.125)
            torch.testing.assert_close(fused_out, ref_out, rtol=1e-4, atol=1e-5)
            t0 = time.perf_counter()
            compiled(*segs, qw, 0.125)                                   # compile (first call) outside the timing
            compile_s = time.perf_counter() - t0
            with torch.inference_mode():
                timing = {"torch reference": [], "torch.compile": [], "fused C++": []}
                call = (store, 0, q, kn, vn, 0.125)
                calls = {"torch reference": lambda call=call: TorchBackend.attend(*call),
                         "torch.compile": lambda segs=segs, qw=qw: compiled(*segs, qw, 0.125),
                         "fused C++": lambda call=call: CpuBackend.attend(*call)}
                for _ in range(args.reps):
                    for name, fn in calls.items():
                        timing[name].append(median_ms(fn, 1))
            row = {"context": S, "batch": B, "compile_seconds": round(compile_s, 1),
                   **{name: round(statistics.median(t), 3) for name, t in timing.items()}}
            rows.append(row)
            print(f"S={S:<5} B={B}  " + "  ".join(f"{k} {v:8.3f} ms" for k, v in row.items()
                                                   if k not in ("context", "batch", "compile_seconds"))
                  + f"  (compile {compile_s:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
