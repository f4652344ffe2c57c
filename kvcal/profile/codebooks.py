"""Non-uniform scalar codebooks (KVQuant's nuq), fitted offline by weighted k-means (Lloyd's algorithm in 1-D).

A b-bit codebook is 2**b sorted centroids; a value is coded as its nearest centroid. `fit_codebooks` fits one per
bit width, per (layer, KV head) of one tensor (K or V), on calibration samples with optional sensitivity weights
(KVQuant weights by Fisher information; any non-negative weight works here):

    books = fit_codebooks(x, (2, 3, 4), weight=w)     # x, w [L, H, N]  ->  {bits: float32 [L, H, 2**bits]}

Guarantees the tests check:

* more bits never give more weighted distortion: each width starts from the previous width's centroids plus new ones
  between them, so it starts at the previous distortion, and a Lloyd step never increases distortion (assignment to
  the nearest centroid, then each centroid to its cluster's weighted mean, are each optimal given the other);
* data with at most 2**b distinct values is coded exactly: the codebook is those values.

`fit_levels` fits the runtime's served form of a codebook: levels on the normalised scale u = (x - zero) / scale of a
min-max quantizer, in [0, 2**b - 1] with both endpoints pinned (so the group's min and max stay exact), which the
runtime serves as `zero + scale * levels[code]` (tier formats with an `n` after a side's bits, bundle
`levels.{k,v}.{bits}`; kvcal.runtime.storage.levels). Started from the uniform grid, its weighted distortion is never
above the uniform grid's on the same samples.
"""

from __future__ import annotations

import torch


def _assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """x [..., N], sorted centroids [..., K] -> index of the nearest centroid [..., N] (ties to the lower one)."""
    mid = (centroids[..., 1:] + centroids[..., :-1]) / 2                         # [..., K - 1] decision boundaries
    return torch.searchsorted(mid.contiguous(), x.contiguous(), right=False)


