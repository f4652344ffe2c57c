"""The numbers the README gives for its Python snippet: `cache.memory()` on the snippet's short prompt and in steady
state, and generation time with the kvcal cache against the plain model.

    python experiments/readme_snippet.py [--bundle artifacts/smollm2-135m.kvcal.safetensors] \
        [--json docs/results/readme-snippet-smollm2-135m.json]

Short prompt: the snippet as written ("Hello", 20 new tokens, greedy). Long prompt: `--long` tokens of evaluation
text plus 20 new tokens, where partly filled pages are a small share of the pages held. For each, `memory()`: the
ratio held now (the tokens' storage against fp16), every byte held against fp16, and the steady-state ratio (what a
long sequence converges to, per token). Time: the
snippet's generate call, with a fresh KvcalCache and with the model's own cache, alternated `--repeats` times after
one warm-up each; the median of each and their ratio. On a shared machine only the ratio means anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvcal import load_bundle
from kvcal.data import load_corpus, token_windows
from kvcal.models import load_model
from kvcal.runtime.hf import KvcalCache


def fp16_per_token(bundle) -> int:
    """Bytes per token of an fp16 dense cache of the bundle's model."""
    m = bundle.model
    return m.num_layers * m.num_kv_heads * m.head_dim * 2 * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", default="artifacts/smollm2-135m.kvcal.safetensors")
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--long", type=int, default=2048, help="prompt tokens for the steady-state memory")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.model)
    bundle = load_bundle(args.bundle)
    tok, model = lm.tokenizer, lm.model
    short = tok(["Hello"], return_tensors="pt")
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False)

    def kvcal_generate(inputs):
        cache = KvcalCache.from_bundle(bundle, model, tokenizer=tok)
        out = model.generate(**inputs, cache=cache, **gen)
        return out, cache

    with torch.inference_mode():
        out, cache = kvcal_generate(short)
        short_mem = cache.memory()
        text_kvcal = tok.decode(out[0], skip_special_tokens=True)
        text_plain = tok.decode(model.generate(**short, **gen)[0], skip_special_tokens=True)
        times: dict[str, list[float]] = {"kvcal": [], "plain": []}
        for _ in range(args.repeats):
            for name, run in (("kvcal", lambda: kvcal_generate(short)), ("plain", lambda: model.generate(**short,
                                                                                                      **gen))):
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        ids = token_windows(tok, load_corpus("default", "eval"), 1, args.long, 0)
        _, cache = kvcal_generate({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        long_mem = cache.memory()
    kvcal_s, plain_s = statistics.median(times["kvcal"]), statistics.median(times["plain"])
    result = {
        "model": args.model, "bundle": args.bundle, "policy": bundle.settings, "new_tokens": args.new_tokens,
        "short_prompt": {"prompt_tokens": int(short["input_ids"].shape[1]), "memory": short_mem},
        "steady_state": {"prompt_tokens": args.long, "memory": long_mem},
        "generate_seconds": {"kvcal": kvcal_s, "plain": plain_s, "ratio": kvcal_s / plain_s,
                             "repeats": args.repeats, "all": times},
        "same_text": text_kvcal == text_plain, "text": text_kvcal, "torch_threads": torch.get_num_threads(),
    }
    for name, mem in ((f"short prompt ({short_mem['fp16_bytes'] // fp16_per_token(bundle)} tokens)", short_mem),
                      (f"long prompt ({args.long} + {args.new_tokens} tokens)", long_mem)):
        print(f"memory() {name}: ratio to fp16 {mem['ratio_to_fp16']:.3f} held now, {mem['held_ratio_to_fp16']:.3f} "
              f"with every byte, steady state {mem['steady_state_ratio']:.3f} (raw phase: {mem['raw_tokens']} tokens)")
    print(f"generate {args.new_tokens} tokens: kvcal {kvcal_s:.2f} s, plain {plain_s:.2f} s, "
          f"{kvcal_s / plain_s:.2f}x slower (median of {args.repeats})")
    print(f"text: {text_kvcal!r} (same as plain: {text_kvcal == text_plain})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
