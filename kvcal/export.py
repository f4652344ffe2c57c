"""Write a bundle in forms other serving stacks read (`kvcal export`, docs/export.md).

    export_vllm_fp8(bundle, "smollm2-135m", "out/fp8", strategy="head")   # k_scale / v_scale for stock vLLM
    export_manifest(bundle, "out/manifest")                               # bases + page layout for custom runtimes
    export_hf_lowrank_v(bundle, loaded_model, "out/hf")                   # V's rank truncation folded into W_V

Every export checks the bundle against the model's fingerprint first (a manifest only when a model is given) and writes
its directory atomically: everything goes to a temporary folder beside `out`, which is renamed into place at the end,
so an interrupted export leaves nothing at `out`. Every export lists its files in `out/.kvcal-export.json`; an existing
non-empty `out` is replaced only with `overwrite=True`, and only when it holds nothing but what that list names (a
folder of the user's own files is never deleted).

Formats, and where they are documented:

* vllm-fp8: compressed-tensors KV-cache scales as llm-compressor writes them and vLLM loads them. vLLM docs,
  docs/features/quantization/quantized_kvcache.md ("Per-tensor quantization ... q/k/v_scale = [1]"; "Per-attention-head
  quantization ... k/v_scale = [num_kv_heads]", Flash Attention backend only); scheme validated by
  `CompressedTensorsKVCacheMethod.validate_kv_cache_scheme` (type float, num_bits 8, strategy `tensor` or `attn_head`,
  symmetric) in vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py; checkpoint names
  `model.layers.N.self_attn.k_scale` remapped to `...self_attn.attn.k_scale` by `maybe_remap_kv_scale_name`
  (vllm/model_executor/model_loader/weight_utils.py); scale = max|x| / 448 as compressed-tensors' `calculate_qparams`
  computes it for symmetric FP8 (max_abs / (bit_range / 2), bit_range = 448 - (-448)).
* manifest: kvcal's own (schema below, docs/export.md).
* hf-lowrank-v: a stock transformers checkpoint with W_V <- B_r B_r^T W_V per KV head (see `export_hf_lowrank_v`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvcal.runtime.bundle import Bundle, BundleError, load_bundle
from kvcal.runtime.storage.levels import needed, tensor_name

logger = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0          # largest finite float8_e4m3fn value (OCP FP8 E4M3)
DEFAULT_MARGIN = 2.0          # headroom over the calibration max; a power of two, see `fp8_scales`
STRATEGIES = {"tensor": "tensor", "head": "attn_head"}   # CLI name -> compressed-tensors strategy
SCALES_FILE = "kv_cache_scales.safetensors"
QUANT_CONFIG_FILE = "quantization_config.json"
PROVENANCE_FILE = "kvcal_export.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_TENSORS = "kvcal_bases.safetensors"
MANIFEST_FORMAT = "kvcal-manifest"
MANIFEST_SCHEMA_VERSION = 3      # 2: `tracked` per layout; score_off = pos_off = -1 when false. 3: `levels.*`
EXPORT_LIST = ".kvcal-export.json"   # the files an export wrote: what a later `--overwrite` may delete


@dataclass
class ExportResult:
    format: str
    out: Path
    files: list[str]                                       # paths relative to `out`
    summary: dict[str, Any] = field(default_factory=dict)  # what was written, as plain data (`--json`)


# ---------------------------------------------------------------------------------------------- shared


@contextlib.contextmanager
def atomic_dir(out: str | Path, *, overwrite: bool = False, inputs: tuple = ()):
    """Yield a temporary folder beside `out`; on success it replaces `out` by rename, on failure it is removed.

    Refuses (FileExistsError) an `out` that is a file, or a non-empty folder unless `overwrite` and it holds only
    what an earlier export listed (`EXPORT_LIST`), and (ValueError) an `out` that is, contains or lies inside one of
    `inputs` (the model's folder, the bundle) or the working directory.
    """
    from kvcal.runtime.files import write_folder
    from kvcal.safe_paths import check_out_folder

    check_out_folder(out, inputs=inputs)
    with write_folder(out, overwrite=overwrite, listing=EXPORT_LIST) as tmp:
        yield tmp


@dataclass
class _Target:
    """The model an export is for: its config always, its weights when loaded."""

    config: Any
    model: nn.Module | None
    tokenizer: object | None
    folder: Path | None          # Hugging Face folder the weights come from, when known
    name: str


def _target(model, *, need_weights: bool, dtype: str = "bfloat16") -> _Target:
    """model: a spec (packaged name, .gguf, HF folder), a `LoadedModel`, or a transformers model."""
    from kvcal.models import LoadedModel, load_model, resolve_model

    if isinstance(model, (str, Path)):
        if need_weights:
            model = load_model(str(model), dtype=dtype)
        else:
            from transformers import AutoConfig

            source = resolve_model(str(model))
            config = AutoConfig.from_pretrained(source.folder, local_files_only=True)
            return _Target(config, None, None, Path(source.folder), source.name)
    if isinstance(model, LoadedModel):
        return _Target(model.model.config, model.model, model.tokenizer, Path(model.source.folder), model.name)
    if isinstance(model, nn.Module) and hasattr(model, "config"):
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        return _Target(model.config, model, None, None, name)
    raise TypeError(f"`model` must be a model spec, a LoadedModel or a transformers model, not {type(model).__name__}")


def _check(bundle: Bundle, target: _Target):
    """Refuse a bundle made for another architecture; returns the model's adapter."""
    from kvcal.models import adapter_for, fingerprint, weights_hash

    adapter = adapter_for(target.config)
    w_hash = weights_hash(target.model, adapter) if target.model is not None else None
    bundle.check_model(fingerprint(target.config), w_hash, name=target.name,
                       shape=(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim))
    return adapter


def _bundle(bundle: Bundle | str | Path) -> Bundle:
    return bundle if isinstance(bundle, Bundle) else load_bundle(bundle)


def _provenance(bundle: Bundle, fmt: str, **fields) -> dict[str, Any]:
    from kvcal import __version__
    from kvcal.runtime.bundle import content_hash

    return {
        "format": fmt,
        "kvcal_version": __version__,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "model": bundle.model.__dict__,
        "bundle": {"tensors_sha256": content_hash(bundle.tensors()), "created": bundle.created,
                   "kvcal_version": bundle.kvcal_version},
        **fields,
    }


def _write_json(path: Path, data: dict) -> None:
    from kvcal.runtime.files import write_file

    # written beside and renamed in: never through a hard link into the model's own folder, nor a symbolic link
    write_file(path, json.dumps(data, indent=2, default=str) + "\n", overwrite=True)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------- vllm-fp8


def fp8_scales(bundle: Bundle, strategy: str = "tensor", margin: float = DEFAULT_MARGIN):
    """(k_scale, v_scale) float32 [L, 1] ("tensor") or [L, H] ("head") from the bundle's `k.absmax` / `v.absmax`.

    scale = margin * max|x| / 448, so x / scale stays within E4M3's finite range for values up to `margin` times the
    calibration maximum. Why a margin of 2 by default: FP8 is a float format, so scaling by a power of two moves
    every value by exactly one binade and leaves its mantissa, and hence its rounding error, unchanged. The only cost
    is that values below max|x| / 14336 fall into E4M3's subnormal range, where their absolute error stays below
    2^-10 * scale, negligible next to normal rounding. The benefit is that a held-out value up to twice the
    calibration maximum is stored instead of saturated at 448 (vLLM's conversion saturates), which would otherwise be
    the largest error in the cache (measurements in docs/export.md). `margin=1` gives llm-compressor's min-max scales.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"`--strategy {strategy}` is not one of {', '.join(STRATEGIES)}")
    if not margin >= 1.0:
        raise ValueError(f"`--margin {margin}` must be >= 1 (a smaller scale saturates calibration values)")
    missing = [name for name in ("k.absmax", "v.absmax") if name not in bundle.extras]
    if missing:
        raise BundleError(f"the bundle has no `{'`/`'.join(missing)}` statistics (written by an older kvcal); "
                          "recalibrate with `kvcal calibrate` to export FP8 scales")
    out = []
    for name in ("k.absmax", "v.absmax"):
        absmax = bundle.extras[name].float()                                           # [L, H]
        if strategy == "tensor":
            absmax = absmax.amax(dim=-1, keepdim=True)                                 # [L, 1]
        # a head that never fired (max 0) gets the smallest positive scale, as compressed-tensors clamps it
        out.append((absmax * margin / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).eps))
    return out[0], out[1]


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an FP8 E4M3 KV cache returns for x [..., H, S, d] with scale [] / [1] / [H]: saturate x / scale to ±448,
    round to float8_e4m3fn, multiply back (vLLM's `scaled_convert` with saturation)."""
    s = scale.float().reshape(-1, 1, 1) if scale.numel() > 1 else scale.float().reshape(())     # [H, 1, 1] or []
    q = (x.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * s


def kv_cache_scheme(strategy: str) -> dict[str, Any]:
    """The compressed-tensors `kv_cache_scheme` (QuantizationArgs fields llm-compressor writes and vLLM checks)."""
    return {"num_bits": 8, "type": "float", "strategy": STRATEGIES[strategy], "dynamic": False, "symmetric": True,
            "group_size": None}


def quantization_config(strategy: str) -> dict[str, Any]:
    """A `quantization_config` for config.json that quantizes only the KV cache. vLLM's
    `CompressedTensorsConfig.from_config` needs `config_groups` (empty here: weights stay as they are)."""
    return {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
            "config_groups": {}, "ignore": [], "kv_cache_scheme": kv_cache_scheme(strategy)}


def _attention_names(config, model: nn.Module | None, adapter) -> list[str]:
    """Checkpoint prefix of each layer's attention module (e.g. `model.layers.3.self_attn`), read from the module
    tree, so a family with another layout gets its own names. Without weights the tree is built on the meta device."""
    if model is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(adapter.attention(model, layer))] for layer in range(adapter.num_layers)]


