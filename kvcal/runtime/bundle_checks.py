"""The bundle's schema tables and validation: every check `load_bundle` and `save_bundle` run, each returning short
problem phrases (never raising), so the caller reports them once (`bundle.py`).

The tables say what a bundle may hold: `REQUIRED_TENSORS` and `OPTIONAL_TENSORS` (name -> shape in symbols, dtype;
symbols: L layers, H KV heads, d head dim), the value ranges of the optional tensors, and the hashes that make an
edited or corrupted file fail (`content_hash`, `metadata.sha256`).
"""

from __future__ import annotations

import hashlib
import json

import torch

from kvcal.runtime.storage.levels import LEVEL_BITS, SIDES, tensor_name
from kvcal.runtime.storage.quant import levels_problems

ORTHONORMAL_TOL = 1e-4   # max |R^T R - I| accepted on load (float32 storage of a float64 eigendecomposition)
METADATA_HASH = "metadata.sha256"
_HEADER_DTYPES = {"F32": torch.float32, "I32": torch.int32}   # the only dtypes a bundle tensor has
_RANGES = {   # name -> (low, high, extra allowed value): values whose meaning has a range
    "k.absmax": (0.0, float("inf"), None),
    "v.absmax": (0.0, float("inf"), None),
    "fastgen.recovery": (0.0, 1.0 + 1e-4, -1.0),        # fraction of attention retained; -1 = not profiled
    "fastgen.kept_fraction": (0.0, 1.0 + 1e-4, -1.0),   # fraction of tokens kept; -1 = not profiled
    "k.range_low": (-65504.0, 65504.0, None),           # the fp16 range of the scales and zeros made from them
    "k.range_high": (-65504.0, 65504.0, None),
    "qk.smoothing": (1e-6, 1e6, None),                  # a positive factor; a smaller one would overflow fp16 keys
}

# name -> (shape in symbols, dtype). Symbols: L layers, H KV heads, d head dim.
REQUIRED_TENSORS: dict[str, tuple[tuple[str, ...], torch.dtype]] = {
    "qk.rotation": (("L", "H", "d", "d"), torch.float32),
    "qk.spectrum": (("L", "H", "d"), torch.float32),
    "qk.rank": (("L", "H"), torch.int32),
    "v.basis": (("L", "H", "d", "d"), torch.float32),
    "v.spectrum": (("L", "H", "d"), torch.float32),
    "v.rank": (("L", "H"), torch.int32),
}
OPTIONAL_TENSORS: dict[str, tuple[tuple[str, ...], torch.dtype]] = {
    # largest |K| (post-RoPE) and |V| element per (layer, KV head) on calibration text: FP8 scales for `kvcal export`
    "k.absmax": (("L", "H"), torch.float32),
    "v.absmax": (("L", "H"), torch.float32),
    # FastGen on calibration text, per compressed pattern (special, +punct, +frequent, +local): retained attention
    # and kept fraction of tokens; -1 where a layer is not profiled (sliding-window layers)
    "fastgen.recovery": (("L", "H", "4"), torch.float32),
    "fastgen.kept_fraction": (("L", "H", "4"), torch.float32),
    # static key tiers: per-channel clip range of K @ qk.rotation on calibration text (schema 2)
    "k.range_low": (("L", "H", "d"), torch.float32),
    "k.range_high": (("L", "H", "d"), torch.float32),
    # channel smoothing: keys / D and queries * D per column of qk.rotation (schema 2)
    "qk.smoothing": (("L", "H", "d"), torch.float32),
    # calibrated levels of the `n` formats per (layer, KV head), side and bits: sorted in [0, 2**b - 1], endpoints
    # pinned (schema 3; kvcal.runtime.storage.levels)
    **{tensor_name(side, bits): (("L", "H", str(1 << bits)), torch.float32) for side in SIDES for bits in LEVEL_BITS},
}
KEY_RANGES = ("k.range_low", "k.range_high")
SCHEMA_2_TENSORS = (*KEY_RANGES, "qk.smoothing")      # a bundle holding any of these is written as schema 2 (or 3)
LEVEL_TENSORS = tuple(tensor_name(side, bits) for side in SIDES for bits in LEVEL_BITS)
SCHEMA_3_TENSORS = LEVEL_TENSORS                      # a bundle holding any of these is written as schema 3


