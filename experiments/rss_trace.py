"""When a command's memory peaks: its resident set sampled over time, as the peak and the largest RSS per interval.

    python experiments/rss_trace.py [--every 0.5] [--bucket 5] [--json OUT] -- kvcal calibrate --out X.kvcal.safetensors

Runs the command after `--` and samples every `--every` seconds the RSS (`psutil`, /proc) of each process in its tree:
the command and everything it starts (`/usr/bin/time -v kvcal ...` is timed, kvcal is sampled). Reports the largest
RSS of one process over the run and over each `--bucket` seconds from the start, in MiB, so a peak can be placed
against the stage timings a command reports (`kvcal calibrate --json`'s `seconds`). Sampling misses transients shorter
than `--every`; `/usr/bin/time -v` gives the exact peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import psutil


def largest_rss(root: psutil.Process) -> int:
    """Bytes resident in the largest process of root's tree now (0 if they are all gone)."""
    best = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            best = max(best, p.memory_info().rss)
        except psutil.Error:                # ended between the listing and the reading
            pass
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--bucket", type=float, default=5.0, help="seconds per interval in the trace")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    t0 = time.perf_counter()
    child = subprocess.Popen(command)
    root, samples = psutil.Process(child.pid), []
    while child.poll() is None:
        samples.append((time.perf_counter() - t0, largest_rss(root)))
        time.sleep(args.every)
    buckets: dict[int, int] = {}
    for t, rss in samples:
        k = int(t // args.bucket)
        buckets[k] = max(buckets.get(k, 0), rss)
    mib = 1 << 20
    peak = max(samples, key=lambda s: s[1], default=(0.0, 0))
    result = {"command": command, "exit_status": child.returncode, "seconds": round(time.perf_counter() - t0, 1),
              "every_seconds": args.every, "peak_mib": round(peak[1] / mib), "peak_at_seconds": round(peak[0], 1),
              "trace_mib": {f"{k * args.bucket:g}": round(v / mib) for k, v in sorted(buckets.items())}}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if child.returncode:
        raise SystemExit(child.returncode)


if __name__ == "__main__":
    main()
