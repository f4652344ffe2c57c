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
    fastgen.recovery, fastgen.kept_fraction  [L, H, 4] float32  optional: FastGen policy statistics (-1: not profiled)

`__metadata__` holds strings (JSON where structured): `format`, `schema_version`, `model` (name, fingerprint, weights
and tokenizer hashes, shape), `qk.source`, `qk.weighting`, `v.source`, `calibration` (provenance and results),
`policy` (runtime settings), `tensors.sha256` (content hash, so a corrupted file is refused), `kvcal.version`,
`created`.

`save_bundle` writes atomically (temporary file, fsync, rename); `load_bundle` validates everything first and raises a
single one-line `BundleError` naming the problem and the fix.
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

FORMAT = "kvcal-bundle"
SCHEMA_VERSION = 1
ORTHONORMAL_TOL = 1e-4   # max |R^T R - I| accepted on load (float32 storage of a float64 eigendecomposition)

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
    # FastGen on calibration text, per compressed policy (special, +punct, +frequent, +local): retained attention
    # and kept fraction of tokens; -1 where a layer is not profiled (sliding-window layers)
    "fastgen.recovery": (("L", "H", "4"), torch.float32),
    "fastgen.kept_fraction": (("L", "H", "4"), torch.float32),
}
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
    policy: dict[str, Any] = field(default_factory=dict)        # runtime settings chosen by calibration (JSON)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # OPTIONAL_TENSORS by name
    kvcal_version: str = ""
    created: str = ""

    @property
    def shape(self) -> tuple[int, int, int]:
        """(L, H, d)"""
        return self.model.num_layers, self.model.num_kv_heads, self.model.head_dim

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {name: getattr(self, attr) for name, attr in _FIELDS.items()}
        out.update(self.extras)
        return out

    def check_model(self, fingerprint: str, weights_hash: str | None = None, name: str | None = None) -> None:
        """Refuse this bundle for a model with another architecture (`BundleMismatchError`).

        Different weights with the same architecture (a fine-tune) only warn: the statistics may be off, but nothing
        breaks.
        """
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


def _metadata(bundle: Bundle, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        "format": FORMAT,
        "schema_version": str(SCHEMA_VERSION),
        "kvcal.version": bundle.kvcal_version or _kvcal_version(),
        "created": bundle.created or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "model": json.dumps(bundle.model.__dict__),
        "qk.source": bundle.qk_source,
        "qk.weighting": bundle.qk_weighting,
        "v.source": bundle.v_source,
        "calibration": json.dumps(bundle.calibration, default=_json_default),
        "policy": json.dumps(bundle.policy, default=_json_default),
        "tensors.sha256": content_hash(tensors),
    }


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _kvcal_version() -> str:
    from kvcal import __version__

    return __version__