def export_vllm_fp8(bundle: Bundle | str | Path, model, out: str | Path, *, strategy: str = "tensor",
                    margin: float = DEFAULT_MARGIN, with_weights: bool = False, overwrite: bool = False
                    ) -> ExportResult:
    """Write FP8 KV-cache scales that stock vLLM loads.

    `out` gets `kv_cache_scales.safetensors` (`<attention>.k_scale` / `.v_scale`, float32, [1] per layer for
    "tensor", [num_kv_heads] for "head"), `quantization_config.json` (`{"quantization_config": ...}` to merge into the
    model's config.json) and `kvcal_export.json` (provenance). With `with_weights`, `out` is instead a complete model
    folder for `vllm serve out --kv-cache-dtype fp8`: the model's files (hard-linked when possible), config.json with
    the quantization_config merged in, and a weight index listing the scales.
    """
    bundle = _bundle(bundle)
    target = _target(model, need_weights=False)
    adapter = _check(bundle, target)
    k_scale, v_scale = fp8_scales(bundle, strategy, margin)
    prefixes = _attention_names(target.config, target.model, adapter)
    tensors = {}
    for layer, prefix in enumerate(prefixes):
        tensors[f"{prefix}.k_scale"] = k_scale[layer].clone()                        # [1] or [H], own storage
        tensors[f"{prefix}.v_scale"] = v_scale[layer].clone()
    qcfg = quantization_config(strategy)
    if with_weights:
        base = _model_config_with_scheme(target, qcfg)
    from safetensors.torch import save_file

    with atomic_dir(out, overwrite=overwrite, inputs=(target.folder,)) as tmp:
        if with_weights:
            _copy_model_folder(target.folder, tmp, base, tensors)
        save_file(tensors, str(tmp / SCALES_FILE), metadata={"format": "pt", "producer": "kvcal export vllm-fp8"})
        _write_json(tmp / QUANT_CONFIG_FILE, {"quantization_config": qcfg})
        summary = _provenance(bundle, "vllm-fp8", strategy=STRATEGIES[strategy], margin=margin,
                              fp8_max=FP8_E4M3_MAX, with_weights=with_weights, tensors=len(tensors),
                              k_scale_range=[k_scale.min().item(), k_scale.max().item()],
                              v_scale_range=[v_scale.min().item(), v_scale.max().item()])
        _write_json(tmp / PROVENANCE_FILE, summary)
        files = _files(tmp)
    return ExportResult("vllm-fp8", Path(out), files, summary)


