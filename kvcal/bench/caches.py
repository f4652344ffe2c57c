"""Baseline KV caches that are not special cases of the kvcal store: dense and transformers' own quantized caches
(the eviction baselines are runtime token policies, see `kvcal.bench.methods`).

Every cache here is a transformers `Cache` and reports memory the way `KvcalCache.memory()` does:

    {"total_bytes": bytes of every tensor the cache holds (K/V and any per-token metadata such as positions or
                    scores), "fp16_bytes": an fp16 dense cache of the same tokens, "ratio_to_fp16": their ratio}

The fp16 reference counts, per full-attention layer, every token seen (B x H x seen x d x 2 tensors x 2 bytes); a
sliding-window layer (Gemma3) counts the tokens it holds, since a dense cache is bounded there too (as KvcalCache).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, QuantizedCache

from kvcal.runtime.hf import SeenLayer, dense_bytes

# --------------------------------------------------------------------------------------------- accounting


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in `obj` (a tensor, a tensor subclass with `__tensor_flatten__` such as quanto's
    QTensor, or tuples / lists / dicts of them)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def memory_dict(total: int, fp16: int) -> dict[str, float]:
    return {"total_bytes": total, "fp16_bytes": fp16, "ratio_to_fp16": total / fp16 if fp16 else float("nan")}


def store_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype a baseline stores K/V in: the model's if it is 16-bit, else fp16 (as the kvcal store's raw tier)."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


class CountingLayer(SeenLayer):
    """Base of the bench's own compressed layers (Palu, KVQuant, TurboQuant): `SeenLayer`, not for beam search."""

    method = "this"                  # the baseline's name, for the error beam search gets

    def reset(self) -> None:
        self.is_initialized = False
        self.seen = 0

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError(f"the bench's {self.method} cache does not support beam search")


class CountingCache(Cache):
    """Base of the bench's own caches over `CountingLayer`s: one batch as prefilled; no expansion, selection, crop."""

    method = "this"                  # the baseline's name, for the errors

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"the bench's {self.method} cache does not support expanding the batch")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError(f"the bench's {self.method} cache does not support selecting batch rows")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(f"the bench's {self.method} cache cannot be cropped")


class DenseCache(DynamicCache):
    """transformers' DynamicCache (model dtype) with `memory()`: the dense baseline, bit-identical to the model,
    counted at 16 bits (`dense_bytes`)."""

    def memory(self) -> dict[str, float]:
        total = fp16 = 0
        for layer in self.layers:
            if layer.is_initialized and layer.keys is not None:
                total += dense_bytes(layer.keys, layer.values)
                fp16 += layer.keys.numel() * 2 * 2
        return memory_dict(total, fp16)


class MeasuredQuantizedCache(QuantizedCache):
    """transformers' own `QuantizedCache` with `memory()`: quanto / hqq (KIVI-like, per-channel groups and a residual
    window of `residual_length` tokens in the model dtype) or fp8 (one per-tensor scale frozen at prefill). Building
    one for a backend whose package is missing raises transformers' ImportError."""

    def memory(self) -> dict[str, float]:
        total = fp16 = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            total += tensor_bytes(getattr(layer, "_quantized_keys", None))
            total += tensor_bytes(getattr(layer, "_quantized_values", None))
            total += dense_bytes(layer.keys, layer.values)                        # residual window (quanto / hqq)
            B, H, d = _dims(layer)
            fp16 += B * H * layer.get_seq_length() * d * 2 * 2
        return memory_dict(total, fp16)


def _dims(layer) -> tuple[int, int, int]:
    """(batch, KV heads, head dim) of a quantized layer, from whichever of its tensors is still 4-D."""
    for t in (layer.keys, getattr(layer, "_quantized_keys", None)):
        # HQQ keeps its codes 2-D and the original shape in its metadata (empty residual right after prefill)
        if isinstance(t, tuple):
            t = t[1].get("shape", ()) if isinstance(t[1], dict) else t[0]                # hqq: (codes, meta)
        shape = tuple(getattr(t, "shape", t) if t is not None else ())
        if len(shape) == 4:
            return shape[0], shape[1], shape[3]
    return 0, 0, 0
