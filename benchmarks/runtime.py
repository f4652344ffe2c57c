"""Runtime benchmark: memory, decode fidelity, passkey retrieval and CPU decode speed of compressed caches vs dense.

    python benchmarks/runtime.py --model smollm2-135m --contexts 1024 4096 \
        [--json docs/results/runtime-smollm2-135m.json]

For each context length P: a prompt of P held-out tokens (text disjoint from calibration), then M teacher-forced
decode steps through each cache (kvcal.profile.quality). Reported per configuration: KV bytes per token actually held
in the page arena (metadata and fragmentation included) and the ratio to an fp16 dense cache, mean KL vs dense,
top-1 agreement, continuation-perplexity ratio, tier fractions, passkey accuracy (depths 0.1/0.5/0.9), CPU decode
ms/step, and the page-management share of a decode step (time in page allocation / step time).

The bundle is calibrated on the fly (8192 random + 8192 text tokens) unless `--bundle` is given. Configurations use
the bundle's rotations at full rank: rank search is the calibration stage's job.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from transformers import DynamicCache

from kvcal.data import load_corpus, token_windows
from kvcal.models import load_model
from kvcal.profile.quality import decode_fidelity, passkey
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.layout import TierFormat
from kvcal.runtime.policy import TokenPolicy


def configs() -> dict[str, CompressionConfig | None]:
    full = CompressionConfig(use_ranks=False)
    return {
        "dense (model dtype)": None,
        "K8V8": full.with_(high=TierFormat(8, 8)),
        "K8V4": full,
        "tiers a=(1,0.5) 1/N": full.with_(policy=TokenPolicy(alpha_high=1.0, alpha_low=0.5)),
        "tiers a=(1,0.5) 1/i": full.with_(policy=TokenPolicy(alpha_high=1.0, alpha_low=0.5, threshold_base="position")),
        "tiers a=(2,1) 1/N": full.with_(policy=TokenPolicy(alpha_high=2.0, alpha_low=1.0)),
        "tiers a=(2,1) 1/i": full.with_(policy=TokenPolicy(alpha_high=2.0, alpha_low=1.0, threshold_base="position")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", help="bundle to use (default: calibrate one now)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=64, help="teacher-forced decode steps per context")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    lm = load_model(args.model, dtype=args.dtype)
    if args.bundle:
        from kvcal import load_bundle

        bundle = load_bundle(args.bundle)
    else:
        import tempfile

        from kvcal.profile.calibrate import CalibrationConfig, calibrate

        with tempfile.TemporaryDirectory() as tmp:
            bundle = calibrate(CalibrationConfig(model=args.model, out=f"{tmp}/b.safetensors", dtype=args.dtype,
                                                 search=False),
                               lm=lm).bundle
    model, tok = lm.model, lm.tokenizer
    eval_docs = load_corpus("default", "eval")
    filler = "\n\n".join(load_corpus("pydoc", "all").documents)
    results = []
    for P in args.contexts:
        ids = token_windows(tok, eval_docs, 1, P + args.steps + 1, seed=args.seed)
        for name, cfg in configs().items():
            make = (lambda: DynamicCache(config=model.config)) if cfg is None else \
                (lambda cfg=cfg: KvcalCache.from_bundle(bundle, model, cfg))
            t0 = time.perf_counter()
            fid = decode_fidelity(model, ids[:, :P], ids[:, P:], make)
            pk = passkey(model, tok, filler, [P], [0.1, 0.5, 0.9], make, seed=args.seed)
            row = {"context": P, "config": name, **fid.__dict__, "passkey": pk["accuracy"],
                   "passkey_cases": pk["cases"], "seconds": round(time.perf_counter() - t0, 1)}
            row["page_share"] = row["page_ms_per_step"] / row["decode_ms_per_step"] if cfg else 0.0
            results.append(row)
            mem = row["memory"].get("ratio_to_fp16", float("nan")) if cfg else 1.0
            print(f"P={P:<5} {name:<22} bytes/fp16 {mem:6.3f}  KL {row['kl']:.4f}  top1 {row['top1']:.3f}  "
                  f"ppl ratio {row['ppl_ratio']:.3f}  passkey {row['passkey']:.2f}  "
                  f"decode {row['decode_ms_per_step']:6.1f} ms/step  page share {row['page_share']:.2%}  "
                  f"tiers {json.dumps({k: round(v, 3) for k, v in row['tiers'].items()})}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": lm.name, "dtype": args.dtype, "steps": args.steps, "torch": torch.__version__,
                       "machine": f"{platform.machine()} {torch.get_num_threads()} threads", "results": results},
                      f, indent=2, default=str)


if __name__ == "__main__":
    main()
