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
    levels.k.{b}, levels.v.{b}  [L, H, 2**b] float32  optional (schema 3), b in 2, 3, 4, 8: calibrated levels of the
                                       formats with an `n` after that side's bits (`K4cnV2n`): sorted, first 0, last
                                       2**b - 1 (kvcal.runtime.storage.levels)

Schema versions: 1 (the tensors above but the key ranges, smoothing and levels), 2 (with the key ranges or smoothing),
3 (with levels). A bundle is written with the lowest version that describes it, so a bundle without them stays
readable by kvcal versions that read only 1; this kvcal reads all three.

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
own `files`, `version`, `config` and `bundle_checks` (the schema tables and validation), nothing above them
(`kvcal.profile` fills a `Bundle` and saves it here).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcal.runtime.bundle_checks import (  # noqa: F401  (ORTHONORMAL_TOL, KEY_RANGES: re-exported, part of the format)
    KEY_RANGES,
    METADATA_HASH,
    OPTIONAL_TENSORS,
    ORTHONORMAL_TOL,
    REQUIRED_TENSORS,
    SCHEMA_2_TENSORS,
    SCHEMA_3_TENSORS,
    _dims,
    _metadata_hash,
    _short,
    _validate,
    _validate_contents,
    _validate_header,
    _validate_metadata,
    _validate_tensor,
    _validate_versioned,
    content_hash,
)
from kvcal.runtime.files import safetensors_header, write_file
from kvcal.runtime.version import __version__

FORMAT = "kvcal-bundle"
SCHEMA_VERSION = 3                  # the newest version this kvcal writes
READABLE_VERSIONS = (1, 2, 3)
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


def _metadata(bundle: Bundle, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    meta = {
        "format": FORMAT,
        "schema_version": str(_schema_version(tensors)),
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


def _schema_version(tensors: dict[str, torch.Tensor]) -> int:
    """The lowest schema version that describes a bundle holding `tensors`."""
    if any(name in tensors for name in SCHEMA_3_TENSORS):
        return 3
    return 2 if any(name in tensors for name in SCHEMA_2_TENSORS) else 1


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


