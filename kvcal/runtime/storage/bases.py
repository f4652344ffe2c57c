"""The bases the runtime applies: each head's rotation and value basis cut to its rank, with the fixed mixing.

    rank_k, rank_v, rotation, basis, query_rotation = served_bases(bundle.qk_rotation, bundle.v_basis,
                                                                   bundle.qk_rank, bundle.v_rank, config, smoothing)

`CompressedKV` serves with these and the manifest export writes them, so another runtime reads and writes the same
bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcal.runtime.config import CompressionConfig


def _mixing(width: int, rank: int) -> torch.Tensor:
    """[width, width] orthogonal on the first `rank` coordinates (identity elsewhere), seeded by `rank` alone.

    R and B sort coordinates by energy, so the first few carry most of it; a per-token quantizer then spends its range
    on them and rounds the rest to nothing. A fixed random rotation inside the kept subspace spreads the energy evenly
    (the incoherence step of QuaRot/QuIP) and changes no dot product: (q R M)(k R M)^T = (q R)(k R)^T for orthogonal
    M, and the value output maps back through (B M)^T. Deterministic, so a bundle always serves the same way.
    """
    g = torch.Generator().manual_seed(rank)
    q, r = torch.linalg.qr(torch.randn(rank, rank, generator=g, dtype=torch.float64))
    m = torch.eye(width, dtype=torch.float64)
    m[:rank, :rank] = q * torch.sign(torch.diagonal(r))        # sign fix: a unique Haar-distributed orthogonal
    return m.float()


class ServedBases(NamedTuple):
    rank_k: torch.Tensor          # [L, H] int32
    rank_v: torch.Tensor          # [L, H] int32
    rotation: torch.Tensor        # [L, H, d, d] float32: keys are stored as K @ rotation[l, h][:, :rank_k]
    basis: torch.Tensor           # [L, H, d, d] float32: values as V @ basis[l, h][:, :rank_v]
    query_rotation: torch.Tensor  # [L, H, d, d] float32: queries meet the stored keys as q @ query_rotation[l, h]


def served_bases(rotation: torch.Tensor, basis: torch.Tensor, rank_k: torch.Tensor, rank_v: torch.Tensor,
                 config: CompressionConfig, smoothing: torch.Tensor | None = None) -> ServedBases:
    """The ranks and bases the runtime actually applies under `config`: every column beyond the head's rank zeroed
    and, with mixing, the first rank columns multiplied by `_mixing`; ranks full when `use_ranks` is off. The manifest
    export writes exactly these, so another runtime reads and writes the same bytes.

    With `config.smooth`, `smoothing` [L, H, d] (bundle `qk.smoothing`, kvcal.profile.smoothing) divides the key
    rotation's columns and multiplies the query rotation's before the mixing: q·k is unchanged, since
    (q R D M)(k R D⁻¹ M)ᵀ = q R D M Mᵀ D⁻¹ Rᵀ kᵀ = q kᵀ. Without it the query rotation is the key rotation.

    With static keys in either tier (`config.static_keys`) the key rotation is not mixed: static key ranges are
    calibrated per column of the bundle's rotation (bundle `k.range_low/high`), which holds at every rank because
    cutting to a rank only drops columns, whereas the mixing is seeded by the rank and would change every column.
    Per-channel scales need no mixing: they fit each coordinate's own range, outlier or not."""
    L, H, d, _ = rotation.shape
    if config.smooth and smoothing is None:
        raise ValueError("the settings ask for channel smoothing (`smooth`) but the bundle has no `qk.smoothing`: "
                         "recalibrate with this kvcal, or serve with `smooth=False`")
    if not config.use_ranks:
        rank_k = rank_v = torch.full((L, H), d, dtype=torch.int32)
    if not config.rotate:
        rotation = basis = torch.eye(d).expand(L, H, d, d)
    cols = torch.arange(d)
    out_r, out_b = torch.zeros(L, H, d, d), torch.zeros(L, H, d, d)
    out_q = torch.zeros(L, H, d, d) if config.smooth else out_r
    for layer in range(L):
        rk, rv = int(rank_k[layer].max()), int(rank_v[layer].max())
        keep_k = (cols[None, :] < rank_k[layer, :, None]).float()[:, None, :]             # [H, 1, d]
        keep_v = (cols[None, :] < rank_v[layer, :, None]).float()[:, None, :]
        R = (rotation[layer].float() * keep_k)[..., :rk]                                   # [H, d, rk]
        Bv = (basis[layer].float() * keep_v)[..., :rv]                                     # [H, d, rv]
        Rq = None
        if config.smooth:
            D = smoothing[layer, :, None, :rk].float()                                       # [H, 1, rk]
            R, Rq = R / D, R * D
        if config.mix and config.rotate and not config.static_keys:
            mixing = [_mixing(rk, int(rank_k[layer, h])) for h in range(H)]
            R = torch.stack([R[h] @ mixing[h] for h in range(H)])
            if Rq is not None:
                Rq = torch.stack([Rq[h] @ mixing[h] for h in range(H)])
        if config.mix and config.rotate:
            Bv = torch.stack([Bv[h] @ _mixing(rv, int(rank_v[layer, h])) for h in range(H)])
        out_r[layer, :, :, :rk], out_b[layer, :, :, :rv] = R, Bv
        if Rq is not None:
            out_q[layer, :, :, :rk] = Rq
    return ServedBases(rank_k, rank_v, out_r, out_b, out_q)
