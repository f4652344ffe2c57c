"""cuda-python backend: NVRTC builds with an on-disk cache, launch-argument packing, a GPU probe, and loading a cubin
on the GPU the probe found (`load_module`).

Importing this package never touches the driver and works without cuda-python; `cuda_status()` says whether the GPU
path can run (GPU-less machines are the norm, so that is an answer, not an error).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

from .build import (
    CompiledModule,
    compile_kernel,
    cuda_core,
    default_cache_dir,
    kernel_source,
    nvrtc_version,
    parse_ptxas_report,
)
from .launch import PackedArgs, Param, ceil_div, grid_for, launch, pack_args, parse_params

logger = logging.getLogger(__name__)

__all__ = [
    "CompiledModule",
    "CudaStatus",
    "PackedArgs",
    "Param",
    "ceil_div",
    "compile_kernel",
    "cuda_status",
    "default_cache_dir",
    "grid_for",
    "kernel_source",
    "launch",
    "load_module",
    "nvrtc_version",
    "pack_args",
    "parse_params",
    "parse_ptxas_report",
]


@dataclass(frozen=True)
class CudaStatus:
    """Whether the cuda-python path can run here, and why not."""

    available: bool
    reason: str  # one line: what is missing and how to fix it, or a summary of the device when available
    device_name: str | None = None  # of device 0
    arch: str | None = None  # "sm_90": the cubin target for device 0
    nvrtc_version: tuple[int, int] | None = None
    driver_version: tuple[int, int] | None = None  # CUDA version the driver supports, e.g. (13, 0)


def _probe() -> CudaStatus:
    if os.environ.get("KVCAL_DISABLE_CUDA", "") not in ("", "0"):
        return CudaStatus(False, "disabled by `KVCAL_DISABLE_CUDA`")
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError:
        return CudaStatus(False, "cuda-python is not installed (`pip install kvcal[cuda]`)")
    try:
        nv: tuple[int, int] | None = nvrtc_version()
    except RuntimeError:
        nv = None
    ok = driver.CUresult.CUDA_SUCCESS
    try:
        (err,) = driver.cuInit(0)
    except RuntimeError:  # cuda.pathfinder.DynamicLibNotFoundError: no libcuda.so.1
        return CudaStatus(False, "no CUDA driver found (libcuda.so not loadable)", nvrtc_version=nv)
    if err == driver.CUresult.CUDA_ERROR_NO_DEVICE:
        return CudaStatus(False, "no GPU visible (CUDA_ERROR_NO_DEVICE; check CUDA_VISIBLE_DEVICES)", nvrtc_version=nv)
    if err != ok:
        return CudaStatus(False, f"cuInit failed with {err.name}", nvrtc_version=nv)
    err, ver = driver.cuDriverGetVersion()
    drv = (ver // 1000, ver % 1000 // 10) if err == ok else None
    err, count = driver.cuDeviceGetCount()
    if err != ok or count == 0:
        return CudaStatus(False, "no GPU visible", nvrtc_version=nv, driver_version=drv)
    err, dev = driver.cuDeviceGet(0)
    _, raw_name = driver.cuDeviceGetName(64, dev)
    name = raw_name.split(b"\x00", 1)[0].decode(errors="replace")
    attr = driver.CUdevice_attribute
    _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    _, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    arch = f"sm_{major}{minor}"
    found = dict(device_name=name, arch=arch, nvrtc_version=nv, driver_version=drv)
    if nv is None:
        return CudaStatus(False, "NVRTC library not found (`pip install nvidia-cuda-nvrtc`)", **found)
    _, archs = nvrtc.nvrtcGetSupportedArchs()
    if major * 10 + minor not in archs:
        return CudaStatus(False, f"NVRTC {nv[0]}.{nv[1]} cannot target {arch}; install an NVRTC that supports it",
                          **found)
    drv_s = f"{drv[0]}.{drv[1]}" if drv else "?"
    return CudaStatus(True, f"{name} ({arch}), driver CUDA {drv_s}, NVRTC {nv[0]}.{nv[1]}", **found)


@functools.cache
def cuda_status() -> CudaStatus:
    """Probe cuda-python, NVRTC, the driver and device 0 once per process. Never raises."""
    try:
        status = _probe()
    except Exception as e:  # any surprise from a half-installed stack means "use the torch path"
        msg = str(e).splitlines()[0] if str(e) else ""
        status = CudaStatus(False, f"CUDA probe failed: {type(e).__name__}: {msg}")
    logger.info("cuda-python backend %s: %s", "available" if status.available else "unavailable", status.reason)
    return status


def load_module(compiled: CompiledModule):
    """GPU ONLY (not testable without one): load the cubin into the current device's primary context.

    Returns a ``cuda.core.ObjectCode``; ``.get_kernel("name")`` takes the names given to `compile_kernel`.
    Uses device 0, the device `cuda_status()` describes."""
    status = cuda_status()
    if not status.available:
        raise RuntimeError(f"cannot load CUDA module: {status.reason}")
    if compiled.arch.rstrip("af") != (gpu := status.arch):  # sm_90a cubins run on sm_90 only
        raise RuntimeError(f"cubin is for `{compiled.arch}` but the GPU is `{gpu}`; compile with arch=`{gpu}`")
    cc = cuda_core()
    cc.Device(0).set_current()  # the primary context, the same one torch uses
    # cuda.core hands a mapped name to cuLibraryGetKernel as it is, and that takes bytes
    return cc.ObjectCode.from_cubin(compiled.cubin, symbol_mapping={k: v.encode() for k, v in compiled.symbols.items()})
