"""Loading models (`sources`) and describing their architecture (`kvcal.runtime.adapters`, re-exported here)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from kvcal.models.sources import DEFAULT_MODEL, PACKAGED_MODELS, ModelSource, resolve_model
from kvcal.runtime.adapters import (
    FAMILIES,
    ModelAdapter,
    UnsupportedModelError,
    adapter_for,
    fingerprint,
    tokenizer_hash,
    weights_hash,
)
from kvcal.runtime.disk_cache import cache_dir

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")     # x86 CPU flags of bf16 arithmetic in hardware


def resolve_dtype(dtype: str) -> str:
    """"auto" -> "bfloat16" on a GPU or a CPU with bf16 arithmetic in hardware, else "float32": without it torch
    emulates bf16 matmuls, several times slower than float32 (docs/calibration.md); other names pass through."""
    if dtype != "auto":
        return dtype
    if torch.cuda.is_available():
        return "bfloat16"
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")),
                     [])
    except OSError:
        flags = []
    return "bfloat16" if any(f in flags for f in NATIVE_BF16_FLAGS) else "float32"


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
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"`--dtype {dtype}` is not supported; use one of {', '.join(DTYPES)} or auto")
    t0 = time.perf_counter()
    source = resolve_model(spec)
    adapter = adapter_for(read_config(source.folder))
    check_weight_files(source.folder)
    kwargs = {"dtype": DTYPES[dtype], "local_files_only": True}   # a local folder: never ask the Hub
    if device_map is not None:
        kwargs["device_map"] = device_map
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    if device_map is not None:
        # layers that fit nowhere in `max_memory` go to disk (accelerate streams them in per forward)
        kwargs["offload_folder"] = str(cache_dir() / "offload" / source.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(source.folder, **kwargs).eval()
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ValueError(f"cannot load the weights in `{source.folder}` ({_first_line(e)}); check that the folder's "
                         "safetensors files are complete (re-copy or re-convert the model)") from None
    tokenizer = load_tokenizer(source.folder)
    return LoadedModel(model, tokenizer, adapter, source, time.perf_counter() - t0)


def load_tokenizer(folder):
    """The folder's tokenizer, or a one-line ValueError naming the folder (loading it takes well under a second)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load the tokenizer in `{folder}` ({_first_line(e)}); the folder needs the "
                         "model's tokenizer files (tokenizer.json or tokenizer_config.json)") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def read_config(folder) -> object:
    """The folder's transformers config, or a one-line ValueError naming the folder when config.json is unreadable."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read `{folder}/config.json` ({_first_line(e)}); pass a Hugging Face model folder "
                         "with a valid config.json") from None


def check_weight_files(folder) -> None:
    """Refuse, before loading anything, a folder whose weights kvcal will not read: pickle checkpoints (`.bin`,
    `.pt`: loading them can run code) or safetensors files whose header does not fit the file (truncated copies)."""
    from pathlib import Path

    from kvcal.runtime.files import safetensors_header

    folder = Path(folder)
    st = sorted(folder.glob("*.safetensors"))
    if not st:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickles:
            raise ValueError(f"`{folder}` has only pickle weights (`{pickles[0]}`), which kvcal does not load (they "
                             "can run code); convert them to safetensors, e.g. `model.save_pretrained(folder)`")
        raise ValueError(f"`{folder}` has no .safetensors weights; pass a Hugging Face folder saved with "
                         "`save_pretrained`")
    for path in st:
        found = safetensors_header(path)
        try:
            n, header = found
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (TypeError, KeyError, IndexError, AttributeError):
            found, n, end = None, 0, 0
        if found is None or 8 + n + end > path.stat().st_size:
            raise ValueError(f"weights file `{path}` is truncated or not safetensors; re-copy or re-convert the "
                             "model")


__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "resolve_dtype",
    "FAMILIES",
    "PACKAGED_MODELS",
    "LoadedModel",
    "ModelAdapter",
    "ModelSource",
    "UnsupportedModelError",
    "adapter_for",
    "check_weight_files",
    "fingerprint",
    "load_model",
    "load_tokenizer",
    "read_config",
    "resolve_model",
    "tokenizer_hash",
    "weights_hash",
]
