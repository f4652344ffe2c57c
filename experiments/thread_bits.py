"""Whether a model's matrix products give the same bits at two thread counts, per dtype: the cause of a calibration
that writes other tensors at 1 and at 2 threads.

    python experiments/thread_bits.py -m smollm2-135m gemma3-270m qwen2.5-coder-1.5b --json OUT

For every distinct (in, out) shape of the models' linear layers and every row count in `--rows` (the statistics
passes' 1024-token windows, the search's 3839-token prompts, shorter tails), one random `F.linear` per dtype at each
thread count of `--threads`, compared as bytes. MKL's strict mode is chosen first, as `kvcal calibrate` does
(`kvcal.profile.reproducible`), so float32 products run as the calibration runs them; bf16 products go through
oneDNN. The output head (vocabulary-wide) is tried only up to 256 rows, the positions the search scores. Prints the
shapes that differ and each dtype's time for all its products at each thread count, and exits 0:
a difference is a finding, not a failure. `ONEDNN_MAX_CPU_ISA` in the environment (e.g. `AVX512_CORE_BF16`, oneDNN
without AMX) is recorded with the result.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kvcal.profile.reproducible import linear_shapes, strict_blas

HEAD_ROWS = 256        # rows tried for the vocabulary-wide output head


def model_shapes(model: str) -> list[tuple[int, int, bool]]:
    """The distinct (in_features, out_features, is the output head) of a model's linear layers, the head last."""
    from kvcal.models import load_model

    shapes = {(k, n, head) for k, n, _, head in linear_shapes(load_model(model, dtype="bfloat16").model)}
    return sorted(shapes, key=lambda s: (s[2], s[0], s[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 512, 1024, 2048, 3839, 4096])
    ap.add_argument("--threads", type=int, nargs=2, default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--torch-deterministic", action="store_true",
                    help="set torch.use_deterministic_algorithms and torch.backends.mkldnn.deterministic first")
    ap.add_argument("--json")
    args = ap.parse_args()
    blas = strict_blas()
    import torch
    import torch.nn.functional as F

    from kvcal.runtime.backends.cpu.build import cpu_name

    if args.torch_deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.mkldnn.deterministic = True
    torch.manual_seed(0)
    result = {"cpu": cpu_name(), "blas": blas, "threads": args.threads, "rows": args.rows,
              "torch_deterministic": args.torch_deterministic,
              "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "models": {}}
    for model in args.models:
        shapes = model_shapes(model)
        per_dtype = {}
        for name in args.dtypes:
            dtype = getattr(torch, name)
            differ, seconds = [], {t: [] for t in args.threads}
            for k, n, head in shapes:
                w = torch.randn(n, k, dtype=dtype)
                for m in args.rows:
                    if head and m > HEAD_ROWS:
                        continue
                    x = torch.randn(m, k, dtype=dtype)
                    out = {}
                    for t in args.threads:
                        torch.set_num_threads(t)
                        F.linear(x, w)                                     # first call: the kernel's setup
                        t0 = time.perf_counter()
                        out[t] = F.linear(x, w)
                        seconds[t].append(time.perf_counter() - t0)
                    if not torch.equal(*out.values()):
                        differ.append([m, k, n])
            tried = sum(sum(r <= HEAD_ROWS for r in args.rows) if head else len(args.rows) for _, _, head in shapes)
            per_dtype[name] = {"tried": tried, "differ": differ,
                               "total_ms": {str(t): round(1e3 * sum(s), 1) for t, s in seconds.items()}}
            print(f"{model:22} {name:9} {len(differ):3} of {tried} (rows, in, out) differ at {args.threads} threads"
                  + "".join(f"; {t} threads {v} ms" for t, v in per_dtype[name]["total_ms"].items()), flush=True)
            for m, k, n in differ:
                print(f"    {m} x {k} -> {n}")
        result["models"][model] = {"shapes": [[k, n] for k, n, _ in shapes], **per_dtype}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