def _model_config_with_scheme(target: _Target, qcfg: dict) -> dict:
    """The model folder's config.json with `qcfg` merged in; refuses what vLLM would misread."""
    folder = target.folder
    if folder is None:
        raise ValueError("`with_weights` needs a model folder; pass the model as a spec (name, .gguf or folder)")
    if not list(folder.glob("*.safetensors")):
        raise ValueError(f"`{folder}` has no .safetensors weights; vLLM loads only .safetensors files when any "
                         "exist, so adding the scales would hide .bin weights. Convert the model to safetensors first")
    config = json.loads((folder / "config.json").read_text())
    existing = config.get("quantization_config")
    if existing is None:
        config["quantization_config"] = qcfg
    elif existing.get("quant_method") == "compressed-tensors":
        config["quantization_config"] = {**existing, "kv_cache_scheme": qcfg["kv_cache_scheme"]}
    else:
        raise ValueError(f"the model is already quantized with `{existing.get('quant_method')}`; vLLM reads KV-cache "
                         "scales only from compressed-tensors checkpoints, so export without `--with-weights`")
    return config


def _copy_model_folder(folder: Path, dst: Path, config: dict, scales: dict[str, torch.Tensor]) -> None:
    """Hard-link (else copy) the model's files into `dst`, write the merged config.json and a safetensors index that
    also lists the scales, so both vLLM and transformers load every file."""
    from safetensors import safe_open

    def link_or_copy(src, to):
        try:
            os.link(src, to)
        except OSError:
            shutil.copy2(src, to)

    index_name = "model.safetensors.index.json"
    for src in folder.rglob("*"):
        rel = src.relative_to(folder)
        ours = ("config.json", index_name, SCALES_FILE, QUANT_CONFIG_FILE, PROVENANCE_FILE)   # written below
        if src.is_dir() or rel.parts[0].startswith(".") or str(rel) in ours:
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(src, dst / rel)
    _write_json(dst / "config.json", config)
    if (folder / index_name).is_file():
        index = json.loads((folder / index_name).read_text())
    else:
        weight_map = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                weight_map.update({k: path.name for k in f.keys()})
        total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    clash = sorted(set(index["weight_map"]) & set(scales))
    if clash:
        raise ValueError(f"the model already has KV-cache scales (`{clash[0]}`); export without `--with-weights`")
    index["weight_map"].update({name: SCALES_FILE for name in scales})
    _write_json(dst / index_name, index)


