"""Compression against context: a bundle's chosen settings measured on evaluation text at several context lengths.

    python experiments/context_sweep.py --bundle artifacts/smollm2-135m.kvcal.safetensors \
        [--contexts 1024,4096,8192 --windows 2 --steps 256] \
        --json out/context-sweep-smollm2-135m.json --png out/context-sweep-smollm2-135m.png

For each context, `--windows` windows of the corpus's `eval` split (the split calibration never reads), cut from long
documents first, each a prompt of context - steps - 1 tokens and `--steps` teacher-forced continuation tokens through
the runtime (`DecodeProbe`, float32, stepwise decode). Contexts
above the model's maximum are skipped. Bytes are what the page arena holds at the end, against an fp16 dense cache of
the same tokens; "meets" is `QualityTarget.met` with the bundle's recorded target (top-1 at the lower of the Wilson
and per-window bounds, perplexity ratio).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe, QualityTarget
from kvcal.models import load_model
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import CompressionConfig


def plot(rows: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["context"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(x, [1 / r["bytes_ratio"] for r in rows], "o-")
    left.set(xscale="log", xlabel="context (tokens)", ylabel="compression (fp16 bytes / kvcal bytes)",
             title="compression", ylim=(0, max(1 / r["bytes_ratio"] for r in rows) * 1.2))
    right.plot(x, [r["top1"] for r in rows], "o-", label="top-1")
    right.plot(x, [r["top1_bound"] for r in rows], "s--", label="top-1 lower bound")
    right.axhline(rows[0]["target_top1"], color="grey", lw=0.8, label="target")
    right.set(xscale="log", xlabel="context (tokens)", ylabel="top-1 agreement with dense", title="quality")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.minorticks_off()
        ax.set_xticks(x, [str(c) for c in x])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--model", help="the bundle's model (default: the packaged model the bundle names)")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--dataset", default="default")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args()

    bundle = load_bundle(args.bundle)
    lm = load_model(args.model or bundle.model.name, dtype="float32")
    config = CompressionConfig.from_dict(bundle.settings)
    target = QualityTarget(**{k: v for k, v in (bundle.calibration.get("search") or {}).get("target", {}).items()
                              if k in ("top1", "ppl_ratio", "z")})
    limit = getattr(lm.model.config, "max_position_embeddings", None) or 10 ** 9
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        if context > limit:
            print(f"context {context}: above the model's maximum ({limit}), skipped", flush=True)
            continue
        P = context - args.steps - 1
        ids = token_windows(lm.tokenizer, load_corpus(args.dataset, "eval"), args.windows, context, 2,
                            long_first=True)
        t0 = time.perf_counter()
        probe = DecodeProbe(lm.model, bundle, ids[:, :P], ids[:, P:], tokenizer=lm.tokenizer,
                            fastgen=config.fastgen)
        fid = probe.measure(config)
        del probe
        row = {"context": context, "prompt": P, "bytes_ratio": fid.memory["ratio_to_fp16"], "top1": fid.top1,
               "top1_bound": target.top1_bound(fid), "top1_windows": fid.top1_windows, "kl": fid.kl,
               "ppl_ratio": fid.ppl_ratio, "predictions": fid.predictions, "meets": target.met(fid),
               "target_top1": target.top1, "tiers": fid.tiers, "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(f"context {context:6}: bytes {row['bytes_ratio']:.3f} of fp16 ({1 / row['bytes_ratio']:.2f}x)  "
              f"top-1 {row['top1']:.4f} (bound {row['top1_bound']:.4f})  KL {row['kl']:.4f}  "
              f"ppl ratio {row['ppl_ratio']:.4f}  {'meets' if row['meets'] else 'misses'}  ({row['seconds']} s)",
              flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"bundle": args.bundle, "settings": bundle.settings, "windows": args.windows,
                           "steps": args.steps, "split": "eval", "threads":
                           torch.get_num_threads(), "machine": platform.machine(), "rows": rows}, fh, indent=2)
    if args.png and rows:
        plot(rows, f"{bundle.model.name}: the settings of {args.bundle.rsplit('/', 1)[-1]} "
             f"({config.high.name} high tier, {config.low.name} low tier)", args.png)


if __name__ == "__main__":
    main()
