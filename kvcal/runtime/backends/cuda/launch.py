"""Host-side kernel launch arguments, packed exactly as the C signature declares them, plus grid math.

The driver copies each kernel argument by its C size. cuda.core packs a plain Python ``int`` as an 8-byte
``intptr_t`` and a ``float`` as an 8-byte ``double``, so passing ``n`` to an ``int n`` parameter silently shifts every
later argument. `pack_args` converts each value to the numpy scalar of its declared C type (``np.int32`` for ``int``,
``np.float32`` for ``float``, ``np.uint64`` for any pointer), refusing values that do not fit instead of wrapping.

Everything here except `launch` is pure Python and runs without a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_SCALARS: dict[str, type[np.generic]] = {  # C scalar type -> numpy type of the same size
    "int": np.int32, "int32_t": np.int32, "signed int": np.int32,
    "unsigned": np.uint32, "unsigned int": np.uint32, "uint32_t": np.uint32,
    "long long": np.int64, "int64_t": np.int64,
    "unsigned long long": np.uint64, "uint64_t": np.uint64, "size_t": np.uint64,
    "float": np.float32,
}
_POINTEE_DTYPES: dict[str, tuple[torch.dtype, ...]] = {  # what a `T*` may point at; pointees not listed accept any
    "float": (torch.float32,), "double": (torch.float64,),
    "__half": (torch.float16,), "half": (torch.float16,), "__nv_bfloat16": (torch.bfloat16,),
    "int": (torch.int32,), "int32_t": (torch.int32,), "long long": (torch.int64,), "int64_t": (torch.int64,),
    "unsigned": (torch.int32, torch.uint32), "unsigned int": (torch.int32, torch.uint32),
    "uint32_t": (torch.int32, torch.uint32),
    "signed char": (torch.int8,), "int8_t": (torch.int8,), "char": (torch.int8, torch.uint8),
    "unsigned char": (torch.uint8,), "uint8_t": (torch.uint8,), "bool": (torch.bool,),
}
_QUALIFIERS = re.compile(r"\b(__restrict__|__restrict|restrict|volatile)\b")
_MAX_GRID_X = 2**31 - 1  # gridDim.x limit (compute capability >= 3.0)


@dataclass(frozen=True)
class Param:
    """One kernel parameter, parsed from its C declaration."""

    ctype: str  # normalized type, e.g. "const __half*" or "int"
    name: str  # "" when the declaration has no name
    pointee: str | None = None  # "__half" for "const __half*"; None for scalars

    @property
    def np_type(self) -> type[np.generic]:
        return np.uint64 if self.pointee is not None else _SCALARS[self.ctype]

    def label(self, i: int) -> str:
        return f"argument {i} (`{self.ctype}{' ' + self.name if self.name else ''}`)"


def parse_param(decl: str) -> Param:
    """"const __half* __restrict__ scale" -> Param("const __half*", "scale", "__half"); "int n" -> Param("int", "n")."""
    tokens = _QUALIFIERS.sub(" ", decl).replace("*", " * ").split()
    if "*" in tokens:
        star = len(tokens) - 1 - tokens[::-1].index("*")  # the last `*`; anything after it is the name
        name = " ".join(tokens[star + 1 :])
        base = [t for t in tokens[:star] if t != "const"]
        if not base or not re.fullmatch(r"\w*", name):
            raise ValueError(f"cannot parse kernel parameter `{decl}`; write it like `const float* x`")
        pointee = " ".join(base).replace(" *", "*")  # "float" for `float*`, "float*" for `float**`
        return Param(("const " if "const" in tokens[:star] else "") + pointee + "*", name, pointee)
    d = " ".join(tokens)
    if d in _SCALARS:
        return Param(d, "")
    ctype, _, name = d.rpartition(" ")
    if ctype not in _SCALARS:
        raise ValueError(f"unsupported kernel parameter type in `{decl}`; scalars must be one of {sorted(_SCALARS)}")
    return Param(ctype, name)


def parse_params(signature: str | Sequence[str]) -> tuple[Param, ...]:
    """A list of declarations, or one comma-separated string ("const float* x, float* y, int n")."""
    decls = signature.split(",") if isinstance(signature, str) else signature
    return tuple(parse_param(d) for d in decls if d.strip())


@dataclass(frozen=True)
class PackedArgs:
    """Kernel arguments as sized numpy scalars. Holds the tensors so their memory outlives the launch call."""

    params: tuple[Param, ...]
    values: tuple[np.generic, ...]  # pass as `cuda.core.launch(stream, config, kernel, *values)`
    tensors: tuple[torch.Tensor, ...] = ()  # keep-alive only

    def kernel_params(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """For the raw driver API: (uint64 array of argument addresses, holders). Pass ``addresses.ctypes.data`` as
        `cuLaunchKernel`'s ``kernelParams`` and keep both alive until the launch returns."""
        holders = [np.array([v], dtype=type(v)) for v in self.values]
        return np.array([h.ctypes.data for h in holders], dtype=np.uint64), holders


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _pack_scalar(p: Param, i: int, v: Any) -> np.generic:
    t = p.np_type
    if np.issubdtype(t, np.integer):
        if not _is_int(v):
            raise TypeError(f"{p.label(i)} expects an integer, got {type(v).__name__} {v!r}")
        info = np.iinfo(np.dtype(t))
        if not info.min <= int(v) <= info.max:
            raise ValueError(f"{p.label(i)}: {int(v)} does not fit {t.__name__} [{info.min}, {info.max}]")
        return t(int(v))
    if not (_is_int(v) or isinstance(v, (float, np.floating))):
        raise TypeError(f"{p.label(i)} expects a float, got {type(v).__name__} {v!r}")
    x = float(v)
    if np.isfinite(x) and abs(x) > float(np.finfo(np.float32).max):
        raise ValueError(f"{p.label(i)}: {x!r} overflows float32")
    if _is_int(v) and float(np.float32(x)) != int(v):
        raise ValueError(f"{p.label(i)}: integer {int(v)} is not exact in float32; pass a float on purpose")
    return np.float32(x)


