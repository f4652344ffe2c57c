"""How long `kvcal calibrate` must take on this machine whatever the search does: the model's own forward passes.

    python experiments/calibration_floor.py -m smollm2-135m --json out/floor-smollm2-135m.json

The default command reads, with no search design able to skip them: the statistics passes (random tokens and calibration
text, `seq_len`-token windows), one prefill of every search window at the deployment context (the recording) and one of
every evaluation window (the confirmation's prompts), each `context - 1` tokens long, and the stepwise decode of one
confirmation (`search_steps` steps, a batch of `eval_windows`). This times one dense forward of each kind and one dense
decode step at that batch over the prompt's cache (the search dtype, float32, unless `--dtype`; the prefills' matrix
products in `--prefill-dtype` if given, as the search prefills its prompts; transformers' SDPA; no logits beyond the
last position) and multiplies by the default counts. Left out, so the sum is a lower bound: the
recording's backward through the continuation, the runtime's significance pass over each prefill, the probes, the cost
tables, and the compressed cache's own costs in the check.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvcal.eval.fidelity import prefill_precision
from kvcal.models import DTYPES, load_model
from kvcal.profile.calibrate import CalibrationConfig
from kvcal.runtime.backends.cpu.build import cpu_name


def timed_forward(model, tokens: int, vocab: int, repeats: int, products: torch.dtype | None = None) -> float:
    """Least seconds of `repeats` dense forwards over `tokens` random token ids (the first one warms up), the matrix
    products in `products` (`prefill_precision`; None: the model's dtype)."""
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with torch.inference_mode(), prefill_precision(model, products):
        for _ in range(repeats):
            t = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)       # with its cache: faster than use_cache=False here
            best = min(best, time.perf_counter() - t)
    return best


def timed_decode_step(model, tokens: int, batch: int, vocab: int, steps: int = 4) -> float:
    """Least seconds of a dense decode step at `batch` over a cache of `tokens` (one prompt's, repeated)."""
    ids = torch.randint(0, vocab, (1, tokens + steps + 1), generator=torch.Generator().manual_seed(1))
    best = float("inf")
    with torch.inference_mode():
        cache = model(input_ids=ids[:, :tokens], logits_to_keep=1).cache
        cache.batch_repeat_interleave(batch)
        for i in range(steps + 1):                                       # the first step warms up
            t = time.perf_counter()
            model(input_ids=ids[:, tokens + i:tokens + i + 1].expand(batch, 1), cache=cache)
            if i:
                best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-m", "--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--context", type=int, default=None, help="default: min(4096, the model's maximum)")
    parser.add_argument("--dtype", default=None, help="the model dtype to time (default: the search dtype, float32); "
                        "bfloat16 measures what recording and checking in the model's own dtype would cost")
    parser.add_argument("--prefill-dtype", default=None, help="time the prompt prefills with their matrix products "
                        "in this dtype (autocast; the search prefills its prompts in the dtype the model was loaded "
                        "in: bfloat16 where the CPU computes it), the rest in --dtype")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cfg = CalibrationConfig(model=args.model)
    dtype = args.dtype or cfg.search_dtype
    lm = load_model(args.model, dtype=dtype)
    context = args.context or min(4096, lm.adapter.max_positions)
    window = min(cfg.seq_len, context)
    vocab = lm.model.config.vocab_size
    products = DTYPES[args.prefill_dtype] if args.prefill_dtype else None
    prefill_s = timed_forward(lm.model, context - 1, vocab, args.repeats, products)
    pass_s = timed_forward(lm.model, window, vocab, args.repeats)
    step_s = timed_decode_step(lm.model, max(context - 1 - cfg.search_steps, 1), cfg.eval_windows, vocab)
    passes = -(-cfg.random_tokens // window) + -(-cfg.text_tokens // window)
    prefills = cfg.search_windows + cfg.eval_windows
    result = {"model": args.model, "cpu": cpu_name(), "dtype": dtype, "prefill_dtype": args.prefill_dtype or dtype,
              "threads": torch.get_num_threads(),
              "context": context,
              "prefill_seconds": round(prefill_s, 2), "pass_window_seconds": round(pass_s, 2),
              "decode_step_seconds": round(step_s, 3), "prefills": prefills, "pass_windows": passes,
              "decode_steps": cfg.search_steps,
              "floor_seconds": round(prefills * prefill_s + passes * pass_s + cfg.search_steps * step_s, 1)}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
