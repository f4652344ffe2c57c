"""Whether `kvcal calibrate` writes the same bundle at two thread counts: tensor by tensor, byte for byte.

    python experiments/thread_determinism.py [--threads 1 2] [--json OUT] -- --model smollm2-135m

Runs `kvcal calibrate ARGS --threads N --json` once per count into a temporary folder, one after the other, and
compares every tensor of the bundles as bytes, the chosen settings and the path of measurements. Reports the CPU, the
BLAS mode each run recorded (`calibration.blas`), each run's wall seconds and what differs. Exits 1 when something
differs. tests/test_determinism.py checks the same on tiny models in CI; this is the real model at its context.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(args: list[str], threads: int, folder: Path) -> dict:
    """One calibration at `threads` -> its --json summary, with the bundle's path."""
    out = folder / f"t{threads}" / "bundle.kvcal.safetensors"
    out.parent.mkdir()
    done = subprocess.run([sys.executable, "-m", "kvcal", "calibrate", *args, "--out", str(out), "--threads",
                           str(threads), "--json"], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"kvcal calibrate at {threads} threads failed (exit {done.returncode}): "
                 f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no message'}")
    return json.loads(done.stdout)


def compare(first: Path, second: Path) -> dict:
    """The names of tensors that differ in bytes, dtype or shape, and whether settings and path agree."""
    import torch
    from safetensors.torch import load_file

    from kvcal.runtime.bundle import load_bundle

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8),
                                                                         y.contiguous().view(torch.uint8))

    a, b = load_file(str(first)), load_file(str(second))
    differ = sorted(set(a) ^ set(b)) + sorted(n for n in set(a) & set(b) if not same(a[n], b[n]))
    x, y = load_bundle(first), load_bundle(second)
    path = [[r["stage"], r["index"]] for r in x.calibration.get("search", {}).get("path", [])]
    other = [[r["stage"], r["index"]] for r in y.calibration.get("search", {}).get("path", [])]
    return {"tensors": len(a), "differ": differ, "same_settings": x.settings == y.settings, "same_path": path == other,
            "path": path, "blas": [x.calibration.get("blas"), y.calibration.get("blas")]}


def main() -> None:
    from kvcal.runtime.backends.cpu.build import cpu_name

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs=2, default=[1, 2])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="kvcal calibrate's arguments, after --")
    ns = parser.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if any(a.startswith(("--out", "--threads", "--json")) for a in args):
        parser.error("--out, --threads and --json are this script's to set")
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run(args, t, Path(tmp)) for t in ns.threads]
        result = {"command": ["kvcal", "calibrate", *args], "cpu": cpu_name(), "threads": ns.threads,
                  "wall_seconds": [r["wall_seconds"] for r in runs],
                  **compare(*(Path(r["bundle"]) for r in runs))}
    text = json.dumps(result, indent=1)
    print(text)
    if ns.json:
        ns.json.write_text(text + "\n")
    sys.exit(1 if result["differ"] or not (result["same_settings"] and result["same_path"]) else 0)


if __name__ == "__main__":
    main()
