"""Does the batched teacher-forced probe measure what stepwise decode measures? One table row per setting.

    python benchmarks/probe_validation.py --model smollm2-135m --bundle artifacts/smollm2-135m.kvcal.safetensors \
        [--windows 4 --prompt 1024 --steps 128 --chunk 32] [--json docs/results/probe-validation-smollm2-135m.json]

Both probes replay the same recorded prefill (`DecodeProbe`) of `--windows` windows of held-out calibration text
(the corpus's search split) and score the same `--steps` continuation tokens per window, float32. Stepwise: one
token per forward pass, as users decode. Batched: `--chunk` tokens per forward pass over the compressed store, the
policy steps run per token. The settings cover precisions, low-rank, DiffKV tiers (both low-tier key modes, both
threshold bases, pruning) and FastGen eviction.

"agrees" compares the top-1 difference with its sampling noise: two standard errors of a difference of two
proportions over `predictions` each (the two probes share their inputs, so this is conservative).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import time

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.models import load_model
from kvcal.profile.quality import DecodeProbe
from kvcal.profile.ranks import ranks_of
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.fastgen import FastGenConfig
from kvcal.runtime.layout import TierFormat

FASTGEN = FastGenConfig(r_local=0.3, r_frequent=0.3)      # what calibrate's search records (search.FASTGEN)


def settings(window: int) -> dict[str, CompressionConfig]:
    base = CompressionConfig().with_tiering(window=window)
    tiers = base.with_tiering(alpha_high=2.0, alpha_low=0.0)
    return {
        "K16V16 (fp16 store)": base.with_(high=TierFormat(16, 16)),
        "K8V8": base.with_(high=TierFormat.parse("K8V8")),
        "K8V4": base,
        "K8V4g16": base.with_(high=TierFormat.parse("K8V4g16")),
        "K8V8, qk rate 0.04, v rate 0.04": base.with_(high=TierFormat.parse("K8V8"), qk_removal_rate=0.04,
                                                      v_removal_rate=0.04),
        "K8V4/K4cV2 a=(1,0)": base.with_tiering(alpha_high=1.0, alpha_low=0.0),
        "K8V4/K4cV2 a=(2,0)": tiers,
        "K8V4/K4cV2 a=(2,1) (prunes)": tiers.with_tiering(alpha_low=1.0),
        "K8V4/K4V2 a=(2,0.5) (prunes)": tiers.with_(low=TierFormat.parse("K4V2")).with_tiering(alpha_low=0.5),
        "K8V4/K4cV2 a=(2,1) base 1/i": tiers.with_tiering(alpha_low=1.0, threshold_base="position"),
        "K8V8 + FastGen T=0.95": base.with_(high=TierFormat.parse("K8V8"),
                                            fastgen=dataclasses.replace(FASTGEN, recovery=0.95)),
        "K8V4g16/K4cV2 a=(2,0) + FastGen T=0.9": tiers.with_(high=TierFormat.parse("K8V4g16"),
                                                              fastgen=dataclasses.replace(FASTGEN, recovery=0.9)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a bundle of --model (e.g. from `kvcal calibrate --no-search`)")
    ap.add_argument("--windows", type=int, default=4, help="windows (sequences of the batch)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per window")
    ap.add_argument("--steps", type=int, default=128, help="scored continuation tokens per window")
    ap.add_argument("--chunk", type=int, default=32, help="continuation tokens per forward pass of the batched probe")
    ap.add_argument("--window", type=int, default=64, help="DiffKV window W of every setting")
    ap.add_argument("--only", help="comma list of setting numbers (1-based) to run, for a quick look")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    lm = load_model(args.model)
    lm.model.to(torch.float32)
    bundle = load_bundle(args.bundle)
    ids = token_windows(lm.tokenizer, load_corpus("default", "search"), args.windows, args.prompt + args.steps + 1, 1)
    t0 = time.perf_counter()
    probe = DecodeProbe(lm.model, bundle, ids[:, :args.prompt], ids[:, args.prompt:], tokenizer=lm.tokenizer,
                        fastgen=FASTGEN)
    prefill_seconds = time.perf_counter() - t0
    rows = []
    chosen = settings(args.window)
    keep = {int(i) for i in args.only.split(",")} if args.only else set(range(1, len(chosen) + 1))
    print(f"{'setting':40} {'bytes':>6} {'top-1 step':>10} {'batched':>8} {'KL step':>8} {'batched':>8} "
          f"{'ppl step':>8} {'batched':>8} {'s step':>7} {'batched':>7} agrees", flush=True)
    for i, (name, cfg) in enumerate(chosen.items(), 1):
        if i not in keep:
            continue
        qk_rank, v_rank = ranks_of(bundle, cfg)
        b = dataclasses.replace(bundle, qk_rank=qk_rank, v_rank=v_rank)
        row = {"setting": name, "policy": cfg.to_dict()}
        for label, chunk in (("stepwise", 1), ("batched", args.chunk)):
            t = time.perf_counter()
            f = probe.measure(cfg, b, chunk=chunk)
            row[label] = {"top1": f.top1, "kl": f.kl, "ppl_ratio": f.ppl_ratio, "bytes_ratio":
                          f.memory["ratio_to_fp16"], "tiers": f.tiers, "predictions": f.predictions,
                          "seconds": round(time.perf_counter() - t, 2)}
        s, bt = row["stepwise"], row["batched"]
        n = s["predictions"]
        noise = 2 * math.sqrt((s["top1"] * (1 - s["top1"]) + bt["top1"] * (1 - bt["top1"])) / n)
        row["top1_noise_2se"] = noise
        row["agrees"] = abs(s["top1"] - bt["top1"]) <= max(noise, 1 / n)
        rows.append(row)
        print(f"{name:40} {s['bytes_ratio']:6.3f} {s['top1']:10.4f} {bt['top1']:8.4f} {s['kl']:8.4f} {bt['kl']:8.4f} "
              f"{s['ppl_ratio']:8.4f} {bt['ppl_ratio']:8.4f} {s['seconds']:7.1f} {bt['seconds']:7.1f} "
              f"{'yes' if row['agrees'] else 'NO'}", flush=True)
        if args.json:          # after every row: a run cut short still leaves its rows
            with open(args.json, "w") as fh:
                json.dump({"model": args.model, "bundle": args.bundle, "windows": args.windows, "prompt":
                           args.prompt, "steps": args.steps, "chunk": args.chunk, "window": args.window, "threads":
                           torch.get_num_threads(), "machine": platform.machine(), "prefill_seconds":
                           round(prefill_seconds, 2), "rows": rows}, fh, indent=2)
    step_s = sum(r["stepwise"]["seconds"] for r in rows)
    batch_s = sum(r["batched"]["seconds"] for r in rows)
    print(f"{sum(r['agrees'] for r in rows)}/{len(rows)} agree; stepwise {step_s:.0f} s, batched {batch_s:.0f} s "
          f"({step_s / max(batch_s, 1e-9):.1f}x); shared prefill {prefill_seconds:.0f} s")

if __name__ == "__main__":
    main()
