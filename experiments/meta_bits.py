"""What 8-bit scales and zeros (tier formats ending in m8) cost in quality and save in bytes, one setting at a time.

    python experiments/meta_bits.py --model smollm2-135m --bundle smollm2-135m.kvcal.safetensors \
        --json out/meta-bits-smollm2-135m.json

For each setting, the probe measures it twice on the same windows: every quantized tier (high, low and sliding
layers) with fp16 (scale, zero) pairs, then with their 8-bit codes (`storage.quant.meta8_encode`). Settings:
the bundle's own, and the residual family's fp16 W=16 / K4cV4, alpha = (64, 0) and fp16 W=64 / K8cV4 with every
token leaving the window low (the bundle's sliding format kept for sliding-window models), at full rank, on the
evaluation split's first 4 windows (767 prompt + 256 teacher-forced tokens, batched probe, 32 tokens a pass).
"""

from __future__ import annotations

import argparse
import json

from format_swaps import add_window_args, eval_probe, measured_row

from kvcal.profile.allocate import PAGE_TOKENS as RESIDUAL_PAGE_TOKENS
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.policies.diffkv import EVERY_TOKEN_LOW
from kvcal.runtime.storage.layout import RAW_BITS, TierFormat


def with_meta_bits(config: CompressionConfig, meta_bits: int) -> CompressionConfig:
    """`config` with every quantized tier format's (scale, zero) pairs in `meta_bits` bits."""
    def fmt(f: TierFormat | None) -> TierFormat | None:
        if f is None or (f.k_bits in RAW_BITS and f.v_bits in RAW_BITS):
            return f
        return TierFormat.parse(f.name.removesuffix("m8") + ("m8" if meta_bits == 8 else ""))

    return config.with_(high=fmt(config.high), low=fmt(config.low), sliding=fmt(config.sliding),
                        low_layers=tuple((i, fmt(f)) for i, f in config.low_layers),
                        low_heads=tuple((i, h, fmt(f)) for i, h, f in config.low_heads),
                        sliding_layers=tuple((i, fmt(f)) for i, f in config.sliding_layers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a bundle of --model")
    ap.add_argument("--json", help="write the rows here")
    add_window_args(ap)
    args = ap.parse_args()

    probe, bundle = eval_probe(args.model, args.bundle, args.windows, args.prompt, args.steps)
    own = CompressionConfig.from_dict(bundle.settings).with_(use_ranks=False)
    residual = own.with_(high=TierFormat.parse("K16V16"), page_tokens=RESIDUAL_PAGE_TOKENS, fastgen=None)
    settings = {
        "bundle": own,
        "fp16 W=16 / K4cV4 a=(64,0)": residual.with_(low=TierFormat.parse("K4cV4")).with_tiering(
            window=16, alpha_high=64.0, alpha_low=0.0),
        "fp16 W=64 / K8cV4, every token low": residual.with_(low=TierFormat.parse("K8cV4")).with_tiering(
            window=64, alpha_high=EVERY_TOKEN_LOW, alpha_low=0.0),
    }
    rows = [measured_row(probe, with_meta_bits(config, meta_bits), setting=name, meta_bits=meta_bits)
            for name, config in settings.items() for meta_bits in (16, 8)]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "bundle_settings": bundle.settings, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
