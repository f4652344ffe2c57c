"""The kvcal bundle: one safetensors file with everything the runtime needs to compress one model's KV cache.

Tensors (L layers, H KV heads, d head dim):

    qk.rotation  [L, H, d, d] float32  post-RoPE rotation R; columns orthonormal, by descending spectrum
    qk.spectrum  [L, H, d]    float32  singular values of the (weighted) stacked post-RoPE Q/K rows, descending
    qk.rank      [L, H]       int32    K is cached as K @ R[:, :rank]
    v.basis      [L, H, d, d] float32  V basis B; columns orthonormal, by descending spectrum
    v.spectrum   [L, H, d]    float32
    v.rank       [L, H]       int32    V is cached as V @ B[:, :rank]
    k.absmax     [L, H]       float32  optional: max |K| (post-RoPE) per head on calibration text
    v.absmax     [L, H]       float32  optional: max |V| per head on calibration text
    fastgen.recovery, fastgen.kept_fraction  [L, H, 4] float32  optional: FastGen pattern statistics (-1: not profiled)
    k.range_low, k.range_high  [L, H, d] float32  optional (schema 2): per-channel clip range of K @ qk.rotation
                                       (post-RoPE, columns of R, no mixing) at `calibration.key_ranges.percentile`,
                                       for the static key tiers (`K4sV4`; kvcal.profile.key_ranges). Both or neither.
    qk.smoothing [L, H, d]    float32  optional (schema 2): channel smoothing factor D > 0 per column of qk.rotation
                                       (keys stored / D, queries * D; kvcal.profile.smoothing), for `smooth` settings

Schema versions: 1 (the tensors above but the key ranges and smoothing), 2 (with either). A bundle is written with the
lowest version that describes it, so a bundle without them stays readable by kvcal versions that read only 1; this kvcal
reads both.

`__metadata__` holds strings (JSON where structured): `format`, `schema_version`, `model` (name, fingerprint, weights
and tokenizer hashes, shape), `qk.source`, `qk.weighting`, `v.source`, `calibration` (provenance and results),
`policy` (the runtime settings, read into `Bundle.settings`; the key keeps its v1 name), `tensors.sha256` (content
hash, so a corrupted file is refused), `metadata.sha256` (hash of every other metadata entry, `tensors.sha256`
included, so an edited settings, calibration or model block is refused too; bundles written before it existed have
only `tensors.sha256` and still load), `kvcal.version`, `created`.

`save_bundle` writes atomically (temporary file, fsync, rename); `load_bundle` validates everything first and raises a
single one-line `BundleError` naming the problem and the fix. It checks the header (metadata, tensor names, shapes,
dtypes, and the model's shape when given) before reading any tensor data, then reads and checks one tensor at a time.

The format belongs to the runtime that serves it: this module imports torch, safetensors (on use) and the runtime's
own `files`, `version` and `config`, nothing above them (`kvcal.profile` fills a `Bundle` and saves it here).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcal.runtime.files import safetensors_header, write_file
from kvcal.runtime.version import __version__

FORMAT = "kvcal-bundle"
SCHEMA_VERSION = 2                  # the newest version this kvcal writes
READABLE_VERSIONS = (1, 2)
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
}
KEY_RANGES = ("k.range_low", "k.range_high")
SCHEMA_2_TENSORS = (*KEY_RANGES, "qk.smoothing")      # a bundle holding any of these is written as schema 2
_FIELDS = {name: name.replace(".", "_") for name in REQUIRED_TENSORS}


class BundleError(ValueError):
    """A bundle file that cannot be used: missing, unreadable, wrong format or schema, or failing validation."""


class BundleMismatchError(BundleError):
    """A valid bundle calibrated for a different model."""


@dataclass
class ModelInfo:
    name: str
    fingerprint: str          # hash of the config's architecture fields (kvcal.models.fingerprint)
    weights_hash: str         # hash of a few projection weights (kvcal.models.weights_hash)
    tokenizer_hash: str
    family: str
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    layer_types: list[str]


@dataclass
class Bundle:
    model: ModelInfo
    qk_rotation: torch.Tensor        # [L, H, d, d] float32
    qk_spectrum: torch.Tensor        # [L, H, d] float32
    qk_rank: torch.Tensor            # [L, H] int32
    v_basis: torch.Tensor            # [L, H, d, d] float32
    v_spectrum: torch.Tensor         # [L, H, d] float32
    v_rank: torch.Tensor             # [L, H] int32
    qk_source: str                   # which pass R came from: "random-tokens", "text" or "both"
    qk_weighting: str                # how Q and K rows were weighted in the Gram (kvcal.profile.rotation)
    v_source: str                    # "activations-text", "activations-random" or "weight-svd"
    calibration: dict[str, Any] = field(default_factory=dict)   # provenance and measured results (JSON)
    settings: dict[str, Any] = field(default_factory=dict)      # metadata `policy`: CompressionConfig.to_dict() (JSON)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # OPTIONAL_TENSORS by name
    kvcal_version: str = ""
    created: str = ""                # when the file was written (UTC, ISO 8601); set by save_bundle

    @property
    def shape(self) -> tuple[int, int, int]:
        """(L, H, d)"""
        return self.model.num_layers, self.model.num_kv_heads, self.model.head_dim

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {name: getattr(self, attr) for name, attr in _FIELDS.items()}
        out.update(self.extras)
        return out

    def check_model(self, fingerprint: str, weights_hash: str | None = None, name: str | None = None, *,
                    shape: tuple[int, int, int] | None = None) -> None:
        """Refuse this bundle for a model with another architecture (`BundleMismatchError`).

        shape: the model's actual (layers, KV heads, head dim); compared with the bundle's tensors, so a bundle whose
        fingerprint was edited to match is still refused. Different weights with the same architecture (a fine-tune)
        only warn: the statistics may be off, but nothing breaks.
        """
        if shape is not None and tuple(shape) != self.shape:
            raise BundleMismatchError(
                f"bundle was calibrated for `{self.model.name}` with (layers, KV heads, head dim) = {self.shape} but "
                f"the model {'`' + name + '` ' if name else ''}has {tuple(shape)}; calibrate this model with "
                "`kvcal calibrate --model ...`")
        if fingerprint != self.model.fingerprint:
            raise BundleMismatchError(
                f"bundle was calibrated for `{self.model.name}` (fingerprint {self.model.fingerprint}) but the model "
                f"{'`' + name + '` ' if name else ''}has fingerprint {fingerprint}; calibrate this model with "
                "`kvcal calibrate --model ...`"
            )
        if weights_hash is not None and weights_hash != self.model.weights_hash:
            import logging

            logging.getLogger(__name__).warning(
                "bundle weights hash %s differs from the model's %s (same architecture, other weights): "
                "recalibrate for best quality", self.model.weights_hash, weights_hash)


# ---------------------------------------------------------------------------------------------- save


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


def _metadata(bundle: Bundle, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    meta = {
        "format": FORMAT,
        "schema_version": str(2 if any(name in tensors for name in SCHEMA_2_TENSORS) else 1),
        "kvcal.version": bundle.kvcal_version or _kvcal_version(),
        "created": bundle.created or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "model": json.dumps(bundle.model.__dict__),
        "qk.source": bundle.qk_source,
        "qk.weighting": bundle.qk_weighting,
        "v.source": bundle.v_source,
        "calibration": json.dumps(bundle.calibration, default=_json_default),
        "policy": json.dumps(bundle.settings, default=_json_default),
        "tensors.sha256": content_hash(tensors),
    }
    meta[METADATA_HASH] = _metadata_hash(meta)
    return meta


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _kvcal_version() -> str:
    return __version__


def is_kvcal_bundle(path: str | os.PathLike) -> bool:
    """True when `path` is a safetensors file whose metadata says `format = kvcal-bundle` (reads the header only)."""
    found = safetensors_header(path)
    meta = found[1].get("__metadata__") if found else None
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def save_bundle(bundle: Bundle, path: str | Path, *, overwrite: bool = True) -> Path:
    """Validate and write `bundle` to `path` atomically (`kvcal.runtime.files.write_file`): a reader sees the old file
    or the whole new one, and an interrupted write leaves nothing at `path`. Only a kvcal bundle is ever replaced,
    and only with `overwrite`; without it, a bundle that appears at `path` meanwhile is kept (`FileExistsError`)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors, seen = {}, set()
    for k, v in bundle.tensors().items():
        t = v.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[k] = t.clone() if ptr in seen else t      # safetensors refuses tensors that share memory
        seen.add(ptr)
    bundle.created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    meta = _metadata(bundle, tensors)
    problems = _validate(tensors, meta)
    if problems:
        raise BundleError(f"refusing to write an invalid bundle: {_summarise(problems)}")
    if not path.is_symlink() and (path.is_dir() or (path.exists() and not is_kvcal_bundle(path))):
        raise BundleError(f"`{path}` exists and is not a kvcal bundle; refusing to overwrite it (choose another path)")
    return write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), overwrite=overwrite)


