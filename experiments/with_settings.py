"""A copy of a bundle whose settings are a `format_swaps.py` swap of its own, to put a hand-set configuration through
`kvcal bench` (its `kvcal-joint` row serves the bundle's settings).

    python experiments/with_settings.py --bundle gemma3-270m.kvcal.safetensors \
        --swap=K8V8m8/K8cV4m8/K8V4m8+16@32,256,0 --out gemma3-270m-hand.kvcal.safetensors

The copy records the swap under `calibration["hand_set"]`, so a reader of the bench can tell it from a calibrated one.
"""

from __future__ import annotations

import argparse
import dataclasses

from format_swaps import swapped

from kvcal.runtime.bundle import load_bundle, save_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.safe_paths import check_bundle_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--swap", required=True, help="HIGH/LOW/SLIDING[+RECENT][@WINDOW,ALPHA_HIGH,ALPHA_LOW]")
    ap.add_argument("--out", required=True, help="the copy (an existing file is refused unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace a kvcal bundle already at --out")
    args = ap.parse_args()
    try:
        check_bundle_out(args.out, overwrite=args.overwrite, inputs=[args.bundle])
    except ValueError as e:
        raise SystemExit(str(e)) from None
    bundle = load_bundle(args.bundle)
    config = swapped(CompressionConfig.from_dict(bundle.settings), args.swap)
    calibration = {**bundle.calibration, "hand_set": args.swap}
    save_bundle(dataclasses.replace(bundle, settings=config.to_dict(), calibration=calibration), args.out)
    print(f"{args.out}: {config.to_dict()}")


if __name__ == "__main__":
    main()
