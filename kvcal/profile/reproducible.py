"""Matrix products whose last bits do not depend on the thread count, for the calibration.

torch's x86 wheels compute float32 matrix products with MKL, which promises the same last bits only at a fixed thread
count: otherwise the same inputs may give other last bits at 1 and at 2 threads, and a calibration fed by gradients
(the calibrated levels, a k-means) writes other tensors. MKL's strict conditional-numerical-reproducibility mode makes
?gemm bit-reproducible whatever the thread count (the MKL developer guide, "Reproducibility Conditions"). It has to be
chosen before MKL's first call in the process, so `strict_blas` runs first thing in `calibrate`.

    strict_blas()      # -> "mkl-strict" | "mkl" (too late in this process) | "none" (torch without MKL)

Products outside MKL have no such mode: torch runs bf16 matrix products through oneDNN, whose AMX kernels block by the
thread count (`experiments/thread_bits.py`, docs/calibration.md). `pass_threads` finds whether a model's own products
at a pass's row count give the same bits at one thread as at the current count, so a pass can run where they do.

    with torch_threads(pass_threads(model, rows)): ...      # kvcal.runtime.cache.torch_threads: the current count,
                                                            # or 1 where the bits would follow it
"""

from __future__ import annotations

import ctypes
import functools
import os

# mkl_cbwr.h: the automatic code branch, the strict flag, and the mask that asks for the whole setting
CBWR_AUTO, CBWR_STRICT, CBWR_ALL = 2, 0x10000, -1


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """torch's MKL service functions (linked into libtorch_cpu), or None where this build does not expose them."""
    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        lib.mkl_serv_cbwr_get.restype = lib.mkl_serv_cbwr_set.restype = ctypes.c_int
        lib.mkl_serv_cbwr_get.argtypes = lib.mkl_serv_cbwr_set.argtypes = [ctypes.c_int]
        return lib
    except (OSError, AttributeError):          # another build of torch: no such library or symbols
        return None


def strict_blas() -> str:
    """Put MKL in strict mode (the automatic branch) unless it already is -> "mkl-strict" when it is now; "mkl" when an
    MKL call ran earlier in this process, which fixes its mode (a fresh process, as `kvcal calibrate` is, gets it);
    "none" when torch has no MKL. A mode set by the user's MKL_CBWR with the strict flag is kept."""
    import torch

    if not torch.backends.mkl.is_available():
        return "none"
    lib = _mkl()
    if lib is None:                            # MKL inside, but not reachable from here (another platform's build)
        return "mkl"
    if lib.mkl_serv_cbwr_get(CBWR_ALL) & CBWR_STRICT:
        return "mkl-strict"
    return "mkl-strict" if lib.mkl_serv_cbwr_set(CBWR_AUTO | CBWR_STRICT) == 0 else "mkl"


def linear_shapes(model) -> list[tuple[int, int, object, bool]]:
    """The distinct (in_features, out_features, weight dtype, is the output head) of `model`'s linear layers."""
    import torch

    head = model.get_output_embeddings()
    return sorted({(m.in_features, m.out_features, m.weight.dtype, m is head) for m in model.modules()
                   if isinstance(m, torch.nn.Linear)}, key=str)


def pass_threads(model, rows: int) -> int:
    """torch's current thread count if every distinct linear shape of `model` (in its weights' dtype) gives the same
    bits for `rows` rows at one thread and at that count, else 1. The output head is tried at one row, as the passes
    keep one position's logits. A kernel's blocking follows the shape and the thread count, not the values, so one
    product of seeded random operands per shape tells; the global random state is untouched. On a GPU the thread
    count does not enter the products: the current count."""
    import torch

    from kvcal.runtime.cache import torch_threads

    threads = torch.get_num_threads()
    if threads == 1 or next(model.parameters()).device.type not in ("cpu", "meta"):    # meta: offloaded, run on CPU
        return threads
    g = torch.Generator().manual_seed(0)
    for k, n, dtype, is_head in linear_shapes(model):
        x, w = (torch.randn(1 if is_head else rows, k, generator=g, dtype=dtype),
                torch.randn(n, k, generator=g, dtype=dtype))
        many = torch.nn.functional.linear(x, w)
        with torch_threads(1):
            one = torch.nn.functional.linear(x, w)
        if not torch.equal(one, many):
            return 1
    return threads
