"""Loading models and describing their architecture (see `adapters` and `sources`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from kvcal.models.adapters import (
    FAMILIES,
    ModelAdapter,
    UnsupportedModelError,
    adapter_for,
    fingerprint,
    tokenizer_hash,
    weights_hash,
)
from kvcal.models.sources import DEFAULT_MODEL, PACKAGED_MODELS, ModelSource, resolve_model

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    adapter: ModelAdapter
    source: ModelSource
    load_seconds: float

    @property
    def name(self) -> str:
        return self.source.name


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    dtype: str = "bfloat16",
    device_map: str | None = None,
    max_memory: dict | None = None,
) -> LoadedModel:
    """Load a packaged model, a .gguf file or a Hugging Face folder, in eval mode, with its adapter.

    `device_map` / `max_memory` pass through to transformers/accelerate (layer offloading for models larger than
    memory). The architecture is checked before the weights are read, so an unsupported model fails in a second.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"`--dtype {dtype}` is not supported; use one of {', '.join(DTYPES)}")
    t0 = time.perf_counter()
    source = resolve_model(spec)
    adapter = adapter_for(AutoConfig.from_pretrained(source.folder))
    kwargs = {"dtype": DTYPES[dtype]}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    if device_map is not None:
        # layers that fit nowhere in `max_memory` go to disk (accelerate streams them in per forward)
        from kvcal.models.sources import cache_dir

        kwargs["offload_folder"] = str(cache_dir() / "offload" / source.name)
    model = AutoModelForCausalLM.from_pretrained(source.folder, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.folder)
    return LoadedModel(model, tokenizer, adapter, source, time.perf_counter() - t0)


__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "FAMILIES",
    "PACKAGED_MODELS",
    "LoadedModel",
    "ModelAdapter",
    "ModelSource",
    "UnsupportedModelError",
    "adapter_for",
    "fingerprint",
    "load_model",
    "resolve_model",
    "tokenizer_hash",
    "weights_hash",
]
