"""A bundle's settings with some tier formats swapped, measured on evaluation text: which format a stage should offer.

    python experiments/format_swaps.py --model gemma3-270m --bundle gemma3-270m.kvcal.safetensors \
        --swap=-/-/- --swap=K8V4m8/K4cV2m8/K4V4kg32m8 --json out/format-swaps-gemma3-270m.json

Each `--swap` is `HIGH/LOW/SLIDING[+RECENT][@WINDOW,ALPHA_HIGH,ALPHA_LOW]`: tier formats (`TierFormat.parse`) for
the high tier, the low tier and the sliding-window layers, `-` keeping the bundle's; `+RECENT`, the sliding layers'
newest tokens kept at 16 bits (`sliding_recent`, else none) (write `--swap=-/-/-`: argparse reads a value that
starts with `-` as an option); after `@`, the tiering, with the low tier in pages of the residual family's size
(`RESIDUAL_PAGE_TOKENS`) and no token policy (FastGen) on top. Every row runs at full rank on the evaluation split's
first 4 windows (767 prompt + 256 teacher-forced tokens, stepwise decode as the calibration's confirmation
measures), the same windows for all.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe
from kvcal.models import load_model
from kvcal.profile.allocate import PAGE_TOKENS as RESIDUAL_PAGE_TOKENS
from kvcal.runtime.bundle import Bundle, load_bundle
from kvcal.runtime.config import CompressionConfig, split_sliding_spec
from kvcal.runtime.storage.layout import TierFormat

PROMPT, STEPS, WINDOWS = 767, 256, 4


def add_window_args(ap: argparse.ArgumentParser) -> None:
    """--windows, --prompt, --steps: the shape of `eval_probe`'s windows (defaults: the calibration's 1k shape)."""
    ap.add_argument("--windows", type=int, default=WINDOWS, help="windows of the evaluation split")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per window")
    ap.add_argument("--steps", type=int, default=STEPS, help="teacher-forced tokens per window")


def eval_probe(model: str, bundle_path: str, windows: int = WINDOWS, prompt: int = PROMPT,
               steps: int = STEPS) -> tuple[DecodeProbe, Bundle]:
    """The probe the format benchmarks share: `model` in float32 on the evaluation split's first `windows` windows
    of `prompt` + `steps` + 1 tokens."""
    lm = load_model(model)
    lm.model.to(torch.float32)
    bundle = load_bundle(bundle_path)
    w = token_windows(lm.tokenizer, load_corpus("default", "eval"), windows, prompt + steps + 1, 1, long_first=True)
    return DecodeProbe(lm.model, bundle, w[:, :prompt], w[:, prompt:], tokenizer=lm.tokenizer), bundle


def measured_row(probe: DecodeProbe, config: CompressionConfig, **labels) -> dict:
    """One JSON row: `labels`, then `config` as measured by `probe` on its windows, stepwise (printed as it
    lands)."""
    t = time.perf_counter()
    f = probe.measure(config)
    row = {**labels, "settings": config.to_dict(), "bytes_ratio": f.memory["ratio_to_fp16"], "top1": f.top1,
           "kl": f.kl, "ppl_ratio": f.ppl_ratio, "predictions": f.predictions,
           "top1_windows": f.top1_windows,
           "seconds": round(time.perf_counter() - t, 1)}
    print(f"{' '.join(map(str, labels.values())):44} bytes {row['bytes_ratio']:.3f}  top-1 {f.top1:.4f}  "
          f"KL {f.kl:.5f}  ppl {f.ppl_ratio:.4f}", flush=True)
    return row


def swapped(config: CompressionConfig, swap: str) -> CompressionConfig:
    """`config` with the formats (and tiering) `swap` names; see the module docstring."""
    formats, _, tiering = swap.partition("@")
    parts = formats.split("/")
    if len(parts) != 3:
        raise SystemExit(f"--swap {swap!r} must name three formats, HIGH/LOW/SLIDING ('-' keeps the bundle's)")
    parts[2], recent = split_sliding_spec(parts[2])
    changes = {field: TierFormat.parse(spec) for field, spec in zip(("high", "low", "sliding"), parts) if spec != "-"}
    config = config.with_(**changes, **({"sliding_recent": recent} if recent is not None else {}))
    if tiering:
        window, alpha_high, alpha_low = tiering.split(",")
        config = config.with_(page_tokens=RESIDUAL_PAGE_TOKENS, fastgen=None).with_tiering(
            window=int(window), alpha_high=float(alpha_high), alpha_low=float(alpha_low))
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a bundle of --model")
    ap.add_argument("--swap", action="append", required=True,
                    help="HIGH/LOW/SLIDING[+RECENT][@WINDOW,ALPHA_HIGH,ALPHA_LOW]")
    ap.add_argument("--json", help="write the rows here")
    add_window_args(ap)
    args = ap.parse_args()

    probe, bundle = eval_probe(args.model, args.bundle, args.windows, args.prompt, args.steps)
    own = CompressionConfig.from_dict(bundle.settings).with_(use_ranks=False)
    rows = [measured_row(probe, swapped(own, swap), swap=swap) for swap in args.swap]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "bundle_settings": bundle.settings, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
