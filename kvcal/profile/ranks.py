"""Per-head ranks from a singular-value removal rate (FDC Eq. 1).

Given the descending singular values θ_0 ≥ … ≥ θ_{d-1} of a head and a removal rate r, FDC removes the largest set of
trailing dimensions whose share of the singular-value sum is at most r:

    Σ_{i>j} θ_i / Σ θ  ≤  r  <  Σ_{i≥j} θ_i / Σ θ,     rank = j + 1

With tail[k] = Σ_{i≥k} θ_i / Σ θ (non-increasing, tail[0] = 1, tail[d] = 0) this is rank = min{k ≥ 1 : tail[k] ≤ r}.
Plain singular values, not their squares, as in the paper. Two edge cases are fixed by definition: r ≤ 0 means "no
compression" and keeps all d dimensions (even exactly-zero ones), and r ≥ 1 keeps one.
"""

from __future__ import annotations

import torch


def rank_from_removal_rate(spectrum: torch.Tensor, removal_rate: float) -> torch.Tensor:
    """spectrum [..., d] descending, non-negative -> rank int32 [...] in [1, d]; non-increasing in removal_rate."""
    d = spectrum.shape[-1]
    if removal_rate <= 0:
        return torch.full(spectrum.shape[:-1], d, dtype=torch.int32)
    theta = spectrum.double()
    total = theta.sum(-1, keepdim=True)
    # tail[..., k] = share of dims k..d-1; an all-zero spectrum has no share to remove (rank 1). No floor on the
    # total: one would shrink the shares of a spectrum of tiny (subnormal) values and cut it to rank 1
    tail = theta.flip(-1).cumsum(-1).flip(-1) / torch.where(total > 0, total, torch.ones_like(total))
    # tail is non-increasing, so the first k with tail[k] <= r is 1 + #{k in 1..d-1 : tail[k] > r}
    rank = 1 + (tail[..., 1:] > removal_rate).sum(-1)
    return rank.to(torch.int32)


def ranks_for(spectrum: torch.Tensor, removal_rate: float, group: int = 1) -> torch.Tensor:
    """The ranks a removal rate gives, rounded up to a multiple of `group` (a tier quantizing values in groups of
    `group` channels needs the group to divide the stored rank): spectrum [..., d] -> rank int32 [...] in [1, d]."""
    rank = rank_from_removal_rate(spectrum, removal_rate)
    if group > 1:
        rank = (-(-rank // group) * group).clamp(max=spectrum.shape[-1])
    return rank


def ranks_of(bundle, config) -> tuple[torch.Tensor, torch.Tensor]:
    """(qk ranks, v ranks) [L, H] int32 that `config`'s removal rates give on `bundle`'s spectra (a
    `CompressionConfig`; V ranks rounded up to its value group)."""
    return (ranks_for(bundle.qk_spectrum, config.qk_removal_rate),
            ranks_for(bundle.v_spectrum, config.v_removal_rate, config.value_group))


def energy_kept(spectrum: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """Fraction of squared singular values (energy) in the first `rank` dims: spectrum [..., d], rank [...] -> [...]"""
    energy = spectrum.double().pow(2)
    keep = torch.arange(spectrum.shape[-1]) < rank[..., None].long()
    return (energy * keep).sum(-1) / energy.sum(-1).clamp(min=1e-300)
