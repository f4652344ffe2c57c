"""The shipped kernels: their text (with local headers inlined), their C signatures, and compiling them all.

A kernel file may `#include "x.cuh"` from `kernels/`; `kernel_text` pastes the header in place of the include, so the
NVRTC cache key (a hash of the source text) changes whenever a header does. Signatures are parsed from the `.cu`
itself, so launch-argument packing never repeats them by hand.
"""

from __future__ import annotations

import re

from .build import CompiledModule, compile_kernel, kernel_source
from .launch import Param, parse_params

# file -> the extern "C" kernels it exports
KERNELS: dict[str, tuple[str, ...]] = {
    "decode_attention.cu": ("decode_split", "decode_merge"),
    "cache_write.cu": ("write_tokens", "write_channel_keys"),
}

_INCLUDE_RE = re.compile(r'^#include "([\w.]+)"\s*$', re.M)
_COMMENT_RE = re.compile(r"//[^\n]*")


def kernel_text(filename: str) -> str:
    """Source of `kernels/<filename>` with its local `#include "*.cuh"` lines replaced by the headers' text."""
    def paste(m: re.Match) -> str:
        return f"// ---- begin {m.group(1)}\n{kernel_text(m.group(1))}\n// ---- end {m.group(1)}"

    return _INCLUDE_RE.sub(paste, kernel_source(filename))


def kernel_signature(source: str, kernel: str) -> tuple[Param, ...]:
    """The parameters of `extern "C" __global__ void <kernel>(...)` in `source`, parsed (comments stripped)."""
    code = _COMMENT_RE.sub("", source)
    m = re.search(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?' + re.escape(kernel)
                  + r"\s*\(([^)]*)\)", code)
    if m is None:
        raise ValueError(f"no `extern \"C\" __global__ void {kernel}(...)` in the source")
    return parse_params(" ".join(m.group(1).split()))


def compile_all(arch: str, **kwargs) -> dict[str, CompiledModule]:
    """Compile every shipped kernel file for `arch` (cached on disk); file name -> module."""
    return {f: compile_kernel(kernel_text(f), list(ks), arch, name=f.removesuffix(".cu"), **kwargs)
            for f, ks in KERNELS.items()}