def _pack_pointer(p: Param, i: int, v: Any) -> tuple[np.uint64, torch.Tensor | None]:
    if v is None:
        return np.uint64(0), None  # NULL, for optional buffers
    if isinstance(v, torch.Tensor):
        allowed = _POINTEE_DTYPES.get(p.pointee or "")
        if allowed is not None and v.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{p.label(i)} expects a {want} tensor, got {v.dtype}; `.view()` it if reinterpreting")
        if not v.is_contiguous():
            shape = tuple(v.shape)
            raise ValueError(f"{p.label(i)} got a non-contiguous tensor of shape {shape}; call `.contiguous()`")
        return np.uint64(v.data_ptr()), v
    if _is_int(v):
        if not 0 <= int(v) < 2**64:
            raise ValueError(f"{p.label(i)}: address {int(v)} is not a 64-bit pointer")
        return np.uint64(int(v)), None
    raise TypeError(f"{p.label(i)} expects a torch.Tensor, an int address or None, got {type(v).__name__}")


def pack_args(signature: str | Sequence[str] | Sequence[Param], values: Sequence[Any]) -> PackedArgs:
    """Check `values` against the kernel's C parameters and convert each to its exact C size."""
    if isinstance(signature, str):
        params = parse_params(signature)
    else:
        params = tuple(p if isinstance(p, Param) else parse_param(p) for p in signature)
    if len(values) != len(params):
        raise ValueError(f"kernel takes {len(params)} arguments ({', '.join(p.ctype for p in params)}), "
                         f"got {len(values)}")
    packed: list[np.generic] = []
    tensors: list[torch.Tensor] = []
    for i, (p, v) in enumerate(zip(params, values)):
        if p.pointee is None:
            packed.append(_pack_scalar(p, i, v))
        else:
            ptr, t = _pack_pointer(p, i, v)
            packed.append(ptr)
            tensors += [t] if t is not None else []
    return PackedArgs(params, tuple(packed), tuple(tensors))


# ---------------------------------------------------------------- grid math


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for integers a >= 0, b > 0, without floats."""
    if not (_is_int(a) and _is_int(b)) or a < 0 or b <= 0:
        raise ValueError(f"ceil_div needs integers a >= 0 and b > 0, got a={a!r}, b={b!r}")
    return -(-int(a) // int(b))


def grid_for(n_items: int, block: int = 256, *, items_per_thread: int = 1) -> int:
    """Blocks of `block` threads covering `n_items` items, `items_per_thread` each (0 items -> 0: skip the launch)."""
    if not _is_int(block) or not 1 <= block <= 1024:
        raise ValueError(f"block must be an int in [1, 1024] threads, got {block!r}")
    blocks = ceil_div(ceil_div(n_items, items_per_thread), block)
    if blocks > _MAX_GRID_X:
        raise ValueError(f"{n_items} items need {blocks} blocks, over the gridDim.x limit {_MAX_GRID_X}; "
                         "raise `block` or `items_per_thread`")
    return blocks


# ---------------------------------------------------------------- GPU only


def launch(kernel, grid: int | tuple[int, ...], block: int | tuple[int, ...], args: PackedArgs, *,
           shmem: int = 0) -> None:
    """GPU ONLY (not testable without one): launch `kernel` (from `load_module(...).get_kernel(name)`) on torch's
    current CUDA stream, so it orders with the surrounding torch ops."""
    from .build import cuda_core

    cc = cuda_core()
    for t in args.tensors:
        if not t.is_cuda:
            raise ValueError(f"kernel arguments must be CUDA tensors, got one on `{t.device}`; move it with `.cuda()`")
    stream = cc.Stream.from_handle(torch.cuda.current_stream().cuda_stream)
    cc.launch(stream, cc.LaunchConfig(grid=grid, block=block, shmem_size=shmem), kernel, *args.values)
