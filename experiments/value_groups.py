"""Where do the high tiers between K8V4 and K8V8 land? Value groups (`gN`: one fp16 scale and zero per N channels).

    python experiments/value_groups.py --bundle artifacts/smollm2-135m.kvcal.safetensors \
        [--json out/value-groups-smollm2-135m.json]

Uniform stores (no tiers, full rank, the bundle's rotations with mixing), fidelity vs dense on held-out calibration
text: DecodeProbe on the corpus's search split, 8 windows of 512-token prompts + 64 teacher-forced steps (512
predictions), float32. This is the measurement behind `kvcal.profile.search.PRECISION_LADDER`.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe
from kvcal.models import load_model
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.storage.layout import TierFormat

TIERS = ("K8V4", "K8V4g32", "K8V4g16", "K8V4g16kg32", "K8V8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.model)
    lm.model.to(torch.float32)
    bundle = load_bundle(args.bundle)
    ids = token_windows(lm.tokenizer, load_corpus("default", "search"), args.windows, args.prompt + args.steps + 1, 1)
    probe = DecodeProbe(lm.model, bundle, ids[:, :args.prompt], ids[:, args.prompt:])
    base = CompressionConfig(use_ranks=False)
    rows = []
    for tier in TIERS:
        r = probe.measure(base.with_(high=TierFormat.parse(tier)))
        rows.append({"high": tier, "bytes_ratio": r.memory["ratio_to_fp16"], "top1": r.top1, "kl": r.kl,
                     "ppl_ratio": r.ppl_ratio, "predictions": r.predictions})
        print(f"{tier:12} bytes/fp16 {rows[-1]['bytes_ratio']:.3f}  top-1 {r.top1:.3f}  KL {r.kl:.4f}  "
              f"ppl ratio {r.ppl_ratio:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "bundle": args.bundle, "windows": args.windows, "prompt": args.prompt,
                       "steps": args.steps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
