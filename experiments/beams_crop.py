"""What beam search and crop cost on a `KvcalCache` (docs/runtime.md, "Beam search and crop").

    python experiments/beams_crop.py [--bundle artifacts/smollm2-135m.kvcal.safetensors] [--prompt 512] \
        [--beams 4] [--new-tokens 32] [--json docs/results/beams-crop-smollm2-135m.json]

Beam search: `generate(num_beams=--beams)` after a `--prompt`-token prompt of evaluation text, with a DynamicCache
and with KvcalCache under three configs (none: exact fp32; K8V8: per-token 8-bit, untiered; bundle: the bundle's own
tiered policy). Per config: wall time (median of `--repeats`), time inside `reorder_cache` (page tables re-indexed),
pages copied on write (PageArena.copied: a beam writing into a page it shares with another), and at the end the
distinct pages held against the pages the beams' tables point at (what copying every beam's bytes would hold).
Crop: after the prompt and `--new-tokens` greedy tokens, `crop(-k)` for several k on a fresh cache each: time and
pages freed. The machine may be shared: times are given with the dense run's for ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from kvcal import load_bundle
from kvcal.data import load_corpus, token_windows
from kvcal.models import load_model
from kvcal.runtime.cache import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.storage.layout import TierFormat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", default="artifacts/smollm2-135m.kvcal.safetensors")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--crops", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--skip-beams", action="store_true", help="measure crop only")
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.model, dtype="float32")
    bundle = load_bundle(args.bundle)
    model = lm.model
    ids = token_windows(lm.tokenizer, load_corpus("default", "eval"), 1, args.prompt, seed=0)
    configs = {"none": CompressionConfig.none(), "K8V8": CompressionConfig(high=TierFormat(8, 8), use_ranks=False),
               "bundle": CompressionConfig.from_dict(bundle.settings)}
    out = {"model": args.model, "prompt": args.prompt, "beams": args.beams, "new_tokens": args.new_tokens,
           "threads": torch.get_num_threads(), "beam_search": {}, "crop": {}}

    def beam_run(make):
        cache = make()
        reorder = [0.0, 0]
        if isinstance(cache, KvcalCache):
            inner = cache.reorder_cache

            def timed(beam_idx):
                t0 = time.perf_counter()
                inner(beam_idx)
                reorder[0] += time.perf_counter() - t0
                reorder[1] += 1
            cache.reorder_cache = timed
        t0 = time.perf_counter()
        with torch.inference_mode():
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                                 num_beams=args.beams, do_sample=False, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens)
        return time.perf_counter() - t0, cache, reorder, seq

    dense_seq = None
    beam_rows = [] if args.skip_beams else [("dense", lambda: DynamicCache(config=model.config))] + [
        (k, lambda c=c: KvcalCache.from_bundle(bundle, model, c)) for k, c in configs.items()]
    for name, make in beam_rows:
        times, row = [], {}
        for _ in range(args.repeats):
            seconds, cache, reorder, seq = beam_run(make)
            times.append(seconds)
        row["seconds_median"] = statistics.median(times)
        if name == "dense":
            dense_seq = seq
        else:
            arena = cache.kv.store.arena
            pointed = int(arena.num_pages_used.sum())
            row.update(reorder_calls=reorder[1], reorder_ms_per_call=1e3 * reorder[0] / max(reorder[1], 1),
                       pages_copied_on_write=arena.copied, pages_held=arena.num_used, pages_pointed_at=pointed,
                       bytes_held=arena.num_used * arena.page_bytes, page_bytes=arena.page_bytes,
                       same_sequences_as_dense=bool(torch.equal(seq, dense_seq)),
                       ratio_to_dense_time=row["seconds_median"] / out["beam_search"]["dense"]["seconds_median"])
            cache.release()
        out["beam_search"][name] = row
        print(name, row, flush=True)

    for name in ("none", "K8V8"):
        rows = {}
        for k in args.crops:
            cache = KvcalCache.from_bundle(bundle, model, configs[name])
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                               do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
            arena = cache.kv.store.arena
            before = arena.num_used
            t0 = time.perf_counter()
            with torch.inference_mode():
                cache.crop(-k)
            rows[k] = {"ms": 1e3 * (time.perf_counter() - t0), "pages_freed": before - arena.num_used,
                       "pages_held": arena.num_used, "tokens_left": cache.get_seq_length()}
            cache.release()
        out["crop"][name] = rows
        print("crop", name, rows, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
