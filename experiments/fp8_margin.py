"""Why `kvcal export --format vllm-fp8` defaults to `--margin 2`: FP8 (E4M3) round trips of held-out K/V with scales
from the calibration statistics, at margins 1 (llm-compressor's min-max scale) and 2, per tensor and per head.

    python experiments/fp8_margin.py --model smollm2-135m [--json out/fp8-margin-smollm2-135m.json]

The bundle is calibrated on the fly (statistics passes only; its `k.absmax` / `v.absmax` come from 8192 tokens of
calibration text). Held-out K/V: 4 windows of 1024 tokens of evaluation text (documents disjoint from calibration).
Reported per (strategy, margin): mean relative squared error, worst element error relative to its head's max |x|,
and how many (layer, K/V, head) scales saturate (held-out max beyond 448 · scale).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.export import fp8_round_trip, fp8_scales
from kvcal.models import load_model
from kvcal.profile.calibrate import statistics_bundle
from kvcal.profile.capture import capturing


class Keep:
    """Keeps each layer's post-RoPE K and V of the last forward (a few MB for a small model)."""

    def __init__(self):
        self.k, self.v = {}, {}

    def add(self, layer, query, key, value):
        self.k.setdefault(layer, []).append(key.float())
        self.v.setdefault(layer, []).append(value.float())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib-tokens", type=int, default=8192, help="random and text tokens of the calibration")
    ap.add_argument("--windows", type=int, default=4, help="held-out windows of evaluation text")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per window (calibration and held-out)")
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.model)
    bundle = statistics_bundle(lm, model=args.model, random_tokens=args.calib_tokens, text_tokens=args.calib_tokens,
                               seq_len=args.seq_len)
    keep = Keep()
    ids = token_windows(lm.tokenizer, load_corpus("default", "eval"), args.windows, args.seq_len, seed=0)
    with torch.no_grad(), capturing(lm.model, keep):
        for row in ids:
            lm.model(input_ids=row[None], use_cache=False, logits_to_keep=1)
    rows, overshoot = [], []
    for strategy in ("tensor", "head"):
        for margin in (1.0, 2.0):
            k_scale, v_scale = fp8_scales(bundle, strategy, margin)
            rel, worst, saturated, n = 0.0, 0.0, 0, 0
            for layer in sorted(keep.k):
                for x, s in ((torch.cat(keep.k[layer]), k_scale[layer]), (torch.cat(keep.v[layer]), v_scale[layer])):
                    xh = fp8_round_trip(x, s)
                    head_max = x.abs().amax(dim=(0, 2, 3))                                # [H]
                    rel += (((xh - x) ** 2).sum((0, 2, 3)) / (x ** 2).sum((0, 2, 3))).mean().item()
                    worst = max(worst, ((xh - x).abs() / head_max[None, :, None, None]).amax().item())
                    saturated += int((head_max > 448 * s.reshape(-1).expand_as(head_max)).sum())
                    n += 1
            rows.append({"strategy": strategy, "margin": margin, "mean_rel_sq_error": rel / n,
                         "worst_element_error_vs_head_max": worst, "saturated_scales": saturated})
            print(f"{strategy:6} margin {margin:g}: mean rel sq error {rel / n:.2e}  worst element error "
                  f"{worst:.1%} of head max  saturated {saturated}")
    for layer in sorted(keep.k):
        overshoot.append((torch.cat(keep.k[layer]).abs().amax((0, 2, 3)) / bundle.extras["k.absmax"][layer]).max())
        overshoot.append((torch.cat(keep.v[layer]).abs().amax((0, 2, 3)) / bundle.extras["v.absmax"][layer]).max())
    print(f"held-out max / calibration max: up to {max(overshoot):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": lm.name, "held_out_tokens": int(ids.numel()), "rows": rows,
                       "max_overshoot": float(max(overshoot))}, f, indent=2)


if __name__ == "__main__":
    main()
