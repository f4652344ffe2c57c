"""A copy of a bundle whose settings are a `format_swaps.py` swap of its own, to put a hand-set configuration through
`kvcal bench` (its `kvcal-joint` row serves the bundle's settings).

    python experiments/with_settings.py --bundle gemma3-270m.kvcal.safetensors \
        --swap=K8V8m8/K8cV4m8/K8V4m8+16@32,256,0 --out gemma3-270m-hand.kvcal.safetensors
    python experiments/with_settings.py --bundle artifacts/smollm2-135m.kvcal.safetensors --hull-point 124 \
        --out smollm2-135m-124.kvcal.safetensors

`--hull-point N`: the settings of point N of the frontier the bundle's calibration found (its report beside it,
`<bundle>.report.json`, lists every point's bits per layer and KV head, high tier and threshold), measured or not.
The copy records the swap or the point under `calibration["hand_set"]`, so a reader of the bench can tell it from a
calibrated one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from format_swaps import swapped

from kvcal.profile.allocate import Allocation, to_config
from kvcal.profile.quality_model import ALPHAS, HIGH
from kvcal.profile.report import report_paths
from kvcal.runtime.bundle import load_bundle, save_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.safe_paths import check_bundle_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", required=True)
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--swap", help="HIGH/LOW/SLIDING[+RECENT][@WINDOW,ALPHA_HIGH,ALPHA_LOW]")
    how.add_argument("--hull-point", type=int, help="point N of the calibration's frontier (its report's hull)")
    ap.add_argument("--out", required=True, help="the copy (an existing file is refused unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace a kvcal bundle already at --out")
    args = ap.parse_args()
    try:
        check_bundle_out(args.out, overwrite=args.overwrite, inputs=[args.bundle])
    except ValueError as e:
        raise SystemExit(str(e)) from None
    bundle = load_bundle(args.bundle)
    if args.swap is not None:
        config, hand_set = swapped(CompressionConfig.from_dict(bundle.settings), args.swap), args.swap
    else:
        config, hand_set = hull_point(args.bundle, bundle, args.hull_point), f"hull point {args.hull_point}"
    calibration = {**bundle.calibration, "hand_set": hand_set}
    save_bundle(dataclasses.replace(bundle, settings=config.to_dict(), calibration=calibration), args.out)
    print(f"{args.out}: {config.to_dict()}")


def hull_point(path: str, bundle, index: int) -> CompressionConfig:
    """The settings of point `index` of the frontier in the report beside the bundle at `path`."""
    report = report_paths(Path(path))["json"]
    if not report.is_file():
        raise SystemExit(f"--hull-point: no report at {report}; it is written beside the bundle by `kvcal calibrate`")
    model = json.loads(report.read_text()).get("search", {}).get("quality_model")
    if model is None:
        raise SystemExit(f"--hull-point: {report} lists no frontier (calibrated with --no-search); use --swap")
    if not 0 <= index < len(model["hull"]):
        raise SystemExit(f"--hull-point {index}: the frontier has points 0 to {len(model['hull']) - 1}")
    point = model["hull"][index]
    sliding = [t == "sliding_attention" for t in bundle.model.layer_types]
    allocation = Allocation(torch.tensor(point["bits"]), point["predicted_loss"], point["held_bytes"],
                            HIGH.index(point["high"]), ALPHAS.index(int(point["alpha_high"])))
    return to_config(CompressionConfig.from_dict(model["base"]), SimpleNamespace(sliding=sliding), allocation)


if __name__ == "__main__":
    main()
