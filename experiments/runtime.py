"""Runtime benchmark: memory, decode fidelity, passkey retrieval and CPU decode speed of compressed caches vs dense.

    python experiments/runtime.py --model smollm2-135m --contexts 1024 4096 \
        [--json docs/results/runtime-smollm2-135m.json]
    python experiments/runtime.py --model smollm2-135m --bundle artifacts/smollm2-135m.kvcal.safetensors \
        --speed-only --speed-contexts 1024 4096 8192 --batches 1 8 [--speed-configs K8V4 bundle] [--json ...]

For each context length P: a prompt of P held-out tokens (text disjoint from calibration), then M teacher-forced
decode steps through each cache (kvcal.eval). Reported per configuration: KV bytes per token actually held
in the page arena (metadata and fragmentation included) and the ratio to an fp16 dense cache, mean KL vs dense,
top-1 agreement, continuation-perplexity ratio, tier fractions, passkey accuracy (depths 0.1/0.5/0.9), CPU decode
ms/step, and the page-management share of a decode step (time in page allocation / step time).

Decode speed (`--speed-only` runs only this part): for each context P in `--speed-contexts` and batch in `--batches`,
dense (transformers' DynamicCache in the model dtype) and each compressed configuration of `--speed-configs` (`bundle`:
the bundle's calibrated settings, the formats a calibration chose) decode the same held-out tokens, one step at a time,
interleaved (dense step, compressed step, dense step, ...) so that load from other processes hits both alike. The prompt
is prefilled once at batch 1 and its K/V replicated into every row of the batch (prefill at 8k x 8 costs minutes on 2
cores and is not what is measured). Reported: median ms per step, the ratio to dense, and the page-management share
(time in page allocation / step time).

The bundle is calibrated on the fly (`--calib-tokens` random + text tokens, 8192 by default) unless `--bundle` is
given. Configurations use the bundle's rotations at full rank: rank search is the calibration stage's job.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import DynamicCache

from kvcal.data import load_corpus, token_windows
from kvcal.eval import decode_fidelity, passkey
from kvcal.models import load_model
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.storage.layout import TierFormat


def configs() -> dict[str, CompressionConfig | None]:
    full = CompressionConfig(use_ranks=False)
    return {
        "dense (model dtype)": None,
        "K8V8": full.with_(high=TierFormat(8, 8)),
        "K8V4": full,
        "tiers a=(1,0.5) 1/N": full.with_(tiering=TieringConfig(alpha_high=1.0, alpha_low=0.5)),
        "tiers a=(1,0.5) 1/i": full.with_tiering(alpha_high=1.0, alpha_low=0.5, threshold_base="position"),
        "tiers a=(2,1) 1/N": full.with_(tiering=TieringConfig(alpha_high=2.0, alpha_low=1.0)),
        "tiers a=(2,1) 1/i": full.with_tiering(alpha_high=2.0, alpha_low=1.0, threshold_base="position"),
    }


@torch.inference_mode()
def record_prefill(model, bundle, prompt: torch.Tensor) -> dict:
    """Run the prompt [1, P] once; per layer the post-RoPE K/V and prefill scores (KvcalCache.prime's records)."""
    return KvcalCache.record_prompt(bundle, model, prompt)[0]


def replicate(records: dict, batch: int) -> dict:
    """The batch-1 records repeated into `batch` identical rows."""
    rep = lambda t: t.repeat(batch, *[1] * (t.dim() - 1)) if isinstance(t, torch.Tensor) else t   # noqa: E731
    return {i: tuple(rep(t) for t in rec) for i, rec in records.items()}


def dense_cache(model, records: dict) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    dtype = next(model.parameters()).dtype
    for i in sorted(records):
        cache.update(records[i][0].to(dtype), records[i][1].to(dtype), i)
    return cache


@torch.inference_mode()
def decode_speed(model, bundle, ids: torch.Tensor, P: int, batches: list[int], steps: int,
                 configs: dict[str, CompressionConfig], prefill_threads: int | None = None,
                 serve: ServeOptions = ServeOptions()) -> list[dict]:
    """ids [1, >= P + steps + 1]. Per batch size: median ms per decode step of dense and of each config, measured
    interleaved (see the module docstring). `prefill_threads`: threads for the (untimed) prefill only."""
    threads = torch.get_num_threads()
    torch.set_num_threads(prefill_threads or threads)
    records = record_prefill(model, bundle, ids[:, :P])
    torch.set_num_threads(threads)
    rows = []
    for B in batches:
        recs = replicate(records, B)
        caches = {"dense": dense_cache(model, recs)}
        for name, cfg in configs.items():
            caches[name] = KvcalCache.from_bundle(bundle, model, cfg, serve=serve)
            caches[name].prime(recs)
        times = {name: [] for name in caches}
        page0 = {}
        for i in range(steps + 1):                          # step 0 is a warm-up
            if i == 1:
                page0 = {n: c.kv.store.page_seconds for n, c in caches.items() if n != "dense"}
            token = ids[:, P + i:P + i + 1].expand(B, 1)
            for name, cache in caches.items():
                t0 = time.perf_counter()
                model(input_ids=token, cache=cache, use_cache=True)
                if i:
                    times[name].append(time.perf_counter() - t0)
        dense_ms = 1000 * statistics.median(times["dense"])
        for name, cache in caches.items():
            ms = 1000 * statistics.median(times[name])
            page = 0.0 if name == "dense" else (cache.kv.store.page_seconds - page0[name]) / sum(times[name])
            rows.append({"context": P, "batch": B, "config": name, "ms_per_step": round(ms, 2),
                         "mean_ms_per_step": round(1000 * statistics.mean(times[name]), 2),
                         "ratio_to_dense": round(ms / dense_ms, 3), "page_share": page, "steps": steps,
                         "backend": None if name == "dense" else cache.kv.backend.name()})
            print(f"P={P:<5} batch {B}  {name:<22} {ms:8.1f} ms/step  ratio to dense {ms / dense_ms:5.2f}  "
                  f"page share {page:.3%}" + ("" if name == "dense" else f"  backend {cache.kv.backend.name()}"),
                  flush=True)
            if name != "dense":
                cache.release()
        del caches
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", help="bundle to use (default: calibrate one now)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=64, help="teacher-forced decode steps per context")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--threads", default="auto", help="torch (and kernel) threads, N or auto (the rule of kvcal's "
                    "`--threads`: OMP_NUM_THREADS if set, else the cores not busy)")
    ap.add_argument("--speed-only", action="store_true", help="skip fidelity and passkey; decode speed only")
    ap.add_argument("--speed-contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--speed-steps", type=int, default=16, help="timed decode steps per (context, batch)")
    ap.add_argument("--speed-configs", nargs="+", default=["K8V4"], help="compressed configurations to time (names "
                    "from the fidelity table, or `bundle`: the bundle's calibrated settings) against dense")
    ap.add_argument("--backend", default="auto", help="attention backend of the compressed caches")
    ap.add_argument("--prefill-threads", type=int, help="threads for the untimed prefill of the speed part")
    ap.add_argument("--calib-tokens", type=int, default=8192, help="random and text tokens of an on-the-fly bundle")
    args = ap.parse_args()
    from kvcal.cli._threads import use_threads

    print(f"threads {use_threads(args.threads)}", flush=True)
    serve = ServeOptions(args.backend)
    choices = {name: cfg for name, cfg in configs().items() if cfg} | {"bundle": None}    # None: the bundle's own
    timed = {name: cfg for name, cfg in choices.items() if name in args.speed_configs}
    if len(timed) != len(args.speed_configs):
        raise SystemExit(f"--speed-configs: choose from {', '.join(choices)}")
    torch.manual_seed(args.seed)

    lm = load_model(args.model, dtype=args.dtype)
    if args.bundle:
        from kvcal import load_bundle

        bundle = load_bundle(args.bundle)
    else:
        from kvcal.profile.calibrate import statistics_bundle

        bundle = statistics_bundle(lm, model=args.model, dtype=args.dtype, random_tokens=args.calib_tokens,
                                   text_tokens=args.calib_tokens)
    model, tok = lm.model, lm.tokenizer
    eval_docs = load_corpus("default", "eval")
    filler = "\n\n".join(load_corpus("pydoc", "all").documents)
    results, speed = [], []
    for P in [] if args.speed_only else args.contexts:
        ids = token_windows(tok, eval_docs, 1, P + args.steps + 1, seed=args.seed)
        for name, cfg in configs().items():
            make = (lambda: DynamicCache(config=model.config)) if cfg is None else \
                (lambda cfg=cfg: KvcalCache.from_bundle(bundle, model, cfg, serve=serve))
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
    print(f"decode speed: prompt prefilled once at batch 1, its K/V replicated into each batch row; "
          f"{args.speed_steps} steps, dense and compressed interleaved", flush=True)
    for P in args.speed_contexts:
        ids = token_windows(tok, eval_docs, 1, P + args.speed_steps + 1, seed=args.seed)
        speed += decode_speed(model, bundle, ids, P, args.batches, args.speed_steps, timed, args.prefill_threads,
                              serve)
        write_json(args, lm, results, speed)                # after each context: a long run keeps what it measured
    write_json(args, lm, results, speed)


def write_json(args, lm, results: list, speed: list) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": lm.name, "dtype": args.dtype, "steps": args.steps, "torch": torch.__version__,
                       "machine": f"{platform.machine()} {torch.get_num_threads()} threads", "results": results,
                       "speed": speed, "speed_note": "prefill once at batch 1, K/V replicated into each batch row; "
                       "dense and compressed steps interleaved; median ms per step"}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
