"""The CPU prefill (`kvcal_prefill`: output and significance in one pass over the scores) against torch's CPU flash
attention, which gives the output alone, one layer of each packaged model's geometry, timed in the same run.

    python experiments/cpu_prefill.py --context 4096 --threads 2 [--json docs/results/cpu-prefill.json]

The JSON names the CPU: the kernel's register blocks differ with and without AVX-512 (cpu-prefill.json was
made on an AVX-512 CPU, cpu-prefill-avx2.json on one with AVX2 only).

Random float32 queries, keys and values, no padding, causal. Timings are medians over `--reps` calls, the two
interleaved. Before the fused kernel the prefill ran the flash attention and then a significance pass over the same
logits, so the flash attention alone is a lower bound on what that cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

import torch
from cpu_attention import median_ms

from kvcal.runtime.backends.cpu.backend import fused_prefill
from kvcal.runtime.backends.cpu.build import cpu_name

# (KV heads, query heads per KV head, head size) of one layer
GEOMETRY = {"smollm2-135m": (3, 3, 64), "qwen2.5-coder-1.5b": (2, 6, 128), "gemma3-270m": (1, 4, 256)}


def flash(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's CPU flash attention over [B, H, g, n, d] queries, the KV heads repeated for their group."""
    B, H, g, n, d = query.shape
    k = keys[:, :, None].expand(B, H, g, n, d).reshape(B, H * g, n, d)
    v = values[:, :, None].expand(B, H, g, n, d).reshape(B, H * g, n, d)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query.reshape(B, H * g, n, d), k, v, 0.0, True,
                                                                      scale=scale)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, rows = args.context, []
    for model, (H, g, d) in GEOMETRY.items():
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*shape, generator=gen) for shape in ((1, H, g, n, d), (1, H, n, d), (1, H, n, d)))
        mask = torch.ones(1, n, n, dtype=torch.bool).tril()
        calls = {"fused": partial(fused_prefill, q, k, v, mask, d ** -0.5), "flash": partial(flash, q, k, v, d ** -0.5)}
        for fn in calls.values():                               # builds the library; warms both
            fn()
        times = {name: [] for name in calls}
        for _ in range(args.reps):
            for name, fn in calls.items():
                times[name].append(median_ms(fn, 1))
        fused_ms, flash_ms = (statistics.median(times[name]) for name in calls)
        rows.append({"model": model, "kv_heads": H, "group": g, "head_dim": d, "context": n,
                     "fused_ms": round(fused_ms, 1), "flash_ms": round(flash_ms, 1),
                     "ratio": round(fused_ms / flash_ms, 3)})
        print(f"{model:20} H={H} g={g} d={d}: fused (output + significance) {fused_ms:7.1f} ms, "
              f"flash attention (output) {flash_ms:7.1f} ms, ratio {fused_ms / flash_ms:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
            meta = {"cpu": cpu_name(), "avx512": avx512, "threads": args.threads, "reps": args.reps}
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
