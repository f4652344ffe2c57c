"""KVQuant-style quantized KV cache for `kvcal bench`. Based on Hooper et al., KVQuant, NeurIPS 2024 (arXiv 2401.18079).

What is calibrated offline, on the corpus's calib split (`kvquant_calibration`), for every full-attention layer:

* keys, **pre-RoPE and per channel**: a clip range [low, high] per (layer, KV head, channel) at the 1st / 99th
  percentile of the calibration keys, giving a centre and half-range; a key is normalised as u = (k - centre) / half;
* one **non-uniform codebook** (nuq) per layer and bit width for the normalised keys, and one for the normalised
  values: weighted 1-D k-means (`kvcal.profile.codebooks.fit_codebooks`) on the calibration elements that are not
  outliers, each weighted by its normalisation half-range squared, so that the codebook minimises the squared error
  of the reconstructed K / V in the model's units (KVQuant weights by Fisher information, which needs gradients: not
  done here).

What the cache holds per token, KV head and full-attention layer (`KVQuantLayer`):

* the packed b-bit codes of the d normalised key and value elements (3 bits: 8 codes in 3 bytes, `pack_codes`);
* the value's per-token normalisation, centre and half-range of its inliers, 2 numbers in the store dtype;
* **dense-and-sparse**: the m = ceil(outlier_fraction x d) largest-magnitude normalised elements of the key and of the
  value vector, each as its exact value in the store dtype plus a uint8 channel index (a fixed count per vector,
  where KVQuant thresholds per channel; the count makes the bytes exact);
* the first token of each sequence (the attention sink) whole in the store dtype, K post-RoPE and V, as KVQuant's
  attention-sink-aware variant keeps it.

The store dtype is the model's if 16-bit, else fp16 (`store_dtype`). The per-channel ranges and the codebooks are the
per-model fixed cost (`memory()["fixed_bytes"]`, float32), outside `total_bytes`. Sliding-window layers (Gemma3) stay
dense (`DynamicSlidingWindowLayer`) and are counted as in the other baselines.

Reading: every cached token is reconstructed (unpack, codebook, denormalise, outliers back in place, RoPE at its
position) at every step, in plain torch, so decode time is an upper bound (KVQuant fuses this into its kernels). The
tokens of the current forward attend with their exact K / V, as transformers' quantized caches and kvcal's store do
at prefill; from the next forward on they are read back from the codes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from kvcal.bench.caches import CountingCache, CountingLayer, dense_bytes, memory_dict, store_dtype, tensor_bytes
from kvcal.bench.method import Method
from kvcal.bench.rope import RopeTable, apply_rope, undo_rope
from kvcal.profile.codebooks import encode, fit_codebooks
from kvcal.profile.key_ranges import clip_range
from kvcal.runtime.storage.quant import pack, unpack

KVQUANT_BITS = (2, 3, 4)
OUTLIER_FRACTION = 0.01        # KVQuant's 1% dense-and-sparse
KEY_PERCENTILE = 99.0          # per-channel key clip range: 1st to 99th percentile of the calibration keys
CODEBOOK_SAMPLES = 1 << 16     # calibration elements per layer the k-means sees (a seeded subsample)


def outlier_count(head_dim: int, fraction: float = OUTLIER_FRACTION) -> int:
    """Elements per key / value vector kept exactly: ceil(fraction x d), so at least `fraction` of them."""
    return math.ceil(fraction * head_dim - 1e-9)


# --------------------------------------------------------------------------------------------- packing


def pack_bitplanes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [..., n] < 2**bits -> uint8 [..., ceil(n * bits / 8)]: code i in bits i*bits .. i*bits + bits - 1
    of the byte stream, least significant first, any width 1..8 (a code may straddle two bytes). For widths dividing 8
    this is `kvcal.runtime.storage.quant.pack`'s layout."""
    *lead, n = codes.shape
    planes = (codes[..., None] >> torch.arange(bits, dtype=torch.uint8, device=codes.device)) & 1   # [..., n, bits]
    nbytes = (n * bits + 7) // 8
    planes = torch.nn.functional.pad(planes.reshape(*lead, n * bits), (0, nbytes * 8 - n * bits))
    weights = (1 << torch.arange(8, device=codes.device)).to(torch.int32)
    return (planes.reshape(*lead, nbytes, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack_bitplanes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bitplanes`: uint8 [..., ceil(n * bits / 8)] -> uint8 [..., n]."""
    *lead, nbytes = packed.shape
    planes = (packed[..., None] >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1   # [..., nbytes, 8]
    planes = planes.reshape(*lead, nbytes * 8)[..., :n * bits].reshape(*lead, n, bits)
    weights = (1 << torch.arange(bits, device=packed.device)).to(torch.uint8)
    return (planes * weights).sum(-1).to(torch.uint8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`kvcal.runtime.storage.quant.pack` for widths dividing 8 (2, 4), bit planes for 3, which it does not take."""
    return pack(codes, bits) if 8 % bits == 0 else pack_bitplanes(codes, bits)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    return unpack(packed, bits, n) if 8 % bits == 0 else unpack_bitplanes(packed, bits, n)


# --------------------------------------------------------------------------------------------- one vector kind


def _outliers(u: torch.Tensor, m: int) -> torch.Tensor:
    """u [..., d] -> int64 [..., m]: channels of the m largest |u| in each vector."""
    return u.abs().topk(m, dim=-1).indices


def _nuq(u: torch.Tensor, book: torch.Tensor, bits: int) -> torch.Tensor:
    """u float32 [..., d] -> packed codes of the nearest centroid of `book` [2**bits] (sorted)."""
    return pack_codes(encode(u, book), bits)


def _unnuq(packed: torch.Tensor, book: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """packed codes -> centroids float32 [..., d] (`book` is one layer's 1-D codebook: plain indexing)."""
    return book[unpack_codes(packed, bits, d).long()]


def encode_keys(k_pre: torch.Tensor, center: torch.Tensor, half: torch.Tensor, book: torch.Tensor, bits: int,
                m: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Pre-RoPE keys float32 [B, H, n, d], per-channel centre / half [H, d], codebook [2**bits] ->
    {"codes": uint8 [B, H, n, ceil(d * bits / 8)], "out": `dtype` [B, H, n, m] exact outlier values,
    "idx": uint8 [B, H, n, m] their channels}."""
    u = (k_pre - center[:, None]) / half[:, None]
    idx = _outliers(u, m)
    return {"codes": _nuq(u, book, bits), "out": k_pre.gather(-1, idx).to(dtype), "idx": idx.to(torch.uint8)}


def decode_keys(q: dict[str, torch.Tensor], center: torch.Tensor, half: torch.Tensor, book: torch.Tensor,
                bits: int, d: int) -> torch.Tensor:
    """Inverse of `encode_keys` -> pre-RoPE keys float32 [B, H, n, d], outliers exact (in `dtype`)."""
    k = _unnuq(q["codes"], book, bits, d) * half[:, None] + center[:, None]
    return k.scatter(-1, q["idx"].long(), q["out"].float())


def value_norm(v: torch.Tensor, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Values float32 [..., d] -> (idx int64 [..., m] the m largest |v|, norm `dtype` [..., 2] the (centre, half-range)
    of the other d - m). Values have no calibrated per-channel scale, so raw magnitude picks the outliers."""
    idx = _outliers(v, m)
    out = torch.zeros_like(v, dtype=torch.bool).scatter_(-1, idx, True)
    lo = v.masked_fill(out, math.inf).amin(-1)
    hi = v.masked_fill(out, -math.inf).amax(-1)
    return idx, torch.stack([(hi + lo) / 2, (hi - lo) / 2], -1).to(dtype)


def _normalise_values(v: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    center, half = norm[..., :1].float(), norm[..., 1:].float()
    return (v - center) / torch.where(half > 0, half, 1.0)


def encode_values(v: torch.Tensor, book: torch.Tensor, bits: int, m: int,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Values float32 [B, H, n, d] -> {"codes", "out", "idx" as in `encode_keys`, "norm": `dtype` [B, H, n, 2]
    (`value_norm`)}. The codes are computed from the stored (rounded) norm, which is what decoding sees."""
    idx, norm = value_norm(v, m, dtype)
    return {"codes": _nuq(_normalise_values(v, norm), book, bits), "out": v.gather(-1, idx).to(dtype),
            "idx": idx.to(torch.uint8), "norm": norm}


def decode_values(q: dict[str, torch.Tensor], book: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of `encode_values` -> float32 [B, H, n, d]."""
    norm = q["norm"].float()
    v = _unnuq(q["codes"], book, bits, d) * norm[..., 1:] + norm[..., :1]
    return v.scatter(-1, q["idx"].long(), q["out"].float())


# --------------------------------------------------------------------------------------------- calibration


@dataclass
class KVQuantCalibration:
    """Per-model constants; sliding layers hold zeros (they stay dense)."""

    key_center: torch.Tensor                 # [L, H, d] float32, pre-RoPE per-channel centre (low + high) / 2
    key_half: torch.Tensor                   # [L, H, d] float32, (high - low) / 2, > 0
    key_books: dict[int, torch.Tensor]       # bits -> [L, 2**bits] float32 sorted centroids of normalised keys
    value_books: dict[int, torch.Tensor]     # bits -> [L, 2**bits] float32, normalised values
    outliers: int                            # m: exact elements per key / value vector
    calibration_tokens: int                  # tokens the calibration forward passes saw


def fixed_bytes(full_layers: int, heads: int, head_dim: int, k_bits: int, v_bits: int) -> int:
    """Bytes of the per-model constants a cache holds: key centre and half [L_full, H, d] and the two codebooks,
    all float32."""
    return 4 * full_layers * (2 * heads * head_dim + (1 << k_bits) + (1 << v_bits))


def _sample(x: torch.Tensor, w: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded subsample of n of the 1-D samples x and their weights w (all of them when there are fewer)."""
    if x.numel() <= n:
        return x, w
    pick = torch.randperm(x.numel(), generator=g)[:n]
    return x[pick], w[pick]


@torch.inference_mode()
def kvquant_calibration(model, adapter, windows: torch.Tensor, bits: tuple[int, ...] = KVQUANT_BITS,
                        outlier_fraction: float = OUTLIER_FRACTION, percentile: float = KEY_PERCENTILE,
                        samples: int = CODEBOOK_SAMPLES, seed: int = 0) -> KVQuantCalibration:
    """Per-channel key ranges and per-layer codebooks from the K / V of `windows` int64 [n, S] (calibration text).
    Token 0 of each window is left out: the cache keeps a sequence's first token exact."""
    L, H, d = adapter.num_layers, adapter.num_kv_heads, adapter.head_dim
    full = [i for i in range(L) if not adapter.is_sliding(i)]
    m = outlier_count(d, outlier_fraction)
    rope = RopeTable(model.model.rotary_emb)
    keys: dict[int, list[torch.Tensor]] = {i: [] for i in full}
    values: dict[int, list[torch.Tensor]] = {i: [] for i in full}
    for w in windows:
        cache = DynamicCache(config=model.config)
        model(input_ids=w[None].to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
        cos, sin = rope(w.shape[0], model.device)
        for i in full:
            layer = cache.layers[i]
            keys[i].append(undo_rope(layer.keys[0].float(), cos, sin)[:, 1:].cpu())          # [H, S - 1, d]
            values[i].append(layer.values[0, :, 1:].float().cpu())
    center, half = torch.zeros(L, H, d), torch.ones(L, H, d)
    g = torch.Generator().manual_seed(seed)
    k_samples, k_weights, v_samples, v_weights = [], [], [], []
    for i in full:
        k = torch.cat(keys.pop(i), 1)                                                     # [H, N, d]
        low, high = clip_range(k, percentile)                                             # [H, d]
        center[i] = (high + low) / 2
        half[i] = torch.where(high > low, (high - low) / 2, 1.0)
        u = (k - center[i][:, None]) / half[i][:, None]
        inlier = torch.ones_like(u, dtype=torch.bool).scatter_(-1, _outliers(u, m), False)
        x, wt = _sample(u[inlier], (half[i][:, None] ** 2).expand_as(u)[inlier], samples, g)
        k_samples.append(x)
        k_weights.append(wt)
        v = torch.cat(values.pop(i), 1)[None]                                             # [1, H, N, d]
        idx, norm = value_norm(v, m, torch.float32)
        u = _normalise_values(v, norm)
        inlier = torch.ones_like(u, dtype=torch.bool).scatter_(-1, idx, False)
        x, wt = _sample(u[inlier], (norm[..., 1:] ** 2).expand_as(u)[inlier], samples, g)
        v_samples.append(x)
        v_weights.append(wt)
    k_fit = fit_codebooks(torch.stack(k_samples), bits, weight=torch.stack(k_weights))    # {b: [L_full, 2**b]}
    v_fit = fit_codebooks(torch.stack(v_samples), bits, weight=torch.stack(v_weights))
    k_books, v_books = {}, {}
    for b in bits:
        k_books[b], v_books[b] = torch.zeros(L, 1 << b), torch.zeros(L, 1 << b)
        k_books[b][full], v_books[b][full] = k_fit[b], v_fit[b]
    return KVQuantCalibration(center, half, k_books, v_books, m, int(windows.numel()))


# --------------------------------------------------------------------------------------------- the cache


class KVQuantLayer(CountingLayer):
    """One full-attention layer. Token 0 of each sequence: `sink_k` (post-RoPE) and `sink_v` [B, H, 1, d] in the
    store dtype. Tokens 1 .. seen-1: `k` = {"codes", "out", "idx"} and `v` = {..., "norm"} as `encode_keys` /
    `encode_values` return them, concatenated along the token axis (dim 2)."""

    method = "KVQuant"

    def __init__(self, owner: KVQuantCache, index: int):
        super().__init__()
        self.owner, self.index = owner, index          # index among the full-attention layers
        self.sink_k = self.sink_v = None
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> None:
        """Quantize post-RoPE keys / values [B, H, n, d] at positions start .. start + n - 1 (start >= 1)."""
        o, j = self.owner, self.index
        sd = store_dtype(key_states.dtype)
        cos, sin = o.rope(start + key_states.shape[2], key_states.device)
        k_pre = undo_rope(key_states.float(), cos[start:], sin[start:])
        k = encode_keys(k_pre, o.key_center[j], o.key_half[j], o.key_books[j], o.k_bits, o.outliers, sd)
        v = encode_values(value_states.float(), o.value_books[j], o.v_bits, o.outliers, sd)
        self.k = {n: torch.cat([self.k[n], t], 2) if self.k else t for n, t in k.items()}
        self.v = {n: torch.cat([self.v[n], t], 2) if self.v else t for n, t in v.items()}

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached token, reconstructed: keys (post-RoPE) and values float32 [B, H, seen, d]."""
        o, j, d = self.owner, self.index, self.owner.head_dim
        keys, values = [self.sink_k.float()], [self.sink_v.float()]
        if self.k:
            cos, sin = o.rope(self.seen, self.sink_k.device)
            k_pre = decode_keys(self.k, o.key_center[j], o.key_half[j], o.key_books[j], o.k_bits, d)
            keys.append(apply_rope(k_pre, cos[1:], sin[1:]))
            values.append(decode_values(self.v, o.value_books[j], o.v_bits, d))
        return torch.cat(keys, 2), torch.cat(values, 2)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        old_k, old_v = self._read() if self.seen else (None, None)
        if self.seen == 0:
            sd = store_dtype(key_states.dtype)
            self.sink_k, self.sink_v = key_states[:, :, :1].to(sd), value_states[:, :, :1].to(sd)
            if n > 1:
                self._append(key_states[:, :, 1:], value_states[:, :, 1:], 1)
        else:
            self._append(key_states, value_states, self.seen)
        self.seen += n
        if old_k is None:                            # this forward's tokens attend exact (module docstring)
            return key_states, value_states
        return (torch.cat([old_k.to(key_states.dtype), key_states], 2),
                torch.cat([old_v.to(value_states.dtype), value_states], 2))

    def held_bytes(self) -> int:
        return tensor_bytes(self.sink_k) + tensor_bytes(self.sink_v) + tensor_bytes(self.k) + tensor_bytes(self.v)

    def reset(self) -> None:
        super().reset()
        self.sink_k = self.sink_v = None
        self.k, self.v = {}, {}


class KVQuantCache(CountingCache):
    """KVQuant-style K`k_bits`V`v_bits` codes for every full-attention layer (module docstring); sliding layers
    dense. `layer_types`: per layer, "full_attention" or "sliding_attention"."""

    method = "KVQuant"

    def __init__(self, model, calibration: KVQuantCalibration, k_bits: int, v_bits: int, layer_types: list[str]):
        for b in (k_bits, v_bits):
            if b not in calibration.key_books:
                raise ValueError(f"KVQuant bits {b}: calibrated widths are {sorted(calibration.key_books)}")
        full = [i for i, t in enumerate(layer_types) if t != "sliding_attention"]
        self.k_bits, self.v_bits, self.outliers = k_bits, v_bits, calibration.outliers
        self.head_dim = calibration.key_center.shape[-1]
        self.rope = RopeTable(model.model.rotary_emb)
        self.key_center, self.key_half = calibration.key_center[full], calibration.key_half[full]   # [L_full, H, d]
        self.key_books = calibration.key_books[k_bits][full]                                       # [L_full, 2**b]
        self.value_books = calibration.value_books[v_bits][full]
        index = {i: j for j, i in enumerate(full)}                                        # layer -> full index
        super().__init__(layers=[KVQuantLayer(self, index[i]) if i in index
                                 else DynamicSlidingWindowLayer(sliding_window=model.config.sliding_window)
                                 for i in range(len(layer_types))])

    def memory(self) -> dict[str, float]:
        """Bytes held now (codes, value norms, outliers with their indices, sinks; dense sliding layers) against an
        fp16 dense cache of the same tokens; `fixed_bytes`: the calibration constants, apart from `total_bytes`."""
        total = fp16 = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            if isinstance(layer, KVQuantLayer):
                B, H = layer.sink_k.shape[:2]
                total += layer.held_bytes()
                fp16 += B * H * layer.seen * self.head_dim * 2 * 2
            else:
                total += dense_bytes(layer.keys, layer.values)
                fp16 += layer.keys.numel() * 2 * 2
        return {**memory_dict(total, fp16),
                "fixed_bytes": tensor_bytes([self.key_center, self.key_half, self.key_books, self.value_books])}


# --------------------------------------------------------------------------------------------- bench methods


def kvquant_methods(model, adapter, calibration: Callable[[], KVQuantCalibration],
                    calibration_windows: int, calibration_tokens: int) -> list[Method]:
    """KVQuant-style K4V4, K3V3 and K2V2 (family "quantization"). `calibration()` returns the KVQuantCalibration,
    computed on first use from `calibration_windows` calib-split windows (`calibration_tokens` tokens in all)."""
    d = adapter.head_dim
    m = outlier_count(d)
    out = []
    for bits in (4, 3, 2):
        out.append(Method(
            f"kvquant-k{bits}v{bits}", f"KVQuant K{bits}V{bits}", "quantization", "KVQuant-style",
            f"pre-RoPE per-channel keys, per-token values, {bits}-bit nuq codebooks per layer, {m}/{d} outliers "
            "per vector exact, first token exact",
            {"k_bits": bits, "v_bits": bits, "outliers_per_vector": m, "outlier_fraction": OUTLIER_FRACTION,
             "key_percentile": KEY_PERCENTILE, "codebook_weight": "normalisation half-range squared", "sink_tokens": 1,
             "calibration_windows": calibration_windows, "calibration_tokens": calibration_tokens},
            factory=lambda reserve, b=bits: KVQuantCache(model, calibration(), b, b, list(adapter.layer_types))))
    return out
