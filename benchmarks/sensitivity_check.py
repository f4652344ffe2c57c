"""Does the one-pass sensitivity (kvcal.profile.sensitivity) rank the bits stage's steps as decode probes do?

    python benchmarks/sensitivity_check.py --model smollm2-135m --bundle smollm2-135m-1k-bits.kvcal.safetensors \
        --report docs/results/calibrate-1k-smollm2-135m-bits/smollm2-135m.kvcal.report.json \
        --json docs/results/sensitivity-check-smollm2-135m.json

The report must come from a search that measured one decode probe per (layer, K|V) halving (points labelled
"layer N FORMAT on START", kvcal before the one-pass estimate). This computes the estimate the search now uses for
the same start point, with the search's windows and sizes (`calibrate.SENSITIVITY_WINDOWS`, `SENSITIVITY_TOKENS`),
and compares the two rankings: Spearman's rho over all steps, and where the steps the probes found most harmful
rank in the estimate (the bits stage applies the least sensitive steps first, so those must not rank low).
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch

from kvcal.bundle import load_bundle
from kvcal.data import load_corpus, token_windows
from kvcal.models import load_model
from kvcal.profile.calibrate import SENSITIVITY_TOKENS, SENSITIVITY_WINDOWS, CalibrationConfig
from kvcal.profile.ranks import ranks_of
from kvcal.profile.sensitivity import fisher_sensitivity
from kvcal.runtime.bases import served_bases
from kvcal.runtime.config import CompressionConfig


def ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for r, i in enumerate(order):
        out[i] = r
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--report", required=True, help="calibrate report JSON with stage 'sensitivity' points")
    ap.add_argument("--json", help="write the comparison here")
    args = ap.parse_args()

    path = json.load(open(args.report))["search"]["path"]
    probes = [p for p in path if re.match(r"layer \d+ \S+ on ", p["label"])]      # stage "sensitivity" (or "bits")
    if not probes:
        raise SystemExit(f"{args.report} has no one-layer probes; pass a report of a search that measured them")
    start_label = probes[0]["label"].split(" on ", 1)[1]
    start = next(p for p in path if p["label"] == start_label)
    config = CompressionConfig.from_dict(start["settings"])

    lm = load_model(args.model)
    lm.model.to(torch.float32)
    bundle = load_bundle(args.bundle)
    types = bundle.model.layer_types
    formats = {layer: config.sliding_of(layer) if t == "sliding_attention" else config.low
               for layer, t in enumerate(types)}
    formats = {layer: f for layer, f in formats.items() if f is not None}
    cal = CalibrationConfig()
    P = int(json.load(open(args.report))["search"]["probe"]["prompt"])
    windows = token_windows(lm.tokenizer, load_corpus(cal.dataset, "search"), cal.search_windows,
                            P + cal.search_steps + 1, cal.seed + 1, long_first=True)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, config), config,
                          bundle.extras.get("qk.smoothing"))
    t = time.perf_counter()
    estimate = fisher_sensitivity(lm.model, lm.adapter, windows[:SENSITIVITY_WINDOWS, :SENSITIVITY_TOKENS], served,
                                  formats, config.page_size(bundle.shape[2]), config.low_tracked)
    seconds = time.perf_counter() - t

    measured = {}
    for p in probes:
        layer, fmt = re.match(r"layer (\d+) (\S+) on", p["label"]).groups()
        layer = int(layer)
        side = "k_bits" if fmt.startswith(f"K{formats[layer].k_bits // 2}") else "v_bits"
        measured[(layer, side)] = p["kl"] - start["kl"]
    steps = sorted(set(estimate) & set(measured))
    est, mea = [estimate[s] for s in steps], [measured[s] for s in steps]
    est_rank = dict(zip(steps, ranks(est)))              # 0 = least sensitive
    worst = sorted(steps, key=lambda s: -measured[s])[:10]
    rows = [{"layer": s[0], "side": s[1], "estimate": estimate[s], "measured_kl_added": measured[s],
             "estimate_rank": est_rank[s]} for s in steps]
    summary = {"steps": len(steps), "spearman": spearman(est, mea),
               "spearman_keys": spearman(*zip(*[(estimate[s], measured[s]) for s in steps if s[1] == "k_bits"])),
               "spearman_values": spearman(*zip(*[(estimate[s], measured[s]) for s in steps if s[1] == "v_bits"])),
               "ten_most_harmful_measured_estimate_ranks": [est_rank[s] for s in worst],
               "estimate_seconds": round(seconds, 1), "start": start_label}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, **summary, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
