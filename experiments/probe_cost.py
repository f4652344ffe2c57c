"""What the search's probe costs before it measures anything: one recorded dense prefill (with the FastGen statistics
the search records) and the dense reference logits, against a plain forward over the same prompts.

    python experiments/probe_cost.py --model smollm2-135m --bundle artifacts/smollm2-135m.kvcal.safetensors \
        --context 4096 --windows 1 --json out/probe-cost-smollm2-135m.json

Float32, random token ids (the cost does not depend on the text). The ratio to the plain forward, measured in the same
run, is the figure to compare between versions and machines.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcal.eval import DecodeProbe
from kvcal.models import load_model
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.policies.fastgen import FastGenConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--context", type=int, default=4096, help="prompt + continuation + 1 tokens per window")
    ap.add_argument("--steps", type=int, default=256, help="continuation tokens scored per window")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    lm = load_model(args.model, dtype="float32")
    bundle = load_bundle(args.bundle)
    P = args.context - args.steps - 1
    g = torch.Generator().manual_seed(0)
    vocab = lm.model.config.vocab_size
    skip = min(100, vocab // 4)                 # ids clear of the special tokens at either end of the vocabulary
    ids = torch.randint(skip, vocab - skip, (args.windows, args.context), generator=g)
    with torch.inference_mode():
        t = time.perf_counter()
        lm.model.model(input_ids=ids[:, :P], use_cache=False)
        plain = time.perf_counter() - t
    t = time.perf_counter()
    DecodeProbe(lm.model, bundle, ids[:, :P], ids[:, P:], tokenizer=lm.tokenizer, fastgen=FastGenConfig())
    probe = time.perf_counter() - t
    result = {"model": args.model, "windows": args.windows, "prompt": P, "steps": args.steps,
              "plain_forward_s": round(plain, 2), "probe_s": round(probe, 2),
              "probe_over_plain": round(probe / plain, 2)}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
