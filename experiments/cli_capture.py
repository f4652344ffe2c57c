"""Terminal captures of `kvcal calibrate` for docs/cli.md: a real terminal (tmux, 100 columns) runs a calibration
and its screen is read every second; kept are a screen while the budget probes run and the whole final scrollback.

    python experiments/cli_capture.py [--model smollm2-135m] [--out /tmp/kvcal-capture] [-- extra calibrate args]

Without --model, the tests' tiny random Llama (tests/conftest.py) on word-salad text, with a short search: about a
minute on 2 cores. Needs tmux.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_inputs(folder: Path) -> list[str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import random_text, save_model

    save_model(folder / "tiny")
    (folder / "docs.jsonl").write_text("\n".join(json.dumps({"text": random_text(300, seed=i)}) for i in range(40)))
    return ["--model", "./tiny", "--dataset", "./docs.jsonl", "--random-tokens", "512", "--text-tokens", "512",
            "--seq-len", "64", "--dtype", "float32", "--search-windows", "2", "--search-prompt", "48",
            "--search-steps", "16", "--target-top1", "0.9"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--out", default="/tmp/kvcal-capture")
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    calib = (["--model", args.model] if args.model else tiny_inputs(out)) + ["--out", "demo.kvcal.safetensors",
                                                                             *args.extra]
    cmd = (f"cd {shlex.quote(str(out))} && PYTHONPATH={shlex.quote(str(ROOT))} {shlex.quote(sys.executable)} "
           f"-m kvcal calibrate {shlex.join(calib)}; echo EXIT=$?; sleep 3600")
    session = f"kvcal-capture-{int(time.time())}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "100", "-y", "45", cmd], check=True)
    middle = None
    try:
        while True:
            time.sleep(1)
            screen = subprocess.run(["tmux", "capture-pane", "-t", session, "-p"], capture_output=True,
                                    text=True).stdout
            measured = "  meets" in screen or "  misses" in screen
            running = "search text) for" in screen or "evaluation text) for" in screen
            if running and measured and middle is None:
                middle = screen
            if "EXIT=" in screen:
                break
        final = subprocess.run(["tmux", "capture-pane", "-t", session, "-p", "-S", "-400"], capture_output=True,
                               text=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session])
    strip = lambda s: "\n".join(line.rstrip() for line in (s or "").strip().splitlines())   # noqa: E731
    (out / "search.txt").write_text(strip(middle) + "\n")
    (out / "final.txt").write_text(strip(final) + "\n")
    print(f"{out / 'search.txt'} (during the search), {out / 'final.txt'} (the whole run)")
    status = re.search(r"EXIT=(\d+)", final)
    if status is None or status.group(1) != "0":
        raise SystemExit(f"kvcal calibrate exited with {status.group(1) if status else 'no status'}; see "
                         f"{out / 'final.txt'}")


if __name__ == "__main__":
    main()
