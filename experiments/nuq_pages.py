"""Would non-uniform codes (KVQuant's nuq) pay inside kvcal's per-channel key pages? A simulation.

    python experiments/nuq_pages.py --model smollm2-135m --bundle smollm2-135m.kvcal.safetensors \
        --json out/nuq-pages-smollm2-135m.json

A per-channel low page stores each channel's keys over 32 tokens as codes on the uniform grid 0..2^b-1 between the
channel's min and max there. This replaces that grid by a codebook of 2^b levels in the same normalized space,
fitted (`kvcal.profile.codebooks.fit_codebooks`, Lloyd) on the normalized keys the store itself wrote during a first
run of the same probe, then measures the probe again with every per-channel page coded and decoded through the
codebook (the store's quantize/dequantize functions are swapped for the run; bytes do not change). One codebook per
bit width for all layers and heads: a lower bound on what per-head codebooks could gain, and an upper one on what
they cost to fit.

Setting: fp16 W=16 / K{b}cV4, a=(64, 0), the residual family, at full rank, on the search split's first 2 windows
(767 prompt + 256 teacher-forced tokens), batched probe (32 tokens a pass).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe
from kvcal.models import load_model
from kvcal.profile.allocate import PAGE_TOKENS as RESIDUAL_PAGE_TOKENS
from kvcal.profile.codebooks import encode as nearest
from kvcal.profile.codebooks import fit_codebooks
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.storage import quant
from kvcal.runtime.storage.layout import TierFormat

RESIDUAL = CompressionConfig(high=TierFormat.parse("K16V16"), page_tokens=RESIDUAL_PAGE_TOKENS,
                             use_ranks=False).with_tiering(window=16, alpha_high=64.0, alpha_low=0.0)
SAMPLES_PER_PAGE = 2000
TORCH = ServeOptions(backend="torch")   # the torch writer codes pages through `quant` (the fused kernels do not)


@contextlib.contextmanager
def per_channel_codes(bits: int, book: torch.Tensor | None, seen: list):
    """Swap the store's per-channel (de)quantizer for `bits`-bit pages: collect normalized values into `seen`
    (book None) or code them through `book` [2^bits] (sorted levels in 0..2^bits-1)."""
    quantize, dequantize = quant.quantize_per_channel, quant.dequantize_per_channel

    def q(x, b, valid=None, meta_bits=16, levels=None):
        codes, scale, zero = quantize(x, b, valid, meta_bits, levels=levels)
        if b != bits:
            return codes, scale, zero
        u = (x.float() - zero.float().unsqueeze(-2)) / scale.float().unsqueeze(-2).clamp(min=1e-30)
        if book is None:
            u = (u[valid] if valid is not None else u).reshape(-1)
            seen.append(u[torch.randperm(len(u))[:SAMPLES_PER_PAGE]])
            return codes, scale, zero
        codes = nearest(u, book)
        return (codes.masked_fill(~valid.unsqueeze(-1), 0) if valid is not None else codes), scale, zero

    def dq(codes, scale, zero, dtype=torch.float32, levels=None):
        if book is None:
            return dequantize(codes, scale, zero, dtype, levels=levels)
        return (book[codes.long()] * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)).to(dtype)

    quant.quantize_per_channel, quant.dequantize_per_channel = q, dq
    try:
        yield
    finally:
        quant.quantize_per_channel, quant.dequantize_per_channel = quantize, dequantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a bundle of --model (its rotations are used, at full rank)")
    ap.add_argument("--bits", default="4,2", help="low-tier key bits to try")
    ap.add_argument("--windows", type=int, default=2, help="windows of the search split")
    ap.add_argument("--prompt", type=int, default=767, help="prompt tokens per window")
    ap.add_argument("--steps", type=int, default=256, help="teacher-forced tokens per window")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    lm = load_model(args.model)
    lm.model.to(torch.float32)
    bundle = load_bundle(args.bundle)
    P, M = args.prompt, args.steps
    w = token_windows(lm.tokenizer, load_corpus("default", "search"), args.windows, P + M + 1, 1, long_first=True)
    probe = DecodeProbe(lm.model, bundle, w[:, :P], w[:, P:], tokenizer=lm.tokenizer)
    rows = []
    for bits in (int(b) for b in args.bits.split(",")):
        config, seen = RESIDUAL.with_(low=TierFormat.parse(f"K{bits}cV4")), []
        book = None
        for codes in ("uniform", "nuq"):
            with per_channel_codes(bits, book, seen):
                t = time.perf_counter()
                f = probe.measure(config, serve=TORCH)
            rows.append({"format": config.low.name, "codes": codes, "bytes_ratio": f.memory["ratio_to_fp16"],
                         "top1": f.top1, "kl": f.kl, "ppl_ratio": f.ppl_ratio, "predictions": f.predictions,
                         "levels": None if book is None else [round(float(c), 3) for c in book],
                         "seconds": round(time.perf_counter() - t, 1)})
            print(f"{config.low.name:6} {codes:8} bytes {f.memory['ratio_to_fp16']:.3f}  top-1 {f.top1:.4f}  "
                  f"KL {f.kl:.5f}  ppl {f.ppl_ratio:.4f}", flush=True)
            if book is None:
                book = fit_codebooks(torch.cat(seen)[None], (bits,))[bits][0]
                print("levels", [round(float(c), 2) for c in book], flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "setting": "fp16 W=16 / K{b}cV4 a=(64,0), full rank", "rows": rows},
                      fh, indent=2)


if __name__ == "__main__":
    main()
