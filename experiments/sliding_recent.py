"""Where a sliding-window layer's error sits: its formats, with and without its newest tokens at 16 bits.

    python experiments/sliding_recent.py --model gemma3-270m --bundle gemma3-270m.kvcal.safetensors \
        --json out/sliding-recent-gemma3-270m.json

Every row holds the full-attention layers in fp16 (no tiers), so only the sliding layers' storage differs; each
`--row` is `FORMAT+RECENT` (`CompressionConfig.sliding` and `sliding_recent`). Measured stepwise (one token a forward
pass, as the calibration's decision on evaluation text) on the evaluation windows of `format_swaps.py`, full rank.
"""

from __future__ import annotations

import argparse
import json

from format_swaps import add_window_args, eval_probe, measured_row

from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.storage.layout import TierFormat

ROWS = ("K8V8m8+0", "K8V4m8+0", "K8V4m8+16", "K8V4m8+32", "K8V4g32m8+0", "K4V4kg32m8+0", "K4V4kg32m8+64")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="a model with sliding-window layers")
    ap.add_argument("--bundle", required=True, help="a bundle of --model (any settings: only its bases are used)")
    ap.add_argument("--row", action="append", help=f"FORMAT+RECENT (default: {' '.join(ROWS)})")
    ap.add_argument("--json", help="write the rows here")
    add_window_args(ap)
    args = ap.parse_args()

    probe, _ = eval_probe(args.model, args.bundle, args.windows, args.prompt, args.steps)
    dense_global = CompressionConfig(high=TierFormat(16, 16), use_ranks=False).with_tiering(alpha_high=None)
    rows = []
    for row in args.row or ROWS:
        fmt, _, recent = row.partition("+")
        config = dense_global.with_(sliding=TierFormat.parse(fmt), sliding_recent=int(recent or 0))
        rows.append(measured_row(probe, config, sliding=fmt, recent=int(recent or 0)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
