"""Build and load the CPU kernels (csrc/paged_attention.cpp): one shared library, compiled at first use, cached on disk.

The library has a plain C ABI and is called through ctypes with tensor data pointers, so it needs no torch headers
(the build takes about a second, not the minute a torch extension takes) and no ninja: only a C++ compiler with
OpenMP, which gcc has. It is compiled for the machine it runs on (`-march=native`); the cache key covers the source,
the flags, the compiler and the CPU's feature flags, so a cache folder shared between machines never serves a
library built for another CPU. Writes are atomic (temporary file + rename).

    lib = load_library()        # ctypes.CDLL, or CpuBuildError with a one-line reason
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvcal.runtime.disk_cache import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno")


class CpuBuildError(RuntimeError):
    """The CPU kernels cannot be built or loaded here (the message says why and what to do)."""


def cache_folder() -> Path:
    """`$KVCAL_CACHE/cpu`, else `~/.cache/kvcal/cpu`."""
    return cache_dir() / "cpu"


def compiler() -> str | None:
    """The C++ compiler to use: `$CXX`, else the first of c++, g++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


def cpu_name() -> str:
    """The CPU's model name (reports and machine identities), or what `platform` knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _key(cxx: str) -> str:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), platform.machine().encode(),
                 _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _compile(cxx: str, target: Path, defines: tuple[str, ...] = ()) -> None:
    """Compile SOURCE into `target` with FLAGS and `defines` (-D options: tests build the kernels' variants)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, *defines, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            first = next((line for line in proc.stderr.splitlines() if "error" in line), proc.stderr.strip()[:200])
            raise CpuBuildError(f"compiling the CPU kernels with `{cxx}` failed: {first}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled kernels (built on first use, then read from the cache). CpuBuildError when impossible."""
    if os.environ.get("KVCAL_DISABLE_CPU_KERNELS", "") not in ("", "0"):
        raise CpuBuildError("the CPU kernels are disabled by KVCAL_DISABLE_CPU_KERNELS")
    cxx = compiler()
    if cxx is None:
        raise CpuBuildError("no C++ compiler on PATH (c++, g++ or clang++; or set $CXX); install one, e.g. "
                            "`apt-get install g++`, to get the fused CPU kernels")
    target = cache_folder() / f"paged_attention-{_key(cxx)}.so"
    if not target.is_file():
        logger.info("compiling the kvcal CPU kernels into %s", target)
        try:
            _compile(cxx, target)
        except (OSError, subprocess.SubprocessError) as e:
            raise CpuBuildError(f"compiling the CPU kernels failed: {e}") from None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise CpuBuildError(f"loading the CPU kernels from {target} failed: {e}; delete the file to rebuild it") \
            from None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.kvcal_desc_ints.restype = i32
    lib.kvcal_desc_ints.argtypes = []
    lib.kvcal_decode.restype = i32
    lib.kvcal_decode.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64,   # arena .. page_bytes
                                 p, p, p, p, i64, i64, i64, i64, i64, f32,     # query .. scale
                                 i32, i32,                                      # track_scores, threads
                                 i64,                                           # grain
                                 p, p, p]                                       # out, exact_score, luts
    lib.kvcal_write.restype = i32
    lib.kvcal_write.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64,    # arena .. page_bytes
                                i32, i64, p, p, p, p, i64, p, i64, p, p, p, p]  # side .. bad_value, luts
    lib.kvcal_write_pages.restype = i32
    lib.kvcal_write_pages.argtypes = [p, p, p, i64, p, p, p, i64, p, i64, p, p, p,  # arena .. bad_value
                                      p, i64]                                       # luts, H
    lib.kvcal_insert_every.restype = i32
    lib.kvcal_insert_every.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64,   # arena .. page_bytes
                                       i32, p, p, p, i64, p, i64, i64, p, p, p, p,   # side .. n_need
                                       p, p, i64, p, p, p, p]                        # luts .. placed
    lib.kvcal_compact_high.restype = i32
    lib.kvcal_compact_high.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64,   # arena .. page_bytes
                                       i64, p, p, p]                                  # n, b, h, count
    lib.kvcal_seal_low_pages.restype = i32
    lib.kvcal_seal_low_pages.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64,   # arena .. page_bytes
                                         i64, p, p, p, p, p, p, p]                     # n .. bad_value
    lib.kvcal_round_trip.restype = i32
    lib.kvcal_round_trip.argtypes = [p, i64, i64, i64, i32, i32, i32, i32, p,   # x .. luts
                                     p, p, p, i32, p]                           # g2 .. bad_value
    lib.kvcal_prefill.restype = i32
    lib.kvcal_prefill.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, f32, i32]  # q, k, v, out .. threads
    lib.kvcal_sliding_decode.restype = i32
    lib.kvcal_sliding_decode.argtypes = [p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64,   # q .. r
                                         i32, i32, i32, i32, i32, i32, i64, f32, i32,               # k_bits .. threads
                                         p, p]                                                      # levels
    lib.kvcal_low_pages_due.restype = i64
    lib.kvcal_low_pages_due.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64,  # arena .. page_bytes
                                        p, i64, i64, f32, f32, i32, f32, p]           # n_pad .. counts
