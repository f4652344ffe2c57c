"""Compile CUDA C++ with NVRTC to a cubin for one GPU architecture, with an on-disk cache.

Needs no GPU and no driver, only ``cuda.bindings.nvrtc`` and the NVRTC library (``nvidia-cuda-nvrtc``). We build
**cubin for the exact ``sm_XX``**, never PTX: NVRTC 13.5 emits PTX ISA 9.5, which a CUDA 13.0 driver refuses.
``--ptxas-options=-v`` puts registers and spill bytes per function into the log, so CI can hold kernels to a budget.

Cache: ``$KVCAL_CACHE/cuda`` (default ``~/.cache/kvcal/cuda``), ``<key>.cubin`` + ``<key>.json`` (log, symbols) per
build; key = sha256 of (source, name, kernel names, arch, options, NVRTC version). Sources must be self-contained
apart from the CUDA headers: an ``#include`` of a local file is not part of the key.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvcal.runtime.disk_cache import cache_dir

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 1  # bump when the cache layout or the meaning of the key changes
_BASE_OPTIONS = ("-std=c++17", "--ptxas-options=-v")  # -v: per-function registers/spills in the log
_ARCH_RE = re.compile(r"^sm_\d+[af]?$")
_INSTALL_HINT = "`pip install kvcal[cuda]` (cuda-python and nvidia-cuda-nvrtc)"


@dataclass(frozen=True)
class CompiledModule:
    """A cubin for one arch plus what ptxas said about it."""

    cubin: bytes  # ELF, starts with b"\x7fELF"
    arch: str  # "sm_90"
    log: str  # NVRTC + ptxas log (the -v report); "" when the compiler said nothing
    symbols: dict[str, str]  # kernel name expression -> lowered symbol (mangled unless extern "C")
    registers: dict[str, int]  # kernel name -> registers per thread
    spills: dict[str, tuple[int, int]]  # function -> (spill store bytes, spill load bytes); device functions too
    cache_hit: bool = False
    key: str = field(default="", repr=False)  # sha256 hex of the build inputs


# ---------------------------------------------------------------- NVRTC plumbing


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise RuntimeError(f"cuda-python is not installed ({e}); run {_INSTALL_HINT}") from e
    return nvrtc


def _check(nvrtc, res):
    """cuda.bindings calls return (err, *values); raise on error, return the value(s)."""
    err, *vals = res
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC call failed: {err.name}: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return vals[0] if len(vals) == 1 else tuple(vals)


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library that cuda-python finds; RuntimeError naming the fix when there is none."""
    nvrtc = _nvrtc()
    try:
        return tuple(_check(nvrtc, nvrtc.nvrtcVersion()))
    except RuntimeError as e:  # includes cuda.pathfinder.DynamicLibNotFoundError: no libnvrtc.so
        raise RuntimeError(f"NVRTC library not found ({str(e).splitlines()[0]}); run {_INSTALL_HINT}") from e


def _header_options(version: tuple[int, int], cache_dir: Path) -> list[str]:
    """Where cuda_fp16.h & co come from: NVRTC >= 13.5 unpacks its bundled headers; older needs nvidia-cuda-runtime."""
    if version >= (13, 5):
        return [f"--use-bundled-headers={cache_dir / f'nvrtc-headers-{version[0]}.{version[1]}'}"]
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        inc = find_nvidia_header_directory("cudart")
    except ImportError:  # cuda-pathfinder too old to locate headers
        inc = None
    if inc is None:
        nv = f"{version[0]}.{version[1]}"
        raise RuntimeError(f"CUDA headers not found for NVRTC {nv}; `pip install nvidia-cuda-runtime=={nv}.*`")
    return [f"--include-path={inc}"]


def _read_log(nvrtc, prog) -> str:
    buf = b" " * _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog))
    _check(nvrtc, (nvrtc.nvrtcGetProgramLog(prog, buf)[0],))
    return buf.rstrip(b"\x00 ").decode(errors="replace").strip()


def _nvrtc_compile(source: str, name: str, kernels: Sequence[str], options: list[str]):
    """-> (cubin, log, {name expression: lowered symbol}). RuntimeError with the log's first lines on failure."""
    nvrtc = _nvrtc()
    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []))
    try:
        for k in kernels:  # registering name expressions lets templated kernels be found by their C++ name
            _check(nvrtc, (nvrtc.nvrtcAddNameExpression(prog, k.encode())[0],))
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _read_log(nvrtc, prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            head = "\n".join(log.splitlines()[:12])
            raise RuntimeError(f"NVRTC failed to compile `{name}.cu` ({err.name}); fix the source:\n{head}")
        symbols = {k: _check(nvrtc, nvrtc.nvrtcGetLoweredName(prog, k.encode())).decode() for k in kernels}
        cubin = b" " * _check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog))
        _check(nvrtc, (nvrtc.nvrtcGetCUBIN(prog, cubin)[0],))
        return cubin, log, symbols
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# ---------------------------------------------------------------- ptxas -v report