# ---------------------------------------------------------------------------------------------- manifest


def _layout_dict(lay) -> dict[str, Any]:
    return {"format": lay.fmt.name, "r_k": lay.r_k, "r_v": lay.r_v, "page_bytes": lay.page_bytes,
            "tokens_per_page": lay.tokens, "bytes_per_token": lay.bytes_per_token, "k_bytes": lay.k_bytes,
            "v_bytes": lay.v_bytes, "k_groups": lay.k_groups, "v_groups": lay.v_groups, "k_off": lay.k_off,
            "k_meta_off": lay.k_meta_off, "v_off": lay.v_off, "v_meta_off": lay.v_meta_off,
            "score_off": lay.score_off, "pos_off": lay.pos_off, "end": lay.end, "tracked": lay.tracked}


def _tier_dict(fmt) -> dict[str, Any]:
    return {"name": fmt.name, **asdict(fmt)}


_ENCODING = {
    "rotation": "K is stored as K_postRoPE @ qk.rotation[l, h][:, :qk_rank]; queries are rotated the same way and "
                "logits use the model's own softmax scale. The exported rotation and basis are the ones the runtime "
                "applies: the calibrated bases, cut to rank, times kvcal's fixed orthogonal mixing inside the kept "
                "subspace (config.mix), which leaves every dot product unchanged. V is stored as "
                "V @ v.basis[l, h][:, :v_rank]; the attention output is mapped back with v.basis[l, h][:, :v_rank]^T.",
    "page": "A page holds `tokens_per_page` tokens of one (sequence, layer, KV head, tier). Segments start at the "
            "given byte offsets from the page start, each 16-byte aligned; token i of a page is at index i in every "
            "segment.",
    "k": "quantized: uint8 [T, k_bytes], codes of k_bits each, element 0 in the least-significant bits of byte 0; "
         "raw (16/32 bits): float [T, r_k] little-endian (16-bit = float16, or bfloat16 when the model runs in "
         "bfloat16).",
    "k_meta": "k_mode token: float16 [T, k_groups, 2] (scale, zero) per group of k_group channels (null = whole "
              "vector); k_mode channel: float16 [r_k, 2] (scale, zero) per channel over the page's tokens. "
              "x = code * scale + zero. meta_bits 8: each pair is 2 bytes instead, uint8 c and int8 z, with "
              "scale = fp16(2^((c % 16) / 16)) * 2^(c // 16 - 10) and zero = z * scale * 2^bits / 32.",
    "levels": "a side with k_levels / v_levels = calibrated (an `n` in its name) decodes x = levels.{k,v}.{bits}"
              "[l, h][code] * scale + zero (those tensors: float32 [L, H, 2^bits]) instead of x = code * scale + zero",
    "v": "as k, with v_bits and r_v",
    "v_meta": "float16 [T, v_groups, 2] (scale, zero) per group of v_group channels (meta_bits 8: as k_meta)",
    "score": "float32 [T]: cumulative attention probability the token received (max over the KV head's query heads)",
    "pos": "int32 [T]: the token's cache index; -1 = empty or dropped slot",
}


