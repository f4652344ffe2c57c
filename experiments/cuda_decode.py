"""Decode attention on a GPU: CudaBackend's fused kernels against TorchBackend on the same compressed store, and
dense fp16 attention (torch SDPA) over the same context; one layer, one decode step (n = 1).

    python experiments/cuda_decode.py [--json docs/results/cuda-decode.json]
    python experiments/cuda_decode.py --device cpu --quick     # the plumbing on the CPU, through the kernels' emulation

A row: a head geometry (KV heads H, query heads per KV head g, head_dim d: the shapes of three models, not the
models), batch B, context T and a pair of tier formats: the last `--recent` tokens in the high tier, the rest in the
low tier, at full rank d. Per row: the median ms of one layer's step over `--iters` calls, each synchronised, so the
host-side plan building and launches count (they are part of a step); the arena bytes the step reads and the rate that
makes; the largest difference between CudaBackend's output and TorchBackend's on copies of the store. Dense reads
B * H * (T + 1) * d * 2 fp16 K and V. `write` rows: one token appended to every (sequence, KV head), as a decode step
writes it, through the kernels (`writer`) or the torch store's own writes.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kvcal.runtime.backends.reference import TorchBackend
from kvcal.runtime.storage.layout import TierFormat
from kvcal.runtime.storage.pages import HIGH, LOW
from kvcal.runtime.storage.store import CompressedStore

GEOMETRIES = {"smollm2-135m shape": (3, 3, 64), "qwen2.5-1.5b shape": (2, 6, 128), "llama-3-8b shape": (8, 4, 128)}
# uniform KIVI-like pairs, and the calibrated formats a bundle's allocation picks most (per-channel keys, levels, 8-bit
# scales and zeros)
PAIRS = [("K8V4", "K4cV2"), ("K8V4", "K2V2"), ("K8V8", "K4cnV2nm8"), ("K8V8", "K2cnV2nm8")]


def random_levels(H: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Bundle-style levels (`levels.{k,v}.{bits}` [1, H, 2**bits]): sorted, endpoints pinned, the inner ones random."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for side in "kv":
        for bits in (2, 3, 4, 8):
            top = (1 << bits) - 1
            inner = torch.rand(1, H, top - 1, generator=gen).sort(-1).values * top
            out[f"levels.{side}.{bits}"] = torch.cat([torch.zeros(1, H, 1), inner, torch.full((1, H, 1), top)], -1)
    return out


def build_store(H: int, d: int, B: int, T: int, high: str, low: str, recent: int, dev: torch.device,
                seed: int = 0) -> CompressedStore:
    """T tokens for every (sequence, KV head): the first T - recent in `low` (whole pages for per-channel keys, so
    the low tier may hold a few tokens less), the last `recent` in `high`."""
    rank = torch.full((1, H), d)
    store = CompressedStore(rank, rank.clone(), [0], high=TierFormat.parse(high), low=TierFormat.parse(low),
                            head_dim=d, batch=B, device=dev, levels=random_levels(H, seed))
    gen = torch.Generator(device=dev).manual_seed(seed)
    b, h = torch.arange(B, device=dev).repeat_interleave(H), torch.arange(H, device=dev).repeat(B)
    n = len(b)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    pos = 0
    if store.low.k_mode == "channel":
        page = store.groups[0][0].layouts[LOW].tokens
        for _ in range((T - recent) // page):
            store.write_pages(0, b, h, rand(n, page, d) * 2, rand(n, page, d),
                              (pos + torch.arange(page, device=dev)).repeat(n, 1),
                              torch.rand(n, page, generator=gen, device=dev))
            pos += page
    chunk = max(1, (1 << 20) // n)
    for side, count in ((LOW, T - recent - pos if store.low.k_mode != "channel" else 0), (HIGH, recent)):
        for start in range(0, count, chunk):
            c = min(chunk, count - start)
            store.append(0, side, b.repeat_interleave(c), h.repeat_interleave(c), rand(n * c, d) * 2, rand(n * c, d),
                         (pos + torch.arange(c, device=dev)).repeat(n), torch.rand(n * c, generator=gen, device=dev))
            pos += c
    return store


def timed_ms(fn, iters: int, dev: torch.device) -> float:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def device_ms(fn, iters: int) -> dict[str, float]:
    """GPU time per call by kernel name (torch's profiler: CUPTI sees the cuda-python launches too), and `all`."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = {e.key: e.self_device_time_total / 1e3 / iters for e in prof.key_averages() if e.self_device_time_total}
    return {**times, "all": sum(times.values())}


def decode_row(backend, geometry: str, B: int, T: int, high: str, low: str, args, dev) -> dict:
    H, g, d = GEOMETRIES[geometry]
    store = build_store(H, d, B, T, high, low, args.recent, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, H, g, 1, d, generator=gen, device=dev)
    kn, vn = torch.randn(B, H, 1, d, generator=gen, device=dev), torch.randn(B, H, 1, d, generator=gen, device=dev)
    scale = d ** -0.5
    ref_store, mine = copy.deepcopy(store), copy.deepcopy(store)
    want, _ = TorchBackend.attend(ref_store, 0, q, kn, vn, scale)
    got, _ = backend.attend(mine, 0, q, kn, vn, scale)
    diff = (got - want).abs().max().item()
    del ref_store, mine
    stored = store.arena.used_bytes()
    kernel_ms = timed_ms(lambda: backend.attend(store, 0, q, kn, vn, scale), args.iters, dev)
    torch_ms = timed_ms(lambda: TorchBackend.attend(store, 0, q, kn, vn, scale), max(3, args.iters // 4), dev)
    dense_k = torch.randn(B, H, T + 1, d, generator=gen, device=dev).half()
    dense_v = torch.randn(B, H, T + 1, d, generator=gen, device=dev).half()
    qd = q.reshape(B, H * g, 1, d).half()
    dense_ms = timed_ms(lambda: F.scaled_dot_product_attention(qd, dense_k, dense_v, enable_gqa=True), args.iters,
                        dev)
    dense_bytes = 2 * dense_k.numel() * dense_k.element_size()
    gpu = {}
    if dev.type == "cuda" and args.gpu_time:
        kernel_gpu = device_ms(lambda: backend.attend(store, 0, q, kn, vn, scale), args.iters)
        gpu = dict(kernel_gpu_ms=kernel_gpu["all"], split_gpu_ms=kernel_gpu.get("decode_split", 0.0),
                   merge_gpu_ms=kernel_gpu.get("decode_merge", 0.0),
                   dense_gpu_ms=device_ms(lambda: F.scaled_dot_product_attention(qd, dense_k, dense_v,
                                                                                 enable_gqa=True), args.iters)["all"])
    return dict(geometry=geometry, H=H, g=g, d=d, batch=B, context=T, high=high, low=low, stored_bytes=stored,
                dense_bytes=dense_bytes, kernel_ms=kernel_ms, torch_ms=torch_ms, dense_ms=dense_ms,
                kernel_GBps=stored / kernel_ms / 1e6, dense_GBps=dense_bytes / dense_ms / 1e6, max_abs_diff=diff,
                out_abs_max=want.abs().max().item(), **gpu)


def append_ms(store: CompressedStore, writer, B: int, H: int, d: int, T: int, iters: int, dev) -> float:
    """ms to append one token to every (sequence, KV head) of `store` through `writer` (None: the store's own)."""
    store.writer = writer
    n = B * H
    b, h = torch.arange(B, device=dev).repeat_interleave(H), torch.arange(H, device=dev).repeat(B)
    keys, values = torch.randn(n, d, device=dev), torch.randn(n, d, device=dev)
    pos, score = torch.full((n,), T, device=dev), torch.rand(n, device=dev)
    return timed_ms(lambda: store.append(0, HIGH, b, h, keys, values, pos, score, distinct=True), iters, dev)


def write_row(backend, geometry: str, B: int, T: int, high: str, low: str, args, dev) -> dict:
    H, g, d = GEOMETRIES[geometry]
    row = dict(geometry=geometry, batch=B, context=T, high=high)
    for name, writer in (("kernel", backend), ("torch", None)):
        row[f"{name}_ms"] = append_ms(build_store(H, d, B, T, high, low, args.recent, dev), writer, B, H, d, T,
                                      args.iters, dev)
    return row


def table(rows: list[dict]) -> str:
    """Markdown rows; `GPU ms` columns (time on the device, from the profiler) when the rows have them."""
    gpu = all("kernel_gpu_ms" in r for r in rows)
    head = ("| shape | B | T | high / low | stored MiB | kernel ms | torch ms | dense ms | "
            + ("kernel GPU ms (split, merge) | dense GPU ms | " if gpu else "")
            + "kernel GB/s | dense GB/s | kernel / dense | max diff |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['geometry']} | {r['batch']} | {r['context']} | {r['high']} / {r['low']} | "
                     f"{r['stored_bytes'] / 2**20:.1f} | {r['kernel_ms']:.3f} | {r['torch_ms']:.3f} | "
                     f"{r['dense_ms']:.3f} | "
                     + (f"{r['kernel_gpu_ms']:.3f} ({r['split_gpu_ms']:.3f}, {r['merge_gpu_ms']:.3f}) | "
                        f"{r['dense_gpu_ms']:.3f} | " if gpu else "")
                     + f"{r['kernel_GBps']:.0f} | {r['dense_GBps']:.0f} | "
                     f"{r['kernel_ms'] / r['dense_ms']:.2f} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="one small row per geometry (a smoke run)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--geometries", nargs="+", choices=list(GEOMETRIES), default=list(GEOMETRIES))
    p.add_argument("--pairs", nargs="+", default=[f"{h}/{lo}" for h, lo in PAIRS], help="high/low tier formats")
    p.add_argument("--recent", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-gpu-time", dest="gpu_time", action="store_false",
                   help="skip the profiler's GPU times (e.g. under ncu, which needs CUPTI to itself)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        from kvcal.runtime.backends.cuda import cuda_status
        from kvcal.runtime.backends.cuda.backend import CudaBackend as backend
        if reasons := backend.supports(dev):
            raise SystemExit(f"cannot run the CUDA kernels here: {'; '.join(reasons)}; `--device cpu` runs their "
                             "CPU emulation")
        print(cuda_status().reason, flush=True)
    else:
        from kvcal.runtime.backends.cuda.emulate import EmulatedCudaBackend as backend
    pairs = [tuple(x.split("/")) for x in args.pairs]
    contexts, batches, pairs = (([512], [2], pairs[:2]) if args.quick else (args.contexts, args.batches, pairs))
    rows, writes = [], []
    for geometry in args.geometries:
        for T in contexts:
            for B in batches:
                for high, low in pairs:
                    rows.append(decode_row(backend, geometry, B, T, high, low, args, dev))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
        writes.append(write_row(backend, geometry, max(batches), min(contexts), *pairs[0], args, dev))
        print(writes[-1], flush=True)
    print(table(rows))
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (emulated kernels)",
                    torch=torch.__version__, recent=args.recent, iters=args.iters)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, decode=rows, write=writes), f, indent=1)


if __name__ == "__main__":
    main()
