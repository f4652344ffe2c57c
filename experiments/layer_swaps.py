"""Which layers bind a bundle's frontier: its settings with single layers' low-tier bits swapped, measured stepwise.

    python experiments/layer_swaps.py --model gemma3-270m --bundle artifacts/gemma3-270m.kvcal.safetensors \
        --windows 4 --prompt 3839 --steps 128 --row= --row 5=K4V4 --row 17=K2V2 --row 5=K4V4,17=K2V2 \
        --json out/layer-swaps-gemma3-270m.json

Each `--row` is LAYER=KbitsVbits pairs, comma-separated (empty: the bundle's own settings): that paged layer's low
tier becomes the format the calibration's allocation gives those bits (`quality_model.layer_format`: the settings'
`low` with these bits, 4 and 2 bits on the bundle's calibrated levels). Measured by the runtime's stepwise decode on
the evaluation windows of `format_swaps.py`, at full rank, the same windows for every row.
"""

from __future__ import annotations

import argparse
import json
import re

from format_swaps import add_window_args, eval_probe, measured_row

from kvcal.profile.quality_model import layer_format
from kvcal.runtime.config import CompressionConfig


def swapped(config: CompressionConfig, row: str) -> CompressionConfig:
    """`config` with the layers' low-tier bits that `row` names (module docstring)."""
    low = dict(config.low_layers)
    for pair in filter(None, row.split(",")):
        m = re.fullmatch(r"(\d+)=K(\d+)V(\d+)", pair.strip())
        if not m:
            raise SystemExit(f"--row {row!r}: {pair!r} must look like 17=K2V2 (layer=K bits V bits)")
        low[int(m.group(1))] = layer_format(config, False, int(m.group(2)), int(m.group(3)))
    return config.with_(low_layers=tuple(sorted(low.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--bundle", required=True, help="a bundle of --model whose settings are the starting point")
    ap.add_argument("--row", action="append", default=None, help="LAYER=KbitsVbits[,...] (empty: as the bundle)")
    ap.add_argument("--json", help="write the rows here")
    add_window_args(ap)
    args = ap.parse_args()

    probe, bundle = eval_probe(args.model, args.bundle, args.windows, args.prompt, args.steps)
    settings = CompressionConfig.from_dict(bundle.settings)
    rows = [measured_row(probe, swapped(settings, row), row=row or "as calibrated") for row in args.row or [""]]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "bundle": args.bundle, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
