"""Peak RSS and seconds of the confirmation's recording prefill (`DecodeProbe.__init__`) at the default
calibration's shape: smollm2-135m in float32, 4 evaluation windows of 3839 prompt tokens + 256 scored steps.

    python experiments/probe_rss.py [--bundle artifacts/smollm2-135m.kvcal.safetensors] [--mmap-threshold BYTES]

Prints the process's peak RSS before the probe (model and inputs loaded) and after it; the difference is the
recording's own peak. `--mmap-threshold`: glibc's `mallopt(M_MMAP_THRESHOLD, BYTES)` before anything is allocated,
which fixes the threshold above which an allocation gets its own mapping (glibc otherwise raises it as mapped blocks
are freed, so a prefill's large transients come from the heap and fragment it).
"""

from __future__ import annotations

import argparse
import resource
import time

from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe
from kvcal.models import load_model
from kvcal.runtime.bundle import load_bundle


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", default="artifacts/smollm2-135m.kvcal.safetensors", help="a bundle of --model")
    ap.add_argument("--prompt", type=int, default=3839)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4, help="windows of the evaluation split")
    ap.add_argument("--mmap-threshold", type=int, help="glibc M_MMAP_THRESHOLD in bytes (default: glibc's own)")
    args = ap.parse_args()
    if args.mmap_threshold:
        import ctypes

        M_MMAP_THRESHOLD = -3
        if not ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, args.mmap_threshold):
            raise SystemExit(f"mallopt(M_MMAP_THRESHOLD, {args.mmap_threshold}) failed: not glibc, or out of range")
    lm = load_model(args.model, dtype="float32")
    bundle = load_bundle(args.bundle)
    P, M = args.prompt, args.steps
    windows = token_windows(lm.tokenizer, load_corpus("default", "eval"), args.windows, P + M + 1, 2,
                            long_first=True)
    before, t = peak_mib(), time.perf_counter()
    DecodeProbe(lm.model, bundle, windows[:, :P], windows[:, P:], tokenizer=lm.tokenizer)
    print(f"peak RSS {before:.0f} MiB before the probe, {peak_mib():.0f} MiB after it; "
          f"{time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