def make_shareable(path: str | os.PathLike) -> None:
    """Give a file the permissions the umask allows (safetensors creates 0600; artefacts are meant to be shared)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_bundle(bundle: Bundle, path: str | Path) -> Path:
    """Validate and write `bundle` to `path` atomically: a reader sees the old file or the whole new one, never a
    partial one, and an interrupted write leaves nothing at `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in bundle.tensors().items()}
    meta = _metadata(bundle, tensors)
    problems = _validate(tensors, meta)
    if problems:
        raise BundleError(f"refusing to write an invalid bundle: {_summarise(problems)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        make_shareable(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------------------------------------- load


def load_bundle(path: str | Path, *, fingerprint: str | None = None, weights_hash: str | None = None) -> Bundle:
    """Read and validate a bundle. With `fingerprint`, also refuse a bundle made for another model."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise BundleError(f"no bundle at `{path}`; create one with `kvcal calibrate --out {path}`")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BundleError(f"`{path}` is not a readable safetensors file (truncated or corrupted: {reason}); "
                          "recalibrate with `kvcal calibrate`") from None
    if meta.get("format") != FORMAT:
        raise BundleError(f"`{path}` is a safetensors file but not a kvcal bundle (format={meta.get('format')!r}); "
                          "pass a file written by `kvcal calibrate`")
    version = meta.get("schema_version", "?")
    if version != str(SCHEMA_VERSION):
        newer = version.isdigit() and int(version) > SCHEMA_VERSION
        fix = "upgrade kvcal" if newer else "recalibrate with this kvcal (`kvcal calibrate`)"
        raise BundleError(f"`{path}` has bundle schema version {version}, this kvcal reads version {SCHEMA_VERSION}; "
                          f"{fix}")
    problems = _validate(tensors, meta)
    if problems:
        raise BundleError(f"`{path}` failed validation: {_summarise(problems)}; recalibrate with `kvcal calibrate`")
    bundle = _from_parts(tensors, meta)
    if fingerprint is not None:
        bundle.check_model(fingerprint, weights_hash)
    return bundle


def _from_parts(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Bundle:
    fields = {attr: tensors[name] for name, attr in _FIELDS.items()}
    return Bundle(
        model=ModelInfo(**json.loads(meta["model"])),
        qk_source=meta["qk.source"],
        qk_weighting=meta["qk.weighting"],
        v_source=meta["v.source"],
        calibration=json.loads(meta.get("calibration", "{}")),
        policy=json.loads(meta.get("policy", "{}")),
        extras={k: v for k, v in tensors.items() if k in OPTIONAL_TENSORS},
        kvcal_version=meta.get("kvcal.version", ""),
        created=meta.get("created", ""),
        **fields,
    )


def _summarise(problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


def _validate(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> list[str]:
    """Every problem with a bundle's tensors and metadata, as short phrases; empty when valid."""
    problems: list[str] = []
    for key in ("model", "qk.source", "qk.weighting", "v.source", "tensors.sha256"):
        if key not in meta:
            problems.append(f"metadata `{key}` missing")
    try:
        model = ModelInfo(**json.loads(meta.get("model", "{}")))
        dims = {"L": model.num_layers, "H": model.num_kv_heads, "d": model.head_dim}
    except (TypeError, ValueError) as e:
        return problems + [f"metadata `model` unreadable ({e})"]
    if len(model.layer_types) != model.num_layers:
        problems.append(f"metadata `model.layer_types` has {len(model.layer_types)} entries for {model.num_layers} "
                        "layers")
    schema = {**REQUIRED_TENSORS, **OPTIONAL_TENSORS}
    for name in sorted(set(tensors) - set(schema)):
        problems.append(f"unknown tensor `{name}`")
    for name, (symbols, dtype) in schema.items():
        t = tensors.get(name)
        if t is None:
            if name in REQUIRED_TENSORS:
                problems.append(f"tensor `{name}` missing")
            continue
        want = tuple(dims[s] if s in dims else int(s) for s in symbols)
        if tuple(t.shape) != want:
            problems.append(f"tensor `{name}` has shape {list(t.shape)}, expected {list(want)} "
                            f"[{', '.join(symbols)}]")
        elif t.dtype != dtype:
            problems.append(f"tensor `{name}` has dtype {t.dtype}, expected {dtype}")
        elif t.is_floating_point() and not torch.isfinite(t).all():
            problems.append(f"tensor `{name}` has non-finite values")
    if problems:
        return problems
    if "tensors.sha256" in meta and meta["tensors.sha256"] != content_hash(tensors):
        problems.append("tensor bytes do not match `tensors.sha256` (file corrupted)")
    d = dims["d"]
    eye = torch.eye(d, dtype=torch.float64)
    for prefix in ("qk", "v"):
        basis = tensors[f"{prefix}.rotation" if prefix == "qk" else "v.basis"].double()
        err = (basis.transpose(-1, -2) @ basis - eye).abs().amax().item()
        if err > ORTHONORMAL_TOL:
            problems.append(f"`{prefix}` basis is not orthonormal (max |R^T R - I| = {err:.2e} > {ORTHONORMAL_TOL})")
        rank = tensors[f"{prefix}.rank"]
        if rank.numel() and (rank.min() < 1 or rank.max() > d):
            problems.append(f"tensor `{prefix}.rank` outside [1, {d}] (min {rank.min().item()}, "
                            f"max {rank.max().item()})")
        spec = tensors[f"{prefix}.spectrum"]
        if (spec < 0).any() or (spec[..., 1:] > spec[..., :-1] * (1 + 1e-5) + 1e-12).any():
            problems.append(f"tensor `{prefix}.spectrum` is not non-negative and descending")
    return problems
