"""TurboQuant-style KV cache for `kvcal bench`, MSE variant. Based on Zandieh et al., TurboQuant: Online Vector
Quantization with Near-optimal Distortion Rate, 2025 (arXiv 2504.19874).

No calibration. Each K (and V) vector x [d] of each token and KV head is stored as

    norm = ||x||                                   (fp16, one per vector)
    codes[i] = argmin_j |(R x / norm)[i] - c_j|    (b bits per coordinate, packed into uint8 by `runtime.quant.pack`)

with R a fixed random orthogonal d x d matrix (Haar, from a seeded Gaussian; one per model, shared by every layer and
head) and c the Lloyd-Max codebook of 2^b levels for one coordinate of a uniformly random unit vector in d
dimensions, whose density is proportional to (1 - x^2)^((d-3)/2) on [-1, 1]. The rotation is what makes every
coordinate of R x / ||x|| follow that density whatever x was, so one codebook serves all coordinates, layers and
models of that head dimension. Reading dequantises: x_hat = norm * R^T c[codes].

What the cache holds per token, layer and KV head: ceil(d * b_K / 8) + ceil(d * b_V / 8) bytes of codes and 2 + 2
bytes of norms; optionally the most recent `window` tokens in fp16 instead (as KIVI's residual). R (float32, d x d)
and the codebooks are a fixed cost per model, reported as `fixed_bytes` and not in `total_bytes`. Sliding-window
layers (Gemma3) stay dense (transformers' sliding layer), as in KvcalCache.

Faithfulness caveats: TurboQuant's inner-product variant (a 1-bit QJL sketch of the residual) is not built; bit widths
are those `pack` supports (1, 2, 4, 8: no 3-bit codes); dequantisation runs in plain torch for every cached token at
every step (the paper rotates the query instead and fuses the lookup), so its decode time is an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvcal.bench.caches import CountingCache, CountingLayer, dense_bytes, memory_dict, store_dtype, tensor_bytes
from kvcal.bench.method import Method
from kvcal.runtime.storage.quant import pack, packed_size, unpack

TURBOQUANT_BITS = (1, 2, 3, 4, 8)  # what `pack` can store
ROTATION_SEED = 0
LLOYD_GRID = 1 << 17               # cells of the scaled coordinate's support the density is integrated on
LLOYD_SPAN = 12.0                  # ... which is cut to [-12, 12] where sqrt(dim) is larger
LLOYD_ITERS = 1000
LLOYD_TOL = 1e-12

# --------------------------------------------------------------------------------------------- the codebook


@dataclass(frozen=True)
class Codebook:
    """Lloyd-Max scalar quantizer of one coordinate of a random unit vector in `dim` dimensions, `bits` bits.
    levels [2^bits] ascending, thresholds [2^bits - 1] (midpoints of neighbouring levels), both float64 in the unit
    vector's coordinate (|x| <= 1); mse: E[(x - q(x))^2] for one coordinate (times dim: the error of a unit vector)."""

    dim: int
    bits: int
    levels: torch.Tensor
    thresholds: torch.Tensor
    mse: float


