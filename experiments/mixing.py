"""Does rotating K/V into the calibrated bases hurt per-token quantization, and does mixing fix it?

    python experiments/mixing.py --model smollm2-135m [--json out/mixing-smollm2-135m.json]

Uniform K8V4, K4V4 and K4V2 stores (no tiers), each with: no rotation; the bundle's PCA rotation R / basis B; R, B
followed by the seeded random orthogonal mixing of kvcal.runtime.storage.bases._mixing. Fidelity vs dense on held-out
calibration text (DecodeProbe: 4 windows, 1024-token prompts, 32 teacher-forced steps each).
"""

from __future__ import annotations

import argparse
import json

from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe
from kvcal.models import load_model
from kvcal.profile.calibrate import statistics_bundle
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.storage.layout import TierFormat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--calib-tokens", type=int, default=8192, help="random and text tokens of the calibration")
    ap.add_argument("--calib-seq-len", type=int, default=1024, help="tokens per calibration window")
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.model)
    bundle = statistics_bundle(lm, model=args.model, random_tokens=args.calib_tokens, text_tokens=args.calib_tokens,
                               seq_len=args.calib_seq_len)
    ids = token_windows(lm.tokenizer, load_corpus("default", "search"), args.windows, args.prompt + args.steps + 1, 1)
    probe = DecodeProbe(lm.model, bundle, ids[:, :args.prompt], ids[:, args.prompt:])
    rows = []
    for store in ("K8V4", "K4V4", "K4V2"):
        for label, rotate, mix in (("no rotation", False, False), ("PCA rotation", True, False),
                                   ("PCA rotation + mixing", True, True)):
            cfg = CompressionConfig(high=TierFormat.parse(store), use_ranks=False, rotate=rotate, mix=mix)
            f = probe.measure(cfg)
            rows.append({"store": store, "variant": label, "kl": f.kl, "top1": f.top1, "ppl_ratio": f.ppl_ratio,
                         "bytes_ratio": f.memory["ratio_to_fp16"], "predictions": f.predictions})
            print(f"{store:5} {label:22} KL {f.kl:.4f}  top-1 {f.top1:.3f}  ppl ratio {f.ppl_ratio:.3f}  "
                  f"bytes {f.memory['ratio_to_fp16']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": lm.name, "windows": args.windows, "prompt": args.prompt, "steps": args.steps,
                       "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