# ---------------------------------------------------------------------------------------------- load


def load_bundle(path: str | Path, *, fingerprint: str | None = None, weights_hash: str | None = None,
                shape: tuple[int, int, int] | None = None) -> Bundle:
    """Read and validate a bundle. With `fingerprint` (and `shape`, the model's (layers, KV heads, head dim)), also
    refuse a bundle made for another model; the shape is compared before any tensor is read."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise BundleError(f"`{path}` is a folder, not a bundle file; pass the bundle's file path (`kvcal calibrate "
                          f"--out {path / 'model.kvcal.safetensors'}` writes one there)")
    if not path.is_file():
        raise BundleError(f"no bundle at `{path}`; create one with `kvcal calibrate --out {path}`")
    _check_container(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            header = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
            if meta.get("format") != FORMAT:
                raise BundleError(f"`{path}` is a safetensors file but not a kvcal bundle (format="
                                  f"{_short(meta.get('format'))}); pass a file written by `kvcal calibrate`")
            version = meta.get("schema_version", "?")
            if version not in [str(v) for v in READABLE_VERSIONS]:
                newer = version.isdigit() and int(version) > SCHEMA_VERSION
                fix = "upgrade kvcal" if newer else "recalibrate with this kvcal (`kvcal calibrate`)"
                raise BundleError(f"`{path}` has bundle schema version {_short(version)}, this kvcal reads versions "
                                  f"{', '.join(map(str, READABLE_VERSIONS))}; {fix}")
            problems = _validate_metadata(meta)
            if not problems:
                problems = _validate_header(header, _dims(meta)) + _validate_versioned(set(header), meta)
            if problems:
                raise BundleError(f"`{path}` failed validation: {_summarise(problems)}; recalibrate with "
                                  "`kvcal calibrate`")
            model = ModelInfo(**json.loads(meta["model"]))
            got = (model.num_layers, model.num_kv_heads, model.head_dim)
            if shape is not None and tuple(shape) != got:
                raise BundleMismatchError(
                    f"bundle `{path}` was calibrated for `{model.name}` with (layers, KV heads, head dim) = {got} "
                    f"but the model has {tuple(shape)}; calibrate this model with `kvcal calibrate --model ...`")
            tensors = {}
            for k in header:            # one at a time, each checked as it is read
                tensors[k] = f.get_tensor(k)
                problems += _validate_tensor(k, tensors[k])
                if problems:            # a bad file is refused without reading the rest
                    break
    except BundleError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BundleError(f"`{path}` is not a readable safetensors file (truncated or corrupted: {reason}); "
                          "recalibrate with `kvcal calibrate`") from None
    if not problems:
        problems = _validate_contents(tensors, meta)
    if problems:
        raise BundleError(f"`{path}` failed validation: {_summarise(problems)}; recalibrate with `kvcal calibrate`")
    bundle = _from_parts(tensors, meta)
    if fingerprint is not None:
        bundle.check_model(fingerprint, weights_hash, shape=shape)
    return bundle


def _short(value, limit: int = 40) -> str:
    """A metadata value for an error message: repr'd (control characters escaped), at most `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _check_container(path: Path) -> None:
    """Refuse a file that is not safetensors at all (a README, an image) with that name, before safetensors parses it:
    8-byte little-endian header length, then a JSON object."""
    import struct

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
    n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else 0
    if len(head) < 9 or head[8:9] != b"{" or n > 100 << 20:
        raise BundleError(f"`{path}` is not a kvcal bundle (not a safetensors file); pass a bundle written by "
                          "`kvcal calibrate`")
    if n + 8 > size:
        raise BundleError(f"`{path}` is not a readable safetensors file (truncated: its header says {n} bytes, the "
                          f"file has {size}); recalibrate with `kvcal calibrate`")


def _from_parts(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Bundle:
    fields = {attr: tensors[name] for name, attr in _FIELDS.items()}
    return Bundle(
        model=ModelInfo(**json.loads(meta["model"])),
        qk_source=meta["qk.source"],
        qk_weighting=meta["qk.weighting"],
        v_source=meta["v.source"],
        calibration=json.loads(meta.get("calibration", "{}")),
        settings=json.loads(meta.get("policy", "{}")),
        extras={k: v for k, v in tensors.items() if k in OPTIONAL_TENSORS},
        kvcal_version=meta.get("kvcal.version", ""),
        created=meta.get("created", ""),
        **fields,
    )


def _summarise(problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


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