def sphere_coordinate_grid(dim: int, points: int = LLOYD_GRID) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, w): midpoints y [points] of cells of [-sqrt(dim), sqrt(dim)] (cut to [-12, 12]) and the probability w
    [points] of each cell, for y = sqrt(dim) * x with x one coordinate of a uniform unit vector (density of x ∝
    (1 - x^2)^((dim-3)/2)). The scaled coordinate has variance 1 and tends to N(0, 1) as dim grows, so one grid
    resolves it at any dim."""
    if dim < 2:
        raise ValueError(f"a unit vector's coordinate has a density only for dim >= 2, got {dim}")
    r = math.sqrt(dim)
    span = min(r, LLOYD_SPAN)                             # beyond 12 (sigmas, nearly) the mass is below 1e-30
    edges = torch.linspace(-span, span, points + 1, dtype=torch.float64)
    y = (edges[1:] + edges[:-1]) / 2                      # midpoints: the density is infinite at ±r when dim = 2
    logw = (dim - 3) / 2 * torch.log1p(-(y / r) ** 2)
    w = torch.exp(logw - logw.max())
    return y, w / w.sum()


@cache
def lloyd_max(dim: int, bits: int) -> Codebook:
    """Lloyd-Max codebook for one coordinate of a uniform unit vector in `dim` dimensions, by Lloyd iterations on
    the density discretised by `sphere_coordinate_grid` (alternate: thresholds = midpoints of levels, levels =
    conditional means of their cells). Starts at the quantiles of density^(1/3), the high-resolution optimum
    (Panter-Dite), so even 256 levels converge in a few hundred iterations."""
    if bits not in TURBOQUANT_BITS:
        raise ValueError(f"TurboQuant `bits={bits}` must be one of {TURBOQUANT_BITS} (what kvcal's packer stores)")
    y, w = sphere_coordinate_grid(dim)
    n = 1 << bits
    cw = torch.cat([w.new_zeros(1), torch.cumsum(w, 0)])                   # prefix sums: cell means in O(levels)
    cwy = torch.cat([w.new_zeros(1), torch.cumsum(w * y, 0)])
    dens = w ** (1 / 3)
    cdf = torch.cumsum(dens, 0) / dens.sum()
    levels = y[torch.searchsorted(cdf, (torch.arange(n, dtype=torch.float64) + 0.5) / n).clamp(max=len(y) - 1)]
    for _ in range(LLOYD_ITERS):
        thresholds = (levels[1:] + levels[:-1]) / 2
        cut = torch.cat([torch.tensor([0]), torch.searchsorted(y, thresholds), torch.tensor([len(y)])])
        mass = cw[cut[1:]] - cw[cut[:-1]]
        new = torch.where(mass > 0, (cwy[cut[1:]] - cwy[cut[:-1]]) / mass.clamp_min(1e-300), levels)
        new = (new - new.flip(0)) / 2                    # the density is even: keep the codebook exactly symmetric
        done = float((new - levels).abs().max()) < LLOYD_TOL
        levels = new
        if done:
            break
    thresholds = (levels[1:] + levels[:-1]) / 2
    q = levels[torch.bucketize(y, thresholds)]
    mse = float((w * (y - q) ** 2).sum()) / dim          # back to the unit vector's coordinate x = y / sqrt(dim)
    scale = 1 / math.sqrt(dim)
    return Codebook(dim, bits, levels * scale, thresholds * scale, mse)


def random_rotation(dim: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """A Haar-random orthogonal matrix [dim, dim] float32: QR of a seeded Gaussian, with R's diagonal signs moved
    into Q (without them QR's sign convention biases the distribution)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


# --------------------------------------------------------------------------------------------- the quantizer


class TurboQuantizer:
    """Rotation R [d, d] and codebooks for one head dimension; `quantize` / `dequantize` of vectors [..., d]."""

    def __init__(self, dim: int, seed: int = ROTATION_SEED):
        self.dim, self.seed = dim, seed
        self.rotation = random_rotation(dim, seed)
        self._books: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def book(self, bits: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(levels [2^bits], thresholds [2^bits - 1]) float32 on `device`."""
        if bits not in self._books:
            cb = lloyd_max(self.dim, bits)
            self._books[bits] = (cb.levels.float(), cb.thresholds.float())
        levels, thresholds = self._books[bits]
        if device is not None and levels.device != torch.device(device):
            self._books[bits] = levels, thresholds = levels.to(device), thresholds.to(device)
        return levels, thresholds

    def fixed_bytes(self, bits: tuple[int, ...]) -> int:
        """Bytes of R and of the codebooks (levels and thresholds) of each bit width in `bits`."""
        return tensor_bytes(self.rotation) + sum(tensor_bytes(self.book(b)) for b in set(bits))

    def quantize(self, x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x float [..., d] -> (codes uint8 [..., packed_size(d, bits)], norm float16 [..., 1])."""
        levels, thresholds = self.book(bits, x.device)
        x = x.float()
        norm = x.norm(dim=-1, keepdim=True)
        # a zero vector stays zero (any code times norm 0); norms past fp16's range saturate rather than become inf
        unit = x / norm.clamp_min(torch.finfo(torch.float32).tiny)
        rotated = unit @ self.rotation.to(x.device).T                               # R x / ||x||, [..., d]
        codes = torch.bucketize(rotated, thresholds).to(torch.uint8)   # nearest level (thresholds are midpoints)
        fp16_max = torch.finfo(torch.float16).max
        return pack(codes, bits), norm.clamp(max=fp16_max).to(torch.float16)

    def dequantize(self, codes: torch.Tensor, norm: torch.Tensor, bits: int) -> torch.Tensor:
        """Inverse of `quantize`, up to the quantization error: float32 [..., d] = norm * R^T c[codes]."""
        levels, _ = self.book(bits, codes.device)
        unit = levels[unpack(codes, bits, self.dim).long()]                         # [..., d], rotated basis
        return (unit @ self.rotation.to(codes.device)) * norm.float()             # row-vector form of R^T u


# --------------------------------------------------------------------------------------------- the cache


class TurboQuantLayer(CountingLayer):
    """One full-attention layer: codes_k [B, H, n, ceil(d b_K / 8)], codes_v [B, H, n, ceil(d b_V / 8)] uint8,
    norm_k, norm_v [B, H, n, 1] fp16 for the n oldest tokens, and tail_k, tail_v [B, H, <= window, d] in fp16 (the
    model's dtype if 16-bit) for the most recent ones (empty when window = 0)."""

    method = "TurboQuant"

    def __init__(self, owner: TurboQuantCache):
        super().__init__()
        self.owner = owner
        self.codes_k = self.codes_v = self.norm_k = self.norm_v = self.tail_k = self.tail_v = None

    def lazy_initialization(self, key_states, value_states) -> None:
        B, H, _, d = key_states.shape
        o, sd = self.owner, store_dtype(key_states.dtype)
        self.dtype, self.device = key_states.dtype, key_states.device
        new = key_states.new_zeros
        self.codes_k = new(B, H, 0, packed_size(d, o.k_bits), dtype=torch.uint8)
        self.codes_v = new(B, H, 0, packed_size(d, o.v_bits), dtype=torch.uint8)
        self.norm_k = new(B, H, 0, 1, dtype=torch.float16)
        self.norm_v = new(B, H, 0, 1, dtype=torch.float16)
        self.tail_k = new(B, H, 0, d, dtype=sd)
        self.tail_v = new(B, H, 0, d, dtype=sd)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        held = self.tail_k.shape[2]
        tail_k = torch.cat([self.tail_k, key_states.to(self.tail_k.dtype)], dim=2)
        tail_v = torch.cat([self.tail_v, value_states.to(self.tail_v.dtype)], dim=2)
        out = tail_k.shape[2] - o.window                  # tokens leaving the fp16 window: quantize them now
        if out > 0:
            # the oldest leave first: `old` from the held window, then `fresh` new ones, quantized from what the
            # model produced rather than from their fp16 copy
            old = min(out, held)
            fresh = out - old
            k_out = torch.cat([tail_k[:, :, :old].float(), key_states[:, :, :fresh].float()], dim=2)
            v_out = torch.cat([tail_v[:, :, :old].float(), value_states[:, :, :fresh].float()], dim=2)
            ck, nk = o.quantizer.quantize(k_out, o.k_bits)
            cv, nv = o.quantizer.quantize(v_out, o.v_bits)
            self.codes_k = torch.cat([self.codes_k, ck], dim=2)
            self.codes_v = torch.cat([self.codes_v, cv], dim=2)
            self.norm_k = torch.cat([self.norm_k, nk], dim=2)
            self.norm_v = torch.cat([self.norm_v, nv], dim=2)
            tail_k, tail_v = tail_k[:, :, out:], tail_v[:, :, out:]
        self.tail_k, self.tail_v = tail_k.contiguous(), tail_v.contiguous()   # drop the views' hold on the old tail
        self.seen += key_states.shape[2]
        keys = torch.cat([o.quantizer.dequantize(self.codes_k, self.norm_k, o.k_bits), self.tail_k.float()], dim=2)
        values = torch.cat([o.quantizer.dequantize(self.codes_v, self.norm_v, o.v_bits), self.tail_v.float()], dim=2)
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def held_bytes(self) -> int:
        return tensor_bytes([self.codes_k, self.codes_v, self.norm_k, self.norm_v, self.tail_k, self.tail_v])

    def reset(self) -> None:
        super().reset()
        self.codes_k = self.codes_v = self.norm_k = self.norm_v = self.tail_k = self.tail_v = None


class TurboQuantCache(CountingCache):
    """TurboQuant-style codes for every full-attention layer (see the module docstring); sliding layers dense."""

    method = "TurboQuant"

    def __init__(self, quantizer: TurboQuantizer, k_bits: int, v_bits: int, layer_types: list[str],
                 sliding_window: int | None = None, window: int = 0):
        for name, b in (("k_bits", k_bits), ("v_bits", v_bits)):
            if b not in TURBOQUANT_BITS:
                raise ValueError(f"TurboQuant `{name}={b}` must be one of {TURBOQUANT_BITS}")
        if window < 0:
            raise ValueError(f"TurboQuant `window={window}` must be >= 0")
        self.quantizer, self.k_bits, self.v_bits, self.window = quantizer, k_bits, v_bits, window
        self.sliding = [t == "sliding_attention" for t in layer_types]
        super().__init__(layers=[DynamicSlidingWindowLayer(sliding_window) if s else TurboQuantLayer(self)
                                 for s in self.sliding])

    def memory(self) -> dict[str, float]:
        """Bytes held now (codes, norms and the fp16 window of the quantized layers; K/V of dense sliding layers)
        against an fp16 dense cache of the same tokens; `fixed_bytes`: R and the codebooks, apart."""
        total = fp16 = 0
        for layer, sliding in zip(self.layers, self.sliding):
            if not layer.is_initialized:
                continue
            if sliding:
                total += dense_bytes(layer.keys, layer.values)
                fp16 += layer.keys.numel() * 2 * 2
            else:
                B, H, _, d = layer.tail_k.shape
                total += layer.held_bytes()
                fp16 += B * H * layer.seen * d * 2 * 2
        return {**memory_dict(total, fp16), "fixed_bytes": self.quantizer.fixed_bytes((self.k_bits, self.v_bits))}


# --------------------------------------------------------------------------------------------- bench methods

TURBOQUANT_SETTINGS = ((4, 4, 0), (3, 3, 0), (4, 2, 0), (2, 2, 0), (2, 2, 64))     # (K bits, V bits, fp16 window)


def turboquant_methods(model) -> list[Method]:
    """The TurboQuant-style methods of `kvcal bench` for `model` (no calibration: R and the codebooks depend on the
    head dimension alone)."""
    from kvcal.models import adapter_for

    a = adapter_for(model.config)
    layer_types, sliding_window = list(a.layer_types), a.sliding_window
    quantizer: list[TurboQuantizer] = []          # built on first use, shared by the methods

    def factory(reserve, k_bits, v_bits, window):
        if not quantizer:
            quantizer.append(TurboQuantizer(a.head_dim))
        return TurboQuantCache(quantizer[0], k_bits, v_bits, layer_types, sliding_window, window)

    out = []
    for k_bits, v_bits, window in TURBOQUANT_SETTINGS:
        key = f"turboquant-k{k_bits}v{v_bits}" + (f"-w{window}" if window else "")
        desc = (f"random rotation + Lloyd-Max codebook for a unit-sphere coordinate, K {k_bits} / V {v_bits} bits "
                "per coordinate, fp16 norm per vector" + (f", recent {window} tokens fp16" if window else ""))
        out.append(Method(key, f"TurboQuant K{k_bits}V{v_bits}" + (f" W={window}" if window else ""),
                          "quantization", "TurboQuant-style", desc,
                          {"k_bits": k_bits, "v_bits": v_bits, "window": window, "rotation_seed": ROTATION_SEED},
                          factory=lambda reserve, k=k_bits, v=v_bits, w=window: factory(reserve, k, v, w)))
    return out