def export_manifest(bundle: Bundle | str | Path, out: str | Path, config=None, *, model=None,
                    overwrite: bool = False, page_bytes: int | None = None) -> ExportResult:
    """Write `manifest.json` (model, tiers, per (layer, KV head, tier) page layout: every segment's byte offset) and
    `kvcal_bases.safetensors` (`qk.rotation`, `v.basis` [L, H, d, d] float32; `qk.rank`, `v.rank` [L, H] int32), both
    as the runtime applies them under `config` (default: the bundle's settings) and `page_bytes` (the page size a
    runtime serving with `ServeOptions(page_bytes=...)` uses; None: from the settings). With `model`, the bundle is
    checked against it first."""
    from kvcal.runtime.config import CompressionConfig
    from kvcal.runtime.storage.bases import served_bases
    from kvcal.runtime.storage.layout import ALIGN, PageLayout

    bundle = _bundle(bundle)
    target = _target(model, need_weights=False) if model is not None else None
    if target is not None:
        _check(bundle, target)
    cfg = config if config is not None else CompressionConfig.from_dict(bundle.settings)
    if cfg.static_keys:
        raise ValueError(f"the manifest format has no field for static key scales (tiers {cfg.high.name} / "
                         f"{cfg.low.name}); export settings without `s` key tiers")
    if cfg.smooth:
        raise ValueError("the manifest format has no field for the query rotation that channel smoothing needs "
                         "(`smooth`); export with `kvcal.export.export_manifest(bundle, out, config)` and a config "
                         "whose `smooth` is False")
    if cfg.sliding is not None:
        raise ValueError(f"the manifest format has no field for quantized sliding-window layers (`sliding` = "
                         f"{cfg.sliding.name}); export with `kvcal.export.export_manifest(bundle, out, config)` and "
                         "a config whose `sliding` is None (the windows then stay dense)")
    L, H, d = bundle.shape
    # what the runtime applies (ranks, rotation, and the fixed mixing inside the kept subspace), not the raw bundle
    rank_k, rank_v, rotation, basis, _ = served_bases(bundle.qk_rotation, bundle.v_basis, bundle.qk_rank,
                                                      bundle.v_rank, cfg)
    page_bytes = cfg.page_size(d, page_bytes)
    layers = []
    for layer in range(L):
        compressed = bundle.model.layer_types[layer] != "sliding_attention"   # sliding layers stay dense
        heads = []
        for h in range(H):
            r_k, r_v = int(rank_k[layer, h]), int(rank_v[layer, h])
            entry: dict[str, Any] = {"kv_head": h, "qk_rank": r_k, "v_rank": r_v, "high": None, "low": None}
            if compressed:
                entry["high"] = _layout_dict(PageLayout.build(cfg.high, r_k, r_v, page_bytes))
                entry["low"] = _layout_dict(PageLayout.build(cfg.low_of(layer, h), r_k, r_v, page_bytes,
                                                                  cfg.low_tracked))
            heads.append(entry)
        layers.append({"layer": layer, "layer_type": bundle.model.layer_types[layer], "compressed": compressed,
                       "heads": heads})
    manifest = _provenance(bundle, MANIFEST_FORMAT, schema_version=MANIFEST_SCHEMA_VERSION,
                           tensors_file=MANIFEST_TENSORS,
                           config={"high": _tier_dict(cfg.high), "low": _tier_dict(cfg.low),
                                   "policy": asdict(cfg.tiering),
                                   "use_ranks": cfg.use_ranks, "rotate": cfg.rotate, "mix": cfg.mix,
                                   "page_bytes": page_bytes,
                                   "align": ALIGN},
                           encoding=_ENCODING, layers=layers)
    from safetensors.torch import save_file

    own = lambda t: t.clone(memory_format=torch.contiguous_format)       # noqa: E731  (none() shares R and B)
    tensors = {"qk.rotation": own(rotation.float()), "v.basis": own(basis.float()),
               "qk.rank": own(rank_k.to(torch.int32)), "v.rank": own(rank_v.to(torch.int32))}
    tensors.update({name: own(t.float()) for name, t in bundle.extras.items() if name.startswith("levels.")})
    if missing := sorted({tensor_name(side, b) for fmt in cfg.formats for side, b in needed(fmt)} - set(tensors)):
        raise ValueError(f"calibrated tiers need levels {', '.join(missing)}, not in the bundle: drop the `n` tiers")
    with atomic_dir(out, overwrite=overwrite, inputs=(target.folder if target else None,)) as tmp:
        save_file(tensors, str(tmp / MANIFEST_TENSORS), metadata={"format": MANIFEST_FORMAT})
        _write_json(tmp / MANIFEST_FILE, manifest)
        files = _files(tmp)
    summary = {k: manifest[k] for k in ("format", "schema_version", "kvcal_version", "model", "config")}
    summary["compressed_layers"] = sum(entry["compressed"] for entry in layers)
    return ExportResult("manifest", Path(out), files, summary)


