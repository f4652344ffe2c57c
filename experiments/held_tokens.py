"""The tokens the quality model holds in the allocated format against those the runtime holds low after decoding.

    python experiments/held_tokens.py --model smollm2-135m --bundle artifacts/smollm2-135m.kvcal.safetensors \
        [--prompt 1024 --steps 128] [--json out/held-tokens-smollm2-135m.json]

One evaluation window: the search's recording (`record_search`) of its prompt and continuation gives the held masks
of every heavy-hitter threshold (`quality_model.held_masks`); the runtime, with the same base settings at each
threshold (per-channel low pages, uniform levels), prefills the prompt and decodes the continuation a token at a time.
Reported per threshold: the model's count, the runtime's low tier after the prefill and after the decode, and how
many tokens can wait in the high tier for a page (a page less one per layer and KV head).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.models import adapter_for, load_model
from kvcal.profile.allocate import PAGE_TOKENS, base_settings
from kvcal.profile.quality_model import ALPHAS
from kvcal.profile.ranks import ranks_of
from kvcal.profile.recording import record_search
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.storage.bases import served_bases
from kvcal.runtime.storage.layout import TierFormat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a bundle of --model (only its bases are used)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.model, dtype="float32")
    model, a, bundle = lm.model, adapter_for(lm.model.config), load_bundle(args.bundle)
    P, M = args.prompt, args.steps
    ids = token_windows(lm.tokenizer, load_corpus("default", "eval"), 1, P + M + 1, args.seed)
    base = base_settings(list(a.layer_types)).with_(low=TierFormat.parse("K4cV4m8"))
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base,
                          bundle.extras.get("qk.smoothing"))
    rec = record_search(model, ids[:, :P], ids[:, P:], served, base, list(a.layer_types), a.head_dim)
    rows = []
    for i, alpha in enumerate(ALPHAS[:3]):
        cache = KvcalCache.from_bundle(bundle, model, base.with_tiering(alpha_high=alpha))
        with torch.inference_mode():
            model(input_ids=ids[:, :P], cache=cache, use_cache=True)
            placed = cache.kv.tier_counts()["low"]
            for t in range(P, P + M):
                model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
        row = {"alpha": alpha, "model": sum(int(h[i].sum()) for h in rec.held.values()),
               "runtime_after_prefill": placed, "runtime_after_decode": cache.kv.tier_counts()["low"],
               "may_wait_for_a_page": len(rec.held) * a.num_kv_heads * (PAGE_TOKENS - 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "prompt": P, "steps": M, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