def content_hash(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _metadata_hash(meta: dict[str, str]) -> str:
    """sha256 of every metadata entry but itself; `tensors.sha256` is one of them, so it covers the tensors too."""
    blob = json.dumps({k: v for k, v in meta.items() if k != METADATA_HASH}, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _short(value, limit: int = 40) -> str:
    """A metadata value for an error message: repr'd (control characters escaped), at most `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


# ---------------------------------------------------------------------------------------------- validation

_MODEL_STR = ("name", "fingerprint", "weights_hash", "tokenizer_hash", "family")
_MODEL_INT = ("num_layers", "num_kv_heads", "num_q_heads", "head_dim")
_MAX_DIM = 1 << 16      # no real model has more layers, heads or head dims; bigger is a forged or garbled header


def _validate_metadata(meta: dict[str, str]) -> list[str]:
    """Every problem with the metadata alone (types, JSON, hash), as short phrases; nothing here reads tensor data."""
    problems: list[str] = []
    for key in ("model", "qk.source", "qk.weighting", "v.source", "tensors.sha256"):
        if key not in meta:
            problems.append(f"metadata `{key}` missing")
    if problems:
        return problems
    if METADATA_HASH in meta and meta[METADATA_HASH] != _metadata_hash(meta):
        return ["metadata does not match `metadata.sha256` (the file was edited or corrupted)"]
    blocks = {}
    for key in ("model", "calibration", "policy"):
        if key not in meta:
            continue
        try:
            blocks[key] = json.loads(meta[key])
        except ValueError as e:
            problems.append(f"metadata `{key}` is not valid JSON ({e})")
            continue
        if not isinstance(blocks[key], dict):
            problems.append(f"metadata `{key}` is a JSON {type(blocks[key]).__name__}, expected an object")
    if problems:
        return problems
    model = blocks["model"]
    want = set(_MODEL_STR) | set(_MODEL_INT) | {"layer_types"}
    if set(model) != want:
        extra, missing = sorted(set(model) - want), sorted(want - set(model))
        return [f"metadata `model` {'lacks `' + missing[0] + '`' if missing else 'has unknown key `' + extra[0] + '`'}"]
    problems += [f"metadata `model.{k}` is not a string" for k in _MODEL_STR if not isinstance(model[k], str)]
    for k in _MODEL_INT:
        v = model[k]
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= _MAX_DIM:
            problems.append(f"metadata `model.{k}` = {_short(v)} is not an integer in [1, {_MAX_DIM}]")
    lt = model["layer_types"]
    if not isinstance(lt, list) or not all(isinstance(t, str) for t in lt):
        problems.append("metadata `model.layer_types` is not a list of strings")
    elif not problems and len(lt) != model["num_layers"]:
        problems.append(f"metadata `model.layer_types` has {len(lt)} entries for {model['num_layers']} layers")
    if not problems and model["num_q_heads"] % model["num_kv_heads"]:
        problems.append(f"metadata `model`: {model['num_q_heads']} query heads are not a multiple of "
                        f"{model['num_kv_heads']} KV heads")
    for key in ("qk.source", "qk.weighting", "v.source"):
        if not meta[key].isprintable():
            problems.append(f"metadata `{key}` has control characters")
    if not problems and blocks.get("policy"):
        from kvcal.runtime.config import CompressionConfig

        try:
            CompressionConfig.from_dict(blocks["policy"])
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            problems.append(f"metadata `policy` is not a settings block the runtime reads ({reason})")
    return problems


def _dims(meta: dict[str, str]) -> dict[str, int]:
    model = json.loads(meta["model"])
    return {"L": model["num_layers"], "H": model["num_kv_heads"], "d": model["head_dim"]}


def _validate_header(header: dict[str, tuple[tuple[int, ...], str]], dims: dict[str, int]) -> list[str]:
    """Tensor names, shapes and dtypes against the metadata's dims, from the safetensors header (no data read).
    header: name -> (shape, safetensors dtype string such as "F32")."""
    problems: list[str] = []
    schema = {**REQUIRED_TENSORS, **OPTIONAL_TENSORS}
    for name in sorted(set(header) - set(schema)):
        problems.append(f"unknown tensor `{_short(name)}`")
    for name, (symbols, dtype) in schema.items():
        if name not in header:
            if name in REQUIRED_TENSORS:
                problems.append(f"tensor `{name}` missing")
            continue
        shape, st_dtype = header[name]
        want = tuple(dims[s] if s in dims else int(s) for s in symbols)
        if tuple(shape) != want:
            problems.append(f"tensor `{name}` has shape {list(shape)}, expected {list(want)} [{', '.join(symbols)}]")
        elif _HEADER_DTYPES.get(st_dtype) != dtype:
            problems.append(f"tensor `{name}` has dtype {st_dtype}, expected {dtype}")
    return problems


def _validate_versioned(names: set[str], meta: dict[str, str]) -> list[str]:
    """Tensors that come in sets, and the schema version they need."""
    problems = []
    present = [n for n in KEY_RANGES if n in names]
    if len(present) == 1:
        missing = next(n for n in KEY_RANGES if n not in names)
        problems.append(f"tensor `{present[0]}` without `{missing}` (static key ranges come as a pair)")
    if any(n in names for n in SCHEMA_2_TENSORS) and meta.get("schema_version") == "1":
        problems.append("schema version 1 cannot hold static key ranges or smoothing (`k.range_low/high`, "
                        "`qk.smoothing`)")
    if any(n in names for n in SCHEMA_3_TENSORS) and meta.get("schema_version") in ("1", "2"):
        problems.append(f"schema version {meta['schema_version']} cannot hold calibrated levels (`levels.k.*`, "
                        "`levels.v.*`)")
    return problems


def _validate_tensor(name: str, t: torch.Tensor) -> list[str]:
    """Checks of one tensor that need its values: finite, inside its range, bases orthonormal, ranks in [1, d].
    Large tensors are checked one layer at a time, so memory stays near the tensor's own size."""
    problems: list[str] = []
    if t.is_floating_point():
        bad = any(not torch.isfinite(layer).all() for layer in t)
        if bad:
            return [f"tensor `{name}` has non-finite values"]
    if name in _RANGES:
        low, high, extra = _RANGES[name]
        outside = (t < low) | (t > high)
        if extra is not None:
            outside &= t != extra
        if outside.any():
            bad_value = t[outside][0].item()
            allowed = f"[{low:g}, {high:g}]" + (f" or {extra:g}" if extra is not None else "")
            problems.append(f"tensor `{name}` has a value outside {allowed} ({bad_value:g})")
    if name in ("qk.rotation", "v.basis"):
        d = t.shape[-1]
        eye = torch.eye(d, dtype=torch.float64)
        err = max(((layer.double().transpose(-1, -2) @ layer.double() - eye).abs().amax().item() for layer in t),
                  default=0.0)
        if err > ORTHONORMAL_TOL:
            prefix = name.split(".")[0]
            problems.append(f"`{prefix}` basis is not orthonormal (max |R^T R - I| = {err:.2e} > {ORTHONORMAL_TOL})")
    if name in LEVEL_TENSORS:
        problems += [f"tensor `{name}` {p}" for p in levels_problems(t, int(name.rsplit(".", 1)[1]))]
    if name in ("qk.spectrum", "v.spectrum"):
        if (t < 0).any() or (t[..., 1:] > t[..., :-1] * (1 + 1e-5) + 1e-12).any():
            problems.append(f"tensor `{name}` is not non-negative and descending")
    return problems


def _validate_contents(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> list[str]:
    """Checks across tensors: ranks within the head dim, and the content hash."""
    problems: list[str] = []
    d = _dims(meta)["d"]
    for name in ("qk.rank", "v.rank"):
        rank = tensors[name]
        if rank.numel() and (rank.min() < 1 or rank.max() > d):
            problems.append(f"tensor `{name}` outside [1, {d}] (min {rank.min().item()}, max {rank.max().item()})")
    if all(n in tensors for n in KEY_RANGES) and bool((tensors["k.range_low"] > tensors["k.range_high"]).any()):
        problems.append("tensor `k.range_low` exceeds `k.range_high` somewhere (a clip range must have low <= high)")
    if meta["tensors.sha256"] != content_hash(tensors):
        problems.append("tensor bytes do not match `tensors.sha256` (file corrupted)")
    return problems


def _validate(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> list[str]:
    """Every problem with a bundle's tensors and metadata, as short phrases; empty when valid (used before writing)."""
    problems = _validate_metadata(meta)
    if problems:
        return problems
    header = {k: (tuple(t.shape), {v: k2 for k2, v in _HEADER_DTYPES.items()}.get(t.dtype, str(t.dtype)))
              for k, t in tensors.items()}
    problems = _validate_header(header, _dims(meta)) + _validate_versioned(set(header), meta)
    if problems:
        return problems
    for name, t in tensors.items():
        problems += _validate_tensor(name, t)
    return problems or _validate_contents(tensors, meta)
