"""Does the quality model (kvcal.profile.quality_model) order allocations as the serving runtime measures them?

    python experiments/predicted_vs_measured.py --model smollm2-135m --bundle artifacts/smollm2-135m.kvcal.safetensors \
        --context 1024 --allocations 20 --json docs/results/predicted-vs-measured-smollm2-135m.json

Draws `--allocations` random per-layer (K bits, V bits) assignments over the catalogue (`quality_model.BITS`) on
the allocation's base settings (`allocate.base_settings`), each with its own aggressiveness so that they spread
from nearly all 8-bit to nearly all 2-bit, predicts each one's loss from one recording pass, measures each one's KL
against dense with the search's batched decode probe on the search split, and prints Spearman's rank correlation
with a Markdown table (docs/calibration.md, "Predicted against measured").
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe
from kvcal.models import load_model
from kvcal.profile.allocate import base_settings, to_config
from kvcal.profile.quality_model import BITS, record_costs, spearman
from kvcal.profile.ranks import ranks_of
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.storage.bases import served_bases


def random_bits(layers: int, generator: torch.Generator) -> torch.Tensor:
    """long [layers, 2]: P(8, 4, 2 bits) = ((1-p)², 2p(1-p), p²) with p ~ U(0, 1) drawn once per allocation."""
    p = torch.rand((), generator=generator, dtype=torch.float64)
    probs = torch.stack([(1 - p) ** 2, 2 * p * (1 - p), p ** 2])
    choice = torch.multinomial(probs, layers * 2, replacement=True, generator=generator)
    return torch.tensor(BITS)[choice].view(layers, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a bundle of this model (rotations and bases)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=256, help="scored continuation tokens per window")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--allocations", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    lm = load_model(args.model, dtype="float32")
    bundle = load_bundle(args.bundle)
    windows = token_windows(lm.tokenizer, load_corpus("default", "search"), args.windows, args.context, args.seed + 1,
                            long_first=True)
    prompt = args.context - args.steps - 1
    base = base_settings(lm.adapter.layer_types)
    t0 = time.perf_counter()
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base,
                          bundle.extras.get("qk.smoothing"))
    costs = record_costs(lm.model, windows, args.steps, served, base, lm.adapter.layer_types, lm.adapter.head_dim)
    record_seconds = time.perf_counter() - t0
    probe = DecodeProbe(lm.model, bundle, windows[:, :prompt], windows[:, prompt:], tokenizer=lm.tokenizer)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for i in range(args.allocations):
        bits = random_bits(len(lm.adapter.layer_types), gen)
        t = time.perf_counter()
        fid = probe.measure(to_config(base, costs, bits))
        rows.append({"allocation": i, "bits": bits.tolist(), "predicted": costs.predicted(bits),
                     "measured_kl": fid.kl, "top1": fid.top1, "bytes_ratio": fid.memory["ratio_to_fp16"],
                     "seconds": round(time.perf_counter() - t, 1)})
        print(f"{i:3d}  predicted {rows[-1]['predicted']:10.4g}  measured KL {fid.kl:.5f}  top-1 {fid.top1:.3f}  "
              f"bytes {rows[-1]['bytes_ratio']:.3f}", flush=True)
    rho = spearman([r["predicted"] for r in rows], [r["measured_kl"] for r in rows])
    out = {"model": args.model, "context": args.context, "steps": args.steps, "windows": args.windows,
           "base": base.to_dict(), "record_seconds": round(record_seconds, 1),
           "spearman": rho, "rows": rows}
    print(f"\n{args.model} at {args.context}: Spearman {rho:.3f} over {len(rows)} allocations "
          f"(recording {record_seconds:.0f} s)\n")
    print("| allocation | predicted loss | measured KL | top-1 | bytes / fp16 |\n|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: r["predicted"]):
        print(f"| {r['allocation']} | {r['predicted']:.4g} | {r['measured_kl']:.5f} | {r['top1']:.3f} | "
              f"{r['bytes_ratio']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