_FUNC_RE = re.compile(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")


def parse_ptxas_report(log: str) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """ptxas -v log -> ({symbol: registers}, {symbol: (spill store bytes, spill load bytes)}).

    Registers are reported for entry functions (kernels) only; spills for every function, callees included."""
    registers: dict[str, int] = {}
    spills: dict[str, tuple[int, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _FUNC_RE.search(line):
            current = m.group(1)
        elif current and (m := _SPILL_RE.search(line)):
            spills[current] = (int(m.group(1)), int(m.group(2)))
        elif current and (m := _REGS_RE.search(line)):
            registers[current] = int(m.group(1))
    return registers, spills


def _module(cubin: bytes, arch: str, log: str, symbols: dict[str, str], hit: bool, key: str) -> CompiledModule:
    regs, spills = parse_ptxas_report(log)
    names = {sym: k for k, sym in symbols.items()}  # report under the names the caller used
    registers = {names.get(s, s): r for s, r in regs.items()}
    spills = {names.get(s, s): v for s, v in spills.items()}
    return CompiledModule(cubin, arch, log, symbols, registers, spills, cache_hit=hit, key=key)


# ---------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """`$KVCAL_CACHE/cuda`, else `~/.cache/kvcal/cuda`."""
    return cache_dir() / "cuda"


def _atomic_write(path: Path, data: bytes) -> None:
    """temp file in the same folder + rename: readers never see a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_cached(folder: Path, key: str, arch: str) -> CompiledModule | None:
    meta_path, cubin_path = folder / f"{key}.json", folder / f"{key}.cubin"
    try:  # the .json is written last, so its presence means the .cubin is complete
        meta: dict[str, Any] = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # corrupt entry: rebuild and overwrite
        logger.warning("ignoring unreadable cache entry %s (%s)", meta_path, e)
        return None
    if not cubin.startswith(b"\x7fELF") or meta.get("format") != _CACHE_FORMAT:
        logger.warning("ignoring stale cache entry %s", meta_path)
        return None
    return _module(cubin, arch, meta["log"], meta["symbols"], True, key)


# ---------------------------------------------------------------- public API


def compile_kernel(source: str, kernels: Sequence[str], arch: str, *, options: Sequence[str] = (),
                   cache_dir: str | os.PathLike | None = None, name: str = "kvcal_kernel",
                   use_cache: bool = True) -> CompiledModule:
    """Compile `source` to a cubin for `arch` ("sm_80", "sm_90", "sm_90a"), or return the cached build.

    `kernels` are the ``__global__`` functions to export, as C++ name expressions (plain names for ``extern "C"``,
    ``"f<4>"`` for templates); `options` are extra NVRTC flags (e.g. ``"--use_fast_math"``, ``"-DBITS=4"``).
    """
    if not _ARCH_RE.match(arch):
        raise ValueError(f"arch must look like `sm_90` (cubin target), got `{arch}`; PTX targets are not supported")
    kernels, options = ([kernels] if isinstance(kernels, str) else list(kernels)), list(options)
    if not kernels:
        raise ValueError("`kernels` is empty; name at least one __global__ function to export")
    version = nvrtc_version()
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key_src = json.dumps({"format": _CACHE_FORMAT, "source": source, "name": name, "kernels": sorted(kernels),
                          "arch": arch, "options": options, "nvrtc": list(version)}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()
    if use_cache and (hit := _load_cached(folder, key, arch)) is not None:
        logger.debug("cuda cache hit %s (%s, %s)", key[:12], name, arch)
        _log_report(name, hit)
        return hit

    folder.mkdir(parents=True, exist_ok=True)  # also holds the unpacked NVRTC headers
    all_options = [f"--gpu-architecture={arch}", *_BASE_OPTIONS, *_header_options(version, folder), *options]
    cubin, log, symbols = _nvrtc_compile(source, name, kernels, all_options)
    if use_cache:
        _atomic_write(folder / f"{key}.cubin", cubin)
        meta = {"format": _CACHE_FORMAT, "name": name, "arch": arch, "nvrtc": version, "log": log, "symbols": symbols}
        _atomic_write(folder / f"{key}.json", json.dumps(meta, indent=1).encode())  # last: marks the entry complete
    logger.info("compiled %s for %s with NVRTC %d.%d", name, arch, *version)
    mod = _module(cubin, arch, log, symbols, False, key)
    _log_report(name, mod)
    return mod


def _log_report(name: str, mod: CompiledModule) -> None:
    """The ptxas report, per kernel, at debug level: a build is a library call, and what it prints to stdout would
    land in the caller's output (a test run's dots, a CLI's JSON). Logging at DEBUG (`pytest --log-level=DEBUG`)
    shows it."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    for k, regs in mod.registers.items():
        stores, loads = mod.spills.get(k, (0, 0))
        logger.debug("%s %s: %s %d registers, spill stores %d B, spill loads %d B", name, mod.arch, k, regs, stores,
                     loads)
    if mod.log:
        logger.debug("NVRTC log of %s for %s:\n%s", name, mod.arch, mod.log)


def kernel_source(filename: str) -> str:
    """Text of a `.cu` file shipped in `kvcal/runtime/backends/cuda/kernels/`."""
    return resources.files(__package__).joinpath("kernels", filename).read_text()


def cuda_core():
    """cuda.core's namespace: `cuda.core` from 1.0, `cuda.core.experimental` before (GPU images may have an old one)."""
    import cuda.core as cc

    return cc if hasattr(cc, "ObjectCode") else importlib.import_module("cuda.core.experimental")
