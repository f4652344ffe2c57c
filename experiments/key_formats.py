"""Per-token and static key formats against the residual family (fp16 high tier over per-channel low pages).

    python experiments/key_formats.py --model qwen2.5-coder-1.5b --bundle qwen.kvcal.safetensors \
        --prompt 1024 --windows 4 --steps 64 --json docs/results/key-formats-qwen2.5-coder-1.5b.json

Every row is served by the runtime (DecodeProbe: the runtime's write and decode paths) on held-out evaluation text
(`default:eval`), full rank, the bundle's rotations with mixing unless the row says "model basis". Bytes are
everything the page arena holds at the end of the run (fp16 window, waiting tokens, metadata, partly filled pages),
over an fp16 cache of the same tokens. This is the measurement behind `kvcal.profile.search.RESIDUAL_*`.

Static rows (`K4sV4`: per-channel key scales calibrated offline, no per-token key meta) use the bundle's key ranges;
a bundle without them (schema 1) gets them here the way `kvcal calibrate` fits them: `--key-range-windows` windows
of calibration text (`default:calib`) at the calibration's spread positions, clipped at `--key-percentile`. Their
fixed cost (fp16 scale and zero per key channel, per model) is reported apart (`fixed_bytes`), not in bytes/fp16.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcal.data import load_corpus, position_offsets, token_windows
from kvcal.eval import DecodeProbe, QualityTarget
from kvcal.models import load_model
from kvcal.profile.allocate import PAGE_TOKENS as RESIDUAL_PAGE_TOKENS
from kvcal.profile.key_ranges import DEFAULT_PERCENTILE, DEFAULT_WINDOWS, spread_windows
from kvcal.profile.passes import key_range_pass
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.policies.diffkv import EVERY_TOKEN_LOW, TieringConfig
from kvcal.runtime.storage.layout import TierFormat

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
    ("K8sV4 static", "K8sV4", None, 64, None, 0.0, True),
    ("K4sV4 static", "K4sV4", None, 64, None, 0.0, True),
    ("K4sV2 static", "K4sV2", None, 64, None, 0.0, True),
    ("K8sV8 static", "K8sV8", None, 64, None, 0.0, True),
    ("K4sV4g32 static", "K4sV4g32", None, 64, None, 0.0, True),
    ("K2sV4 static", "K2sV4", None, 64, None, 0.0, True),
    ("fp16 W=32 / K4sV4 static", "K16V16", "K4sV4", 32, EVERY_TOKEN_LOW, 0.0, True),
    ("fp16 W=32 / K4sV2 static", "K16V16", "K4sV2", 32, EVERY_TOKEN_LOW, 0.0, True),
    ("fp16 W=64 / K4sV4 static", "K16V16", "K4sV4", 64, EVERY_TOKEN_LOW, 0.0, True),
    ("K8sV4g16 static", "K8sV4g16", None, 64, None, 0.0, True),
    ("K8V4g16 per-token", "K8V4g16", None, 64, None, 0.0, True),
)


def config_of(high: str, low: str | None, window: int, alpha_high, alpha_low: float, rotate: bool):
    cfg = CompressionConfig(use_ranks=False, rotate=rotate, mix=rotate, high=TierFormat.parse(high))
    if low is None:
        return cfg.with_tiering(window=window, alpha_high=None)
    return cfg.with_(low=TierFormat.parse(low), page_tokens=RESIDUAL_PAGE_TOKENS,
                     tiering=TieringConfig(window=window, alpha_high=alpha_high, alpha_low=alpha_low))


def fit_key_ranges(lm, bundle, percentile: float, windows: int, at_zero: bool = False) -> dict:
    """Fit static key ranges into `bundle.extras` as `kvcal calibrate` does (its seed, windows and positions; every
    window at position 0 with `at_zero`)."""
    cal = bundle.calibration
    seq_len = cal.get("seq_len", 1024)
    n_text = cal.get("text_windows", windows)    # calibrate draws all its text windows; the pass takes a spread few
    picked = spread_windows(n_text, windows)
    ids = token_windows(lm.tokenizer, load_corpus("default", "calib"), n_text, seq_len, cal.get("seed", 0))[picked]
    offsets = cal.get("positions", {}).get("text_offsets") or position_offsets(
        n_text, seq_len, min(lm.adapter.max_positions, 32768))
    offsets = [0] * len(picked) if at_zero else [offsets[i] for i in picked]
    t0 = time.perf_counter()
    low, high = key_range_pass(lm, bundle.qk_rotation, ids, offsets, percentile)
    bundle.extras.update({"k.range_low": low, "k.range_high": high})
    return {"from": "fitted here", "percentile": percentile, "windows": windows, "rows": int(ids.numel()),
            "text_offsets": offsets, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a bundle of --model (its rotations and V bases are used)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rows", help="comma-separated row numbers (0-based) to run; default all")
    ap.add_argument("--json")
    ap.add_argument("--key-percentile", type=float, default=DEFAULT_PERCENTILE,
                    help="static key ranges, when the bundle has none: percentile kept per tail")
    ap.add_argument("--key-range-windows", type=int, default=DEFAULT_WINDOWS,
                    help="static key ranges, when the bundle has none: calibration windows fitted on")
    ap.add_argument("--key-range-positions", choices=("calibration", "prompt"), default="calibration",
                    help="static key ranges, when the bundle has none: fit at the calibration's spread positions "
                         "(what `kvcal calibrate` does) or at positions 0.. like the measured prompts (diagnostic)")
    args = ap.parse_args()
    lm = load_model(args.model)
    lm.model.to(torch.float32)
    bundle = load_bundle(args.bundle)
    picked = [int(i) for i in args.rows.split(",")] if args.rows else range(len(ROWS))
    key_ranges = {"from": "bundle", **bundle.calibration.get("key_ranges", {})}
    if "k.range_low" not in bundle.extras and any(TierFormat.parse(ROWS[i][1]).k_mode == "static" for i in picked):
        key_ranges = fit_key_ranges(lm, bundle, args.key_percentile, args.key_range_windows,
                                    args.key_range_positions == "prompt")
    ids = token_windows(lm.tokenizer, load_corpus("default", "eval"), args.windows, args.prompt + args.steps + 1, 1)
    probe = DecodeProbe(lm.model, bundle, ids[:, :args.prompt], ids[:, args.prompt:])
    target = QualityTarget()
    rows = []
    for i in picked:
        label, *spec = ROWS[i]
        t0 = time.perf_counter()
        r = probe.measure(config_of(*spec))
        rows.append({"label": label, "bytes_ratio": r.memory["ratio_to_fp16"], "top1": r.top1, "kl": r.kl,
                     "ppl_ratio": r.ppl_ratio, "predictions": r.predictions, "meets": target.met(r),
                     "tiers": r.tiers, "fixed_bytes": r.memory.get("fixed_bytes", 0),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{label:40} bytes/fp16 {rows[-1]['bytes_ratio']:.3f}  top-1 {r.top1:.3f}  KL {r.kl:.4f}  "
              f"ppl ratio {r.ppl_ratio:.3f}  {'meets' if rows[-1]['meets'] else 'misses'}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "bundle": args.bundle, "windows": args.windows,
                           "prompt": args.prompt, "steps": args.steps, "split": "default:eval", "target": str(target),
                           "threads": torch.get_num_threads(), "key_ranges": key_ranges, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
