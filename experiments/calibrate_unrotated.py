"""What the search chooses with keys and values left in the model's own basis: `kvcal calibrate` with the search's
frame at `rotate=False` (identity key rotation and value basis, no mixing), everything else as the command runs.

    python experiments/calibrate_unrotated.py [--json OUT] -- -m gemma3-270m --threads 2

A what-if for the key basis (docs/formats.md, "The key basis"): the bundle's settings do not record `rotate`, so a
bundle made this way would be served rotated. It is written to a temporary folder and removed; the command's --json
summary (its path, the chosen point and its check) is what this script keeps, on stdout or in OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="where the calibration's --json summary goes (default: stdout)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="kvcal calibrate's arguments, after --")
    ns = ap.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if any(a.startswith(("--out", "-o", "--json")) for a in args):
        ap.error("--out and --json are this script's to set")
    import kvcal.profile.choose as choose
    from kvcal.cli import main as kvcal_main

    frame = choose.base_settings
    choose.base_settings = lambda *a, **k: dataclasses.replace(frame(*a, **k), rotate=False)
    out, code = io.StringIO(), 0
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(out):
            sys.argv = ["kvcal", "calibrate", *args, "--out", f"{tmp}/unrotated.kvcal.safetensors", "--json"]
            kvcal_main()
    except SystemExit as e:
        code = e.code or 0
    finally:
        choose.base_settings = frame
    if code:
        sys.exit(f"kvcal calibrate failed (exit {code})")
    summary = json.loads(out.getvalue())
    summary["frame"] = {"rotate": False}
    text = json.dumps(summary, indent=1)
    if ns.json:
        ns.json.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
