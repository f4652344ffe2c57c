"""A bundle's own settings, measured stepwise on `kvcal bench --quick`'s held-out windows, with a chosen attention
backend: the kvcal-joint row's quality without the rest of the bench, to compare commits or backends.

    python experiments/joint_quality.py --bundle artifacts/smollm2-135m.kvcal.safetensors --backend torch

Same windows as the bench (eval split of the default corpus, seed 0, 4 windows of 512 + 32 + 1 tokens), float32.
"""

from __future__ import annotations

import argparse
import json

from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe
from kvcal.models import load_model
from kvcal.runtime.bundle import load_bundle

try:                                   # older commits (to compare with) held the config in runtime.cache
    from kvcal.runtime.config import CompressionConfig
except ImportError:
    from kvcal.runtime.cache import CompressionConfig
try:
    from kvcal.runtime.options import ServeOptions
except ImportError:                    # older commits: the backend was a CompressionConfig field
    ServeOptions = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--backend", default="auto", help="auto, torch, cpu or cuda")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()

    lm = load_model(args.model, dtype="float32")
    bundle = load_bundle(args.bundle)
    w = token_windows(lm.tokenizer, load_corpus("default", "eval"), args.windows, args.prompt + args.steps + 1, 0)
    probe = DecodeProbe(lm.model, bundle, w[:, :args.prompt], w[:, args.prompt:], tokenizer=lm.tokenizer)
    settings = bundle.settings if hasattr(bundle, "settings") else bundle.policy          # older commits: .policy
    config = (CompressionConfig.from_dict(settings) if hasattr(CompressionConfig, "from_dict")
              else CompressionConfig.from_policy(settings))
    fid = (probe.measure(config, serve=ServeOptions(backend=args.backend)) if ServeOptions is not None
           else probe.measure(config.with_(backend=args.backend)))
    print(json.dumps({"backend": args.backend, "ratio_to_fp16": fid.memory["ratio_to_fp16"], "top1": fid.top1,
                      "kl": fid.kl, "ppl_ratio": fid.ppl_ratio}))


if __name__ == "__main__":
    main()
