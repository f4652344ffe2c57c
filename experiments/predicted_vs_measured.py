"""Does the quality model (kvcal.profile.quality_model) order allocations as they measure end to end?

    python experiments/predicted_vs_measured.py --model smollm2-135m --bundle artifacts/smollm2-135m.kvcal.safetensors \
        --allocations 20 --json docs/results/predicted-vs-measured-smollm2-135m.json

Draws `--allocations` random per-layer (K bits, V bits) assignments over the catalogue (`quality_model.BITS`), a
random high-tier format (`quality_model.HIGH`) and heavy-hitter threshold (`quality_model.ALPHAS`), on the
allocation's base settings (`allocate.base_settings`), each with its own aggressiveness so that they spread from
nearly all 8-bit to nearly all 2-bit. It predicts each one's loss from the search's recording (kvcal.profile.
recording) of `--windows` search windows at `--context`, measures each one's KL against dense on the same windows
(`--measure coded`: the search's coded probe, which runs the model over the K/V as the allocation codes them;
`--measure runtime`: the serving runtime, stepwise, with the levels the recording fitted), and prints Spearman's
rank correlation with a Markdown table (docs/calibration.md, "Allocations ordered by predicted loss").

`--layer-steps 5,11,17` measures single steps instead: from every layer at 8 bits, one layer's keys or values at 4
and at 2 bits, each priced by the model (its predicted loss less the all-8-bit one's, summed over the windows'
predictions) and measured (its KL less the all-8-bit one's, per prediction). Where the model prices every step
alike, measured / predicted is the same for all of them, 1 / predictions. `--chunk 32` records as kvcal did before
1428092 (the continuation's graph cut every 32 tokens).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe
from kvcal.models import load_model
from kvcal.profile.allocate import Allocation, base_settings, to_config
from kvcal.profile.coded_probe import CodedProbe
from kvcal.profile.quality_model import ALPHAS, BASE_ALPHA, BITS, HIGH, bundle_levels, spearman
from kvcal.profile.ranks import ranks_of
from kvcal.profile.recording import record_search
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.storage.bases import served_bases


def random_bits(layers: int, generator: torch.Generator) -> torch.Tensor:
    """long [layers, 2]: P(8, 4, 2 bits) = ((1-p)², 2p(1-p), p²) with p ~ U(0, 1) drawn once per allocation."""
    p = torch.rand((), generator=generator, dtype=torch.float64)
    probs = torch.stack([(1 - p) ** 2, 2 * p * (1 - p), p ** 2])
    choice = torch.multinomial(probs, layers * 2, replacement=True, generator=generator)
    return torch.tensor(BITS)[choice].view(layers, 2)


def layer_steps(args, costs, measure, layers: int, predictions: int, record_seconds: float, base) -> None:
    """The `--layer-steps` table (module docstring)."""
    every = torch.full((layers, 2), 8, dtype=torch.long)
    first = measure(Allocation.of(costs, every, 0, BASE_ALPHA))
    start = costs.predicted(every, 0, BASE_ALPHA)
    rows = []
    for layer in (int(x) for x in args.layer_steps.split(",")):
        for side, name in enumerate("KV"):
            for bits in (4, 2):
                step = every.clone()
                step[layer, side] = bits
                fid = measure(Allocation.of(costs, step, 0, BASE_ALPHA))
                rows.append({"layer": layer, "side": name, "bits": bits, "top1": fid.top1,
                             "predicted": costs.predicted(step, 0, BASE_ALPHA) - start,
                             "measured_kl": fid.kl - first.kl})
                rows[-1]["ratio"] = rows[-1]["measured_kl"] * predictions / max(rows[-1]["predicted"], 1e-30)
                print(f"layer {layer:2d} {name}{bits}  predicted +{rows[-1]['predicted']:.4g}  measured KL "
                      f"+{rows[-1]['measured_kl']:.3g}  ratio {rows[-1]['ratio']:.2f}", flush=True)
    how = f"in chunks of {args.chunk}" if args.chunk else "whole"
    print(f"\n{args.model} at {args.context}, recording {how}: "
          f"all 8 bits measure KL {first.kl:.3g}, top-1 {first.top1:.3f}; ratio = measured KL x {predictions} "
          "predictions / predicted\n")
    print("| layer | side | bits | predicted loss | measured KL | ratio | top-1 |\n|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layer']} | {r['side']} | {r['bits']} | {r['predicted']:.4g} | {r['measured_kl']:.3g} | "
              f"{r['ratio']:.2f} | {r['top1']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "context": args.context, "steps": args.steps, "windows": args.windows,
                       "chunk": args.chunk, "measure": args.measure, "base": base.to_dict(),
                       "record_seconds": round(record_seconds, 1), "all_8_bits": {"kl": first.kl, "top1": first.top1},
                       "rows": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a bundle of this model (rotations and bases)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=256, help="scored continuation tokens per window")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--allocations", type=int, default=20)
    ap.add_argument("--measure", choices=("coded", "runtime"), default="coded",
                    help="coded: the search's coded probe; runtime: the serving runtime, stepwise (slower)")
    ap.add_argument("--layer-steps", default=None, help="comma-separated layers: measure single-layer steps from "
                    "all 8 bits instead of random allocations (module docstring)")
    ap.add_argument("--chunk", type=int, default=None, help="cut the recording's continuation graph every this many "
                    "tokens (default: one graph)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    lm = load_model(args.model, dtype="float32")
    bundle = load_bundle(args.bundle)
    windows = token_windows(lm.tokenizer, load_corpus("default", "search"), args.windows, args.context, args.seed + 1,
                            long_first=True)
    prompt = args.context - args.steps - 1
    a = lm.adapter
    base = base_settings(a.layer_types)
    t0 = time.perf_counter()
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base,
                          bundle.extras.get("qk.smoothing"))
    recording = record_search(lm.model, windows[:, :prompt], windows[:, prompt:], served, base, list(a.layer_types),
                              a.head_dim, chunk=args.chunk)
    costs = recording.costs
    bundle.extras.update(bundle_levels(recording.levels, len(a.layer_types), a.num_kv_heads))
    record_seconds = time.perf_counter() - t0
    if args.measure == "coded":
        probe = CodedProbe(lm.model, recording, served, base, list(a.layer_types), a.head_dim)
        measure = lambda allocation: probe.measure(costs, allocation)  # noqa: E731
    else:
        runtime = DecodeProbe(lm.model, bundle, windows[:, :prompt], windows[:, prompt:], tokenizer=lm.tokenizer)
        measure = lambda allocation: runtime.measure(to_config(base, costs, allocation))  # noqa: E731
    recording = None
    if args.layer_steps:
        layer_steps(args, costs, measure, len(a.layer_types), windows.shape[0] * args.steps, record_seconds, base)
        return
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for i in range(args.allocations):
        bits = random_bits(len(a.layer_types), gen)
        high = int(torch.randint(len(HIGH), (), generator=gen))
        alpha = int(torch.randint(len(ALPHAS), (), generator=gen))
        t = time.perf_counter()
        fid = measure(Allocation.of(costs, bits, high, alpha))
        rows.append({"allocation": i, "bits": bits.tolist(), "high": HIGH[high], "alpha": ALPHAS[alpha],
                     "predicted": costs.predicted(bits, high, alpha), "measured_kl": fid.kl, "top1": fid.top1,
                     "bytes_ratio": fid.memory["ratio_to_fp16"], "seconds": round(time.perf_counter() - t, 1)})
        print(f"{i:3d}  predicted {rows[-1]['predicted']:10.4g}  measured KL {fid.kl:.5f}  top-1 {fid.top1:.3f}  "
              f"bytes {rows[-1]['bytes_ratio']:.3f}", flush=True)
    rho = spearman([r["predicted"] for r in rows], [r["measured_kl"] for r in rows])
    out = {"model": args.model, "context": args.context, "steps": args.steps, "windows": args.windows,
           "measure": args.measure, "base": base.to_dict(), "record_seconds": round(record_seconds, 1),
           "spearman": rho, "rows": rows}
    print(f"\n{args.model} at {args.context}: Spearman {rho:.3f} over {len(rows)} allocations "
          f"(recording {record_seconds:.0f} s, measured by the {args.measure} probe)\n")
    print("| allocation | high tier | alpha | predicted loss | measured KL | top-1 | bytes / fp16 |\n"
          "|---:|---|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: r["predicted"]):
        print(f"| {r['allocation']} | {r['high']} | {r['alpha']:g} "
              f"| {r['predicted']:.4g} | {r['measured_kl']:.5f} | {r['top1']:.3f} | "
              f"{r['bytes_ratio']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
