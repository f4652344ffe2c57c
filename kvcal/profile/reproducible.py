"""Matrix products whose last bits do not depend on the thread count, for the calibration.

torch's x86 wheels compute float32 matrix products with MKL, which promises the same last bits only at a fixed thread
count: otherwise the same inputs may give other last bits at 1 and at 2 threads, and a calibration fed by gradients
(the calibrated levels, a k-means) writes other tensors. MKL's strict conditional-numerical-reproducibility mode makes
?gemm bit-reproducible whatever the thread count (the MKL developer guide, "Reproducibility Conditions"). It has to be
chosen before MKL's first call in the process, so `strict_blas` runs first thing in `calibrate`.

    strict_blas()      # -> "mkl-strict" | "mkl" (too late in this process) | "none" (torch without MKL)
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
