"""Per-token key formats against the residual family (fp16 high tier over per-channel low pages), on one model.

    python benchmarks/key_formats.py --model qwen2.5-coder-1.5b --bundle qwen.kvcal.safetensors \
        --prompt 1024 --windows 4 --steps 64 --json docs/results/key-formats-qwen2.5-coder-1.5b.json

Every row is served by the runtime (DecodeProbe: the runtime's write and decode paths) on held-out evaluation text
(`default:eval`), full rank, the bundle's rotations with mixing unless the row says "model basis". Bytes are
everything the page arena holds at the end of the run (fp16 window, waiting tokens, metadata, partly filled pages),
over an fp16 cache of the same tokens. This is the measurement behind `kvcal.profile.search.RESIDUAL_*`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcal.bundle import load_bundle
from kvcal.data import load_corpus, token_windows
from kvcal.models import load_model
from kvcal.profile.quality import DecodeProbe, QualityTarget
from kvcal.profile.search import RESIDUAL_PAGE_TOKENS
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.diffkv import EVERY_TOKEN_LOW, TieringConfig
from kvcal.runtime.layout import TierFormat

# (label, high tier, low tier or None, window, alpha_high, alpha_low, rotate)
ROWS = (
    ("K8V8 per-token", "K8V8", None, 64, None, 0.0, True),
    ("K8V4 per-token", "K8V4", None, 64, None, 0.0, True),
    ("K4V4 per-token", "K4V4", None, 64, None, 0.0, True),
    ("fp16 W=64 / K8cV4", "K16V16", "K8cV4", 64, EVERY_TOKEN_LOW, 0.0, True),
    ("fp16 W=64 / K4cV4", "K16V16", "K4cV4", 64, EVERY_TOKEN_LOW, 0.0, True),
    ("fp16 W=32 / K4cV4", "K16V16", "K4cV4", 32, EVERY_TOKEN_LOW, 0.0, True),
    ("fp16 W=32 / K4cV4, a_h=16", "K16V16", "K4cV4", 32, 16.0, 0.0, True),
    ("fp16 W=32 / K4cV2", "K16V16", "K4cV2", 32, EVERY_TOKEN_LOW, 0.0, True),
    ("fp16 W=32 / K4cV4 model basis (KIVI)", "K16V16", "K4cV4", 32, EVERY_TOKEN_LOW, 0.0, False),
)


def config_of(high: str, low: str | None, window: int, alpha_high, alpha_low: float, rotate: bool):
    cfg = CompressionConfig(use_ranks=False, rotate=rotate, mix=rotate, high=TierFormat.parse(high))
    if low is None:
        return cfg.with_tiering(window=window, alpha_high=None)
    return cfg.with_(low=TierFormat.parse(low), page_tokens=RESIDUAL_PAGE_TOKENS,
                     tiering=TieringConfig(window=window, alpha_high=alpha_high, alpha_low=alpha_low))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a bundle of --model (its rotations and V bases are used)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rows", help="comma-separated row numbers (0-based) to run; default all")
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.model)
    lm.model.to(torch.float32)
    bundle = load_bundle(args.bundle)
    ids = token_windows(lm.tokenizer, load_corpus("default", "eval"), args.windows, args.prompt + args.steps + 1, 1)
    probe = DecodeProbe(lm.model, bundle, ids[:, :args.prompt], ids[:, args.prompt:])
    target = QualityTarget()
    rows = []
    picked = [int(i) for i in args.rows.split(",")] if args.rows else range(len(ROWS))
    for i in picked:
        label, *spec = ROWS[i]
        t0 = time.perf_counter()
        r = probe.measure(config_of(*spec))
        rows.append({"label": label, "bytes_ratio": r.memory["ratio_to_fp16"], "top1": r.top1, "kl": r.kl,
                     "ppl_ratio": r.ppl_ratio, "predictions": r.predictions, "meets": target.met(r),
                     "tiers": r.tiers, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{label:40} bytes/fp16 {rows[-1]['bytes_ratio']:.3f}  top-1 {r.top1:.3f}  KL {r.kl:.4f}  "
              f"ppl ratio {r.ppl_ratio:.3f}  {'meets' if rows[-1]['meets'] else 'misses'}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "bundle": args.bundle, "windows": args.windows,
                           "prompt": args.prompt, "steps": args.steps, "split": "default:eval", "target": str(target),
                           "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
