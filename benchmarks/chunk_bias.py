"""A bundle's own settings measured as the search measures them and as the decision checks them.

    python benchmarks/chunk_bias.py --model smollm2-135m --bundle smollm2-135m-1k-bits.kvcal.safetensors \
        --json docs/results/chunk-bias-smollm2-135m.json

Rows, all through the runtime (`DecodeProbe`, float32, the bundle's ranks and settings), at `kvcal calibrate
--context 1024`'s shapes (767 prompt tokens + 256 teacher-forced tokens per window):

* the search split's 4 windows (the search's own windows and seed), batched at each `--chunks` size: 32 is the
  search's probe, 1 is stepwise decode;
* the evaluation split's 2 windows, stepwise: the decision's check (`calibrate.decide`).

The gap between the batched and stepwise rows is the probe's optimism; the gap between the two stepwise rows is the
texts' difference. Both are why the decision searches safer points (docs/calibration.md, "The decision").
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.models import load_model
from kvcal.profile.calibrate import CalibrationConfig
from kvcal.profile.quality import DecodeProbe
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.fastgen import FastGenConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a searched bundle of --model (its settings are measured)")
    ap.add_argument("--chunks", default="32,8,1", help="batched chunk sizes on the search windows (1: stepwise)")
    ap.add_argument("--prompt", type=int, default=767)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    cal = CalibrationConfig()
    lm = load_model(args.model)
    lm.model.to(torch.float32)
    bundle = load_bundle(args.bundle)
    config = CompressionConfig.from_dict(bundle.settings)
    P, n = args.prompt, args.prompt + args.steps + 1
    runs = [("search", cal.search_windows, cal.seed + 1, int(c)) for c in args.chunks.split(",")]
    runs.append(("eval", cal.eval_windows, cal.seed + 2, 1))
    probes, rows = {}, []
    for split, windows, seed, chunk in runs:
        if split not in probes:
            w = token_windows(lm.tokenizer, load_corpus(cal.dataset, split), windows, n, seed, long_first=True)
            probes[split] = DecodeProbe(lm.model, bundle, w[:, :P], w[:, P:], tokenizer=lm.tokenizer,
                                        fastgen=FastGenConfig())
        t = time.perf_counter()
        f = probes[split].measure(config, bundle, chunk=chunk)
        row = {"split": split, "windows": windows, "chunk": chunk, "bytes_ratio": f.memory["ratio_to_fp16"],
               "top1": f.top1, "kl": f.kl, "ppl_ratio": f.ppl_ratio, "predictions": f.predictions,
               "seconds": round(time.perf_counter() - t, 1)}
        rows.append(row)
        print(f"{split:6} x{windows} chunk {chunk:3}  bytes {row['bytes_ratio']:.3f}  top-1 {f.top1:.4f}  "
              f"KL {f.kl:.4f}  ppl {f.ppl_ratio:.4f}  {row['seconds']:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "settings": bundle.settings, "threads": torch.get_num_threads(),
                       "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
