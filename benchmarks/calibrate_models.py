"""Cost of the statistics passes and token independence per packaged model: runs `kvcal calibrate --no-search --json`
(8192 random + 8192 text tokens, the random-token pass of FDC §5.1 plus the calibration-text pass) in a fresh process.

    python benchmarks/calibrate_models.py smollm2-135m gemma3-270m qwen2.5-coder-1.5b

Writes docs/results/calibrate-<model>.json (wall time, peak RSS, ranks, δ̄/ε̄) and prints a table. Each model's
bundle goes to a temporary folder. A model that is not installed is reported and skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def main(models: list[str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = ["kvcal", "calibrate", "--model", model, "--out", f"{tmp}/b.safetensors", "--no-search", "--quiet",
                   "--json"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode
            print(f"{model}: failed: {reason}")
            continue
        summary = json.loads(proc.stdout)
        summary["command"] = " ".join(cmd[:4] + ["--no-search"])
        (RESULTS / f"calibrate-{model}.json").write_text(json.dumps(summary, indent=2))
        rows.append(summary)
    print(f"{'model':<22}{'wall s':>8}{'load s':>8}{'passes s':>10}{'peak RSS MiB':>14}{'δ̄/ε̄':>10}{'overlap d/2':>13}")
    for s in rows:
        ti = s["token_independence"]
        print(f"{s['model']:<22}{s['wall_seconds']:>8.1f}{s['load_seconds']:>8.1f}{s['pass_seconds']:>10.1f}"
              f"{s['peak_rss_mib']:>14.0f}{ti['ratio']:>10.1%}{ti['overlap_half']:>13.3f}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["smollm2-135m"])
