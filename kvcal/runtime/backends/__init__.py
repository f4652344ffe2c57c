"""Attention backends: the interface (`base`), the torch reference (`reference`), the fused CPU kernels (`cpu/`),
the cuda-python kernels (`cuda/`), and the registry that picks one (`registry.select_backend`)."""

from kvcal.runtime.backends.base import AttentionBackend, prompt_probs
from kvcal.runtime.backends.reference import TorchBackend
from kvcal.runtime.backends.registry import BACKENDS, select_backend

__all__ = ["AttentionBackend", "BACKENDS", "TorchBackend", "prompt_probs", "select_backend"]
