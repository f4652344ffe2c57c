"""Channel smoothing (kvcal.profile.smoothing) on and off, for the formats it may help.

    python experiments/smoothing.py --model gemma3-270m --bundle gemma3-270m.kvcal.safetensors \
        --json docs/results/smoothing-gemma3-270m.json

Every row is served by the runtime (DecodeProbe with the search's batched probe, 32 tokens a pass) on the search
split (`default:search`, 4 windows of 767 prompt tokens + 256 teacher-forced tokens: what `kvcal calibrate
--context 1024` measures), full rank, the bundle's rotations with mixing. A bundle without `qk.smoothing` gets the
factors here the way `kvcal calibrate` fits them (the key-range pass's windows of calibration text). Smoothing
changes no byte, so each pair differs in quality only.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcal.data import load_corpus, position_offsets, token_windows
from kvcal.eval import DecodeProbe
from kvcal.models import load_model
from kvcal.profile.allocate import PAGE_TOKENS as RESIDUAL_PAGE_TOKENS
from kvcal.profile.key_ranges import DEFAULT_PERCENTILE, DEFAULT_WINDOWS, spread_windows
from kvcal.profile.passes import key_range_pass
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.storage.layout import TierFormat

FULL = CompressionConfig(use_ranks=False)
RESIDUAL = FULL.with_(high=TierFormat.parse("K16V16"), page_tokens=RESIDUAL_PAGE_TOKENS).with_tiering(
    window=16, alpha_high=64.0, alpha_low=0.0)
ROWS = {
    "K8V4 per-token": FULL,
    "K4V4 per-token": FULL.with_(high=TierFormat.parse("K4V4")),
    "fp16 W=16 / K4cV4, a=(64,0)": RESIDUAL.with_(low=TierFormat.parse("K4cV4")),
    "fp16 W=16 / K4cV2, a=(64,0)": RESIDUAL.with_(low=TierFormat.parse("K4cV2")),
}
SLIDING_ROWS = {      # models with sliding-window layers: those layers' per-token formats, global layers K8V4
    "sliding K8V4, K8V4": FULL.with_(sliding=TierFormat.parse("K8V4")),
    "sliding K4V4, K8V4": FULL.with_(sliding=TierFormat.parse("K4V4")),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--prompt", type=int, default=767)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    lm = load_model(args.model)
    bundle = load_bundle(args.bundle)
    if "qk.smoothing" not in bundle.extras:
        seq = args.prompt + args.steps + 1
        text = token_windows(lm.tokenizer, load_corpus("default", "calib"), 8, seq, 0)
        offsets = position_offsets(8, seq, 8 * seq)          # as calibrate spreads its windows
        picked = spread_windows(len(text), DEFAULT_WINDOWS)
        *_, bundle.extras["qk.smoothing"] = key_range_pass(lm, bundle.qk_rotation, text[picked],
                                                           [offsets[i] for i in picked], DEFAULT_PERCENTILE)
    lm.model.to(torch.float32)
    P, M = args.prompt, args.steps
    windows = token_windows(lm.tokenizer, load_corpus("default", "search"), args.windows, P + M + 1, 1,
                            long_first=True)
    probe = DecodeProbe(lm.model, bundle, windows[:, :P], windows[:, P:], tokenizer=lm.tokenizer)
    rows = {**(SLIDING_ROWS if "sliding_attention" in bundle.model.layer_types else {}), **ROWS}
    D = bundle.extras["qk.smoothing"]
    out = {"model": args.model, "bundle": args.bundle, "prompt": P, "steps": M, "windows": args.windows,
           "factors": {"min": float(D.min()), "max": float(D.max())}, "rows": []}
    for label, config in rows.items():
        for smooth in (False, True):
            t0 = time.perf_counter()
            fid = probe.measure(config.with_(smooth=smooth))
            row = {"label": label, "smooth": smooth, "bytes_ratio": round(fid.memory["ratio_to_fp16"], 4),
                   "top1": round(fid.top1, 4), "ppl_ratio": round(fid.ppl_ratio, 4), "kl": round(fid.kl, 5),
                   "seconds": round(time.perf_counter() - t0, 1)}
            out["rows"].append(row)
            print(f"{label:30} smooth={smooth!s:5}  bytes {row['bytes_ratio']:.3f}  top-1 {row['top1']:.3f}  "
                  f"ppl {row['ppl_ratio']:.3f}  KL {row['kl']:.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