def encode(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """x float [..., N], centroids [..., K] sorted (K <= 256) -> codes uint8 [..., N]: the nearest centroid."""
    return _assign(x.float(), centroids.float()).to(torch.uint8)


def decode(codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., N], centroids [..., K] -> float32 [..., N]."""
    return centroids.float().gather(-1, codes.long())


def distortion(x: torch.Tensor, centroids: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted mean squared coding error [...] of x [..., N] under centroids [..., K]; weight [..., N] or None."""
    err = (decode(encode(x, centroids), centroids) - x.float()) ** 2
    w = torch.ones_like(err) if weight is None else weight.float()
    return (w * err).sum(-1) / w.sum(-1).clamp(min=1e-30)


def _lloyd(x: torch.Tensor, w: torch.Tensor, centroids: torch.Tensor, iters: int,
           pinned: bool = False) -> torch.Tensor:
    """Weighted Lloyd iterations; x, w [M, N], centroids [M, K] sorted -> [M, K] sorted. A centroid whose cluster is
    empty (or has zero weight) stays where it is; pinned: the first and last centroids stay where they are (each step
    is then optimal given the pins, so distortion still never increases)."""
    K = centroids.shape[-1]
    keep = torch.zeros(K, dtype=torch.bool, device=centroids.device)
    keep[[0, -1]] = pinned
    for _ in range(iters):
        idx = _assign(x, centroids)                                                  # [M, N]
        mass = torch.zeros_like(centroids).scatter_add_(-1, idx, w)
        total = torch.zeros_like(centroids).scatter_add_(-1, idx, w * x)
        new = torch.where((mass > 0) & ~keep, total / mass.clamp(min=1e-30), centroids)
        new = new.sort(-1).values                                                    # means of ordered cells stay
        if torch.equal(new, centroids):                                              # ordered; sort is a no-op guard
            break
        centroids = new
    assert centroids.shape[-1] == K
    return centroids


def _exact(x: torch.Tensor, K: int) -> torch.Tensor | None:
    """The distinct values of x [N], padded to K by repeating the largest, or None when there are more than K."""
    u = torch.unique(x)
    if len(u) > K:
        return None
    return torch.cat([u, u[-1:].expand(K - len(u))])


def _split(centroids: torch.Tensor, x: torch.Tensor, K: int) -> torch.Tensor:
    """Grow sorted centroids [M, k] to K = 2k: the old ones plus the midpoints between neighbours (and one beyond the
    largest, at the data's maximum), so the new codebook codes every value at least as well as the old one."""
    mid = (centroids[:, 1:] + centroids[:, :-1]) / 2
    top = torch.maximum(x.amax(-1, keepdim=True), centroids[:, -1:])
    grown = torch.cat([centroids, mid, top], -1)[:, :K]
    return grown.sort(-1).values


def fit_codebooks(x: torch.Tensor, bits: tuple[int, ...] = (2, 3, 4), weight: torch.Tensor | None = None,
                  iters: int = 40) -> dict[int, torch.Tensor]:
    """x float [..., N] samples (one codebook per leading index, e.g. [L, H, N]); weight [..., N] >= 0 or None ->
    {b: float32 [..., 2**b] sorted centroids} for each b in `bits` (fitted in ascending order, each from the last)."""
    if not bits or sorted(bits) != list(bits) or any(b < 1 or b > 8 for b in bits):
        raise ValueError(f"codebook bits {bits} must be ascending widths in 1..8, e.g. (2, 3, 4)")
    if x.shape[-1] == 0:
        raise ValueError("no calibration samples to fit codebooks on")
    lead = x.shape[:-1]
    xs = x.float().reshape(-1, x.shape[-1])                                          # [M, N]
    ws = torch.ones_like(xs) if weight is None else weight.float().reshape(xs.shape)
    if bool((ws < 0).any()) or not bool(torch.isfinite(xs).all()):
        raise ValueError("codebook samples must be finite and weights non-negative")
    out: dict[int, torch.Tensor] = {}
    # 1-bit start: the weighted mean, then Lloyd grows from there (an initial codebook, never returned unless asked)
    mean = ((ws * xs).sum(-1) / ws.sum(-1).clamp(min=1e-30))[:, None]
    centroids, k = mean, 1
    for b in bits:
        K = 1 << b
        while k < K:
            centroids = _split(centroids, xs, 2 * k)
            k *= 2
            centroids = _lloyd(xs, ws, centroids, iters)
        exact = [_exact(row, K) for row in xs]
        centroids = torch.stack([e if e is not None else c for e, c in zip(exact, centroids)])
        out[b] = centroids.reshape(*lead, K).clone()
    return out


def fit_levels(u: torch.Tensor, bits: int, weight: torch.Tensor | None = None, iters: int = 40) -> torch.Tensor:
    """Calibrated levels for the runtime's `n` formats: u float [..., N] normalised samples (u = (x - zero) / scale
    of the format's own min-max quantizer, so in [0, 2**bits - 1]; values outside are clipped to it, as the
    quantizer saturates them), weight [..., N] >= 0 or None -> float32 [..., 2**bits] sorted, first exactly 0 and
    last exactly 2**bits - 1 (what bundle `levels.{k,v}.{bits}` holds per (layer, KV head)).

    Weighted 1-D k-means (`_lloyd`) with the endpoints pinned, started from the uniform grid 0..2**bits - 1: the
    result codes the samples with no more weighted distortion than the uniform grid."""
    if not 1 <= bits <= 8:
        raise ValueError(f"level bits {bits} must be in 1..8")
    if u.shape[-1] == 0:
        raise ValueError("no calibration samples to fit levels on")
    top = (1 << bits) - 1
    lead = u.shape[:-1]
    us = u.float().reshape(-1, u.shape[-1])                                          # [M, N]
    ws = torch.ones_like(us) if weight is None else weight.float().reshape(us.shape)
    if bool((ws < 0).any()) or not bool(torch.isfinite(us).all()):
        raise ValueError("level samples must be finite and weights non-negative")
    grid = torch.arange(top + 1, dtype=torch.float32).expand(len(us), -1).contiguous()
    levels = _lloyd(us.clamp(0, top), ws, grid, iters, pinned=True)
    return levels.reshape(*lead, top + 1).clone()
