"""Rotations and bases from streaming Gram matrices (FDC §3.2), and the token-independence check (FDC §3.2, Table 2).

FDC stacks the post-RoPE Q and K rows of a head into X and takes the right singular vectors of X. With Gram matrices
G = X^T X accumulated in float64 this is the eigendecomposition of G: R = eigenvectors by descending eigenvalue,
spectrum θ = sqrt(eigenvalues) (the singular values of X). Nothing else about X is ever needed.

GQA: one R per KV head, because the cache holds one K per KV head; a per-query-head R would cache g rotated copies of
K. R comes from the K rows of the KV head and the Q rows of all g query heads it serves. How the two kinds of rows
are weighted is a choice (`QK_WEIGHTINGS`); docs/calibration.md ("Q/K weighting for GQA") records the attention-logit
error of each at equal rank.
"""

from __future__ import annotations

import torch

from kvcal.profile.capture import GramCollector

QK_WEIGHTINGS = {
    # FDC as printed: stack every row. Q rows outnumber K rows g:1 and usually have other norms.
    "fdc": "stacked rows, unweighted: K^T K + sum_q Q^T Q",
    # each kind of row counts as one averaged row: mean K Gram + mean Q Gram (norms still matter)
    "mean": "mean K row Gram + mean Q row Gram",
    # each kind of row contributes the same total energy
    "trace": "K^T K / tr(K^T K) + Q^T Q / tr(Q^T Q)",
}
DEFAULT_QK_WEIGHTING = "trace"


def qk_gram(stats: GramCollector, weighting: str) -> torch.Tensor:
    """Weighted [L, H, d, d] float64 Gram whose eigenvectors give R."""
    if weighting not in QK_WEIGHTINGS:
        raise ValueError(f"`qk weighting {weighting}` is not one of {', '.join(QK_WEIGHTINGS)}")
    kk, qq = stats.kk, stats.qq
    if weighting == "fdc":
        return kk + qq
    if weighting == "mean":
        rows = stats.rows.clamp(min=1).double()[:, None, None, None]
        return kk / rows + qq / (rows * stats.group)
    trace = lambda g: torch.diagonal(g, dim1=-2, dim2=-1).sum(-1)[..., None, None].clamp(min=1e-300)  # noqa: E731
    return kk / trace(kk) + qq / trace(qq)


CLUSTER_RTOL = 1e-3   # eigenvalues closer than this (relative) form one near-degenerate cluster, see eig_basis