# ---------------------------------------------------------------------------------------------- hf-lowrank-v


@torch.no_grad()
def fold_v_projection(model: nn.Module, bundle: Bundle, *, include_sliding: bool = False) -> list[int]:
    """In place: W_V[h] <- B_r B_r^T W_V[h] (and the bias likewise) for every KV head of every compressed layer,
    B_r = v.basis[l, h][:, :v.rank[l, h]]. Returns the layers folded.

    V = x W_V^T + b, and the runtime keeps V B_r B_r^T; since B_r B_r^T is symmetric that equals x (B_r B_r^T W_V)^T +
    B_r B_r^T b, so the folded model computes the rank-truncated V with unchanged shapes. Sliding-window layers are
    skipped unless `include_sliding` (kvcal's runtime leaves them dense). Products are taken in float64.
    """
    from kvcal.models import adapter_for

    a = adapter_for(model.config)
    d = a.head_dim
    folded = []
    for layer in range(a.num_layers):
        if a.is_sliding(layer) and not include_sliding:
            continue
        v_proj = a.attention(model, layer).v_proj
        w = v_proj.weight                                                             # [H * d, hidden]
        for h in range(a.num_kv_heads):
            r = int(bundle.v_rank[layer, h])
            B = bundle.v_basis[layer, h, :, :r].double().to(w.device)                 # [d, r]
            P = B @ B.T                                                               # [d, d]
            rows = slice(h * d, (h + 1) * d)
            w[rows] = (P @ w[rows].double()).to(w.dtype)
            if v_proj.bias is not None:
                v_proj.bias[rows] = (P @ v_proj.bias[rows].double()).to(v_proj.bias.dtype)
        folded.append(layer)
    return folded


