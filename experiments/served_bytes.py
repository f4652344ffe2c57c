"""Where a bundle's served bytes go after the check's decode: pages, slots and holes of each tier, with the high
sections' holes left open and closed (`Scores.compact`).

    python experiments/served_bytes.py --model smollm2-135m --bundle artifacts/smollm2-135m.kvcal.safetensors \
        [--windows 2 --prompt 3839 --steps 256] [--json out/served-bytes-smollm2-135m.json]

Evaluation text (`default:eval`, the check's seed), the bundle's own settings, the prompt prefilled and the
continuation teacher-forced a token at a time through the runtime (`DecodeProbe.replay`), as the check decodes it;
then `memory()` and, per tier, the slots written, the holes among them, the live tokens' bytes and the bytes of the
pages they occupy. Twice: once with `compact` a no-op (the holes a sealed low page leaves stay open, as before it),
once as served.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.eval.fidelity import teacher_force
from kvcal.eval.probe import DecodeProbe
from kvcal.models import load_model
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.storage.pages import HIGH, LOW
from kvcal.runtime.storage.scores import Scores


def tiers(store) -> dict:
    """Per tier: slots written, holes, live tokens, bytes of the live tokens (at their layout's bytes per slot) and
    of the pages in use."""
    out = {}
    for side, name in ((HIGH, "high"), (LOW, "low")):
        row = {"slots": 0, "holes": 0, "live_bytes": 0.0, "page_bytes": 0}
        for layer, groups in store.groups.items():
            for g in groups:
                fill, holes = store.fill[layer][:, g.heads, side], store.holes[layer][:, g.heads, side]
                row["slots"] += int(fill.sum())
                row["holes"] += int(holes.sum())
                row["live_bytes"] += float((fill - holes).sum()) * g.layouts[side].bytes_per_token
                row["page_bytes"] += int(store.arena.num_pages_used[:, layer][:, g.heads, side].sum()) * \
                    store.page_bytes
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=3839)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--seed", type=int, default=2, help="the evaluation windows' seed (calibrate's check: seed + 2)")
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.model, dtype="float32")
    bundle = load_bundle(args.bundle)
    config = CompressionConfig.from_dict(bundle.settings)
    P, M = args.prompt, args.steps
    ids = token_windows(lm.tokenizer, load_corpus("default", "eval"), args.windows, P + M + 1, args.seed,
                        long_first=True)
    probe = DecodeProbe(lm.model, bundle, ids[:, :P], ids[:, P:], tokenizer=lm.tokenizer)
    served = Scores.compact
    rows = []
    for closed in (False, True):
        Scores.compact = served if closed else (lambda self, layer, b, h: 0)
        try:
            cache = probe.replay(config)
            with torch.inference_mode():
                teacher_force(lm.model, cache, probe.continuation, on_logits=lambda t, logits: None)
        finally:
            Scores.compact = served
        memory = cache.memory()
        row = {"holes_closed": closed, "ratio_to_fp16": memory["ratio_to_fp16"],
               **{k: memory[k] for k in ("paged_bytes", "raw_bytes", "total_bytes", "fp16_bytes", "held_bytes")},
               "tiers": tiers(cache.kv.store)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        cache.release()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "bundle": args.bundle, "settings": bundle.settings, "windows": args.windows,
                       "prompt": P, "steps": M, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