def eig_basis(gram: torch.Tensor, rtol: float = CLUSTER_RTOL) -> tuple[torch.Tensor, torch.Tensor]:
    """gram [..., d, d] symmetric PSD (float64) -> basis [..., d, d] (orthonormal columns by descending eigenvalue)
    and spectrum [..., d] = sqrt(eigenvalues), descending.

    The basis is canonical, so that the same statistics give the same bundle bytes wherever they are decomposed:
    - inside a cluster of near-degenerate eigenvalues (adjacent ones within `rtol` of each other: RoPE pairs) only
      the cluster's subspace is determined; LAPACK returns an arbitrary orthonormal basis of it, which changes with
      the last bits of the Gram. The cluster's basis is rotated to the eigenvectors of a fixed tie-breaking matrix
      (diag(1, ..., d)) restricted to the subspace, which depend on the subspace alone;
    - each column is then flipped so its largest-magnitude entry is positive.
    The decomposition runs on one thread: LAPACK's batched paths may split work by thread count.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        evals, evecs = torch.linalg.eigh(gram.double())
    finally:
        torch.set_num_threads(threads)
    evals, evecs = evals.flip(-1), evecs.flip(-1)
    evecs = _canonical_clusters(evals, evecs, rtol)
    idx = evecs.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(evecs, -2, idx))
    sign[sign == 0] = 1
    return evecs * sign, evals.clamp(min=0).sqrt()


def _canonical_clusters(evals: torch.Tensor, evecs: torch.Tensor, rtol: float) -> torch.Tensor:
    """evals [..., d] descending, evecs [..., d, d]: each near-degenerate cluster's columns replaced by the canonical
    basis of their span (see eig_basis). Cheap: a loop over the few matrices that have clusters."""
    d = evals.shape[-1]
    flat_vals, flat_vecs = evals.reshape(-1, d), evecs.reshape(-1, d, d).clone()
    top = flat_vals[:, :1].abs().clamp(min=1e-300)
    # adjacent eigenvalues tie when their gap is below rtol of the larger one (or negligible against the largest)
    close = (flat_vals[:, :-1] - flat_vals[:, 1:]) <= rtol * torch.maximum(flat_vals[:, :-1].abs(), 1e-12 * top)
    tie = torch.arange(1, d + 1, dtype=torch.float64)
    for m in torch.nonzero(close.any(-1)).flatten().tolist():
        start = 0
        for i in range(d):          # a cluster is a maximal run of ties: columns start..i
            if i < d - 1 and bool(close[m, i]):
                continue
            if i > start:
                v = flat_vecs[m, :, start:i + 1]                              # [d, k]
                w, u = torch.linalg.eigh(v.T @ (tie[:, None] * v))          # [k], [k, k] ascending
                flat_vecs[m, :, start:i + 1] = v @ u
            start = i + 1
    return flat_vecs.view_as(evecs)


@torch.no_grad()
def weight_svd_basis(model, adapter) -> tuple[torch.Tensor, torch.Tensor]:
    """FDC/Palu V basis from the weights alone: per KV head, the right singular vectors of diag(norm gain) W_V^T.

    Returns basis [L, H, d, d] float64 and spectrum [L, H, d] (singular values), both descending.
    """
    L, H, d = adapter.num_layers, adapter.num_kv_heads, adapter.head_dim
    basis = torch.empty(L, H, d, d, dtype=torch.float64)
    spectrum = torch.empty(L, H, d, dtype=torch.float64)
    for layer in range(L):
        for h in range(H):
            w = adapter.v_weight(model, layer, h).to("cpu", torch.float64)             # [hidden, d]
            # the Gram of the map, W^T W, has the right singular vectors as eigenvectors: reuse eig_basis's signs
            basis[layer, h], spectrum[layer, h] = eig_basis(w.T @ w)
    return basis, spectrum


def align_signs(basis: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Flip columns of `basis` [..., d, d] so that each has a non-negative dot product with the same column of
    `reference`; element-wise comparisons of eigenvectors are meaningless otherwise."""
    dots = (basis * reference).sum(-2, keepdim=True)
    sign = torch.where(dots < 0, -1.0, 1.0).to(basis.dtype)
    return basis * sign


def token_independence(r_random: torch.Tensor, r_text: torch.Tensor) -> dict[str, float]:
    """FDC Table 2 in miniature: δ̄ = mean |R_random - R_text| (sign-aligned), ε̄ = mean |R_text|, their ratio, plus
    the mean subspace overlap ||R_r[:, :k]^T R_t[:, :k]||_F^2 / k at k = d/2 and 3d/4 (1 = same subspace), which is
    robust to the free rotation of eigenvectors inside near-degenerate eigenvalue clusters that δ̄ punishes."""
    r_random, r_text = r_random.double(), r_text.double()
    aligned = align_signs(r_random, r_text)
    delta = (aligned - r_text).abs().mean().item()
    epsilon = r_text.abs().mean().item()
    d = r_text.shape[-1]
    out = {"delta": delta, "epsilon": epsilon, "ratio": delta / epsilon}
    for frac, name in ((0.5, "overlap_half"), (0.75, "overlap_three_quarters")):
        k = max(1, int(round(d * frac)))
        m = r_random[..., :, :k].transpose(-1, -2) @ r_text[..., :, :k]
        out[name] = (m.pow(2).sum((-1, -2)) / k).mean().item()
    return out
