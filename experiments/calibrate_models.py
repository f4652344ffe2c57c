"""Cost of the statistics passes and token independence per packaged model: runs `kvcal calibrate --no-search --json`
(8192 random + 8192 text tokens, the random-token pass of FDC §5.1 plus the calibration-text pass) in a fresh process.

    python experiments/calibrate_models.py smollm2-135m gemma3-270m qwen2.5-coder-1.5b [-- EXTRA CALIBRATE ARGS]

Writes docs/results/calibrate-<model>.json (wall time, peak RSS, ranks, δ̄/ε̄; `--results` chooses the folder) and
prints a table. Each model's bundle goes to a temporary folder. A model that fails (not installed) is reported and
skipped, and the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["smollm2-135m"], help="packaged names or model folders")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the calibrate-<model>.json files")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)       # after `--`: more `kvcal calibrate` arguments
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1:]
    args.results.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        name = Path(model).name
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "kvcal", "calibrate", "--model", model, "--out", f"{tmp}/b.safetensors",
                   "--no-search", "--quiet", "--json", *extra]
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode
            print(f"{model}: failed: {reason}")
            continue
        summary = json.loads(proc.stdout)
        summary["command"] = " ".join(["kvcal", "calibrate", "--model", model, "--no-search", *extra])
        (args.results / f"calibrate-{name}.json").write_text(json.dumps(summary, indent=2))
        rows.append(summary)
    print(f"{'model':<22}{'wall s':>8}{'load s':>8}{'passes s':>10}{'peak RSS MiB':>14}{'δ̄/ε̄':>10}{'overlap d/2':>13}")
    for s in rows:
        ti = s["token_independence"]
        print(f"{s['model']:<22}{s['wall_seconds']:>8.1f}{s['load_seconds']:>8.1f}{s['pass_seconds']:>10.1f}"
              f"{s['peak_rss_mib']:>14.0f}{ti['ratio']:>10.1%}{ti['overlap_half']:>13.3f}")
    if len(rows) < len(args.models):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
