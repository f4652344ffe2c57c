"""Attention backend registry and selector: `BACKENDS` (name -> dotted class path) and `select_backend`."""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from kvcal.runtime.backends.base import AttentionBackend

logger = logging.getLogger(__name__)

# name -> "module:Class"; resolved lazily so the cuda backend's imports happen only when it is asked for
BACKENDS = {
    "torch": "kvcal.runtime.backends.reference:TorchBackend",
    "cuda": "kvcal.runtime.backends.cuda.backend:CudaBackend",
    "cpu": "kvcal.runtime.backends.cpu.backend:CpuBackend",
}


def _load(name: str) -> type[AttentionBackend]:
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


@functools.cache
def select_backend(name: str = "auto", device: str = "cpu", formats: tuple = (),
                   head_dim: int = 0) -> type[AttentionBackend]:
    """The backend to use: `auto` takes cuda when it can run on `device` and serve `formats` (the tiers' TierFormat,
    ranks up to `head_dim`), else the fused cpu kernels, else torch (logged once, with the reasons)."""
    dev = torch.device(device)
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend `{name}`; choose one of auto, {', '.join(BACKENDS)}")
        try:
            backend = _load(name)
        except ImportError as e:
            raise ValueError(f"attention backend `{name}` is unavailable: {e}") from None
        reasons = backend.supports(dev) + backend.supports_formats(formats, head_dim)
        if reasons:
            raise ValueError(f"attention backend `{name}` cannot run on {dev}: {'; '.join(reasons)}")
        return backend
    rejected = []
    for candidate in ("cuda", "cpu", "torch"):
        try:
            backend = _load(candidate)
        except ImportError as e:
            rejected.append(f"{candidate}: {e}")
            continue
        reasons = backend.supports(dev) + backend.supports_formats(formats, head_dim)
        if not reasons:
            if rejected:
                logger.info("kvcal attention backend: %s (%s)", candidate, "; ".join(rejected))
            return backend
        rejected.append(f"{candidate}: {'; '.join(reasons)}")
    raise ValueError(f"no attention backend can run on {dev}: {'; '.join(rejected)}")