def export_hf_lowrank_v(bundle: Bundle | str | Path, model, out: str | Path, *, include_sliding: bool = False,
                        dtype: str = "bfloat16", overwrite: bool = False) -> ExportResult:
    """Write a Hugging Face folder whose W_V has each head's V-rank truncation folded in (`fold_v_projection`).

    Loadable by stock transformers (and anything that reads the architecture): shapes are unchanged, so the KV
    cache is the same size; the folder reproduces the rank-truncated model's outputs, for measuring what the V ranks
    cost in an unmodified stack. Why not a smaller V: stock Llama/Qwen2/Gemma3 attention reshapes v_proj's output
    with the config's single `head_dim` and sizes o_proj as num_heads * head_dim, so W_V -> B_r^T W_V (r < d outputs
    per head) does not load, and per-head ranks cannot be expressed in one config. The memory saving needs kvcal's
    runtime (or an attention with a per-head v_head_dim). K's rotation cannot be folded at all: RoPE sits between W_K
    and the cache and does not commute with R. `model` is a spec (loaded in `dtype`), a LoadedModel or a transformers
    model; a passed-in model is copied, not changed.
    """
    import copy

    bundle = _bundle(bundle)
    if isinstance(model, (str, Path)):                   # refuse another architecture before reading any weights
        _check(bundle, _target(model, need_weights=False))
    target = _target(model, need_weights=True, dtype=dtype)
    _check(bundle, target)
    folded_model = copy.deepcopy(target.model) if not isinstance(model, (str, Path)) else target.model
    if bool((bundle.v_rank >= bundle.model.head_dim).all()):
        logger.warning("every V rank is the full head dim %d: the exported weights equal the model's",
                       bundle.model.head_dim)
    layers = fold_v_projection(folded_model, bundle, include_sliding=include_sliding)
    ranks = {str(layer): bundle.v_rank[layer].tolist() for layer in layers}
    with atomic_dir(out, overwrite=overwrite, inputs=(target.folder,)) as tmp:
        folded_model.save_pretrained(tmp)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(tmp)
        summary = _provenance(bundle, "hf-lowrank-v", folded_layers=layers, v_ranks=ranks,
                              dtype=str(next(folded_model.parameters()).dtype).removeprefix("torch."),
                              tokenizer=target.tokenizer is not None)
        _write_json(tmp / PROVENANCE_FILE, summary)
        files = _files(tmp)
    return ExportResult("hf-lowrank-v", Path(out), files, summary)
