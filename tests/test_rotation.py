"""Rotations from streaming Gram statistics: orthonormality, exactness at full rank, truncation, agreement with a batch
SVD, token-independence metric."""

import pytest
import torch
from conftest import make_model

from kvcal.models import adapter_for
from kvcal.profile.capture import GramCollector, capturing
from kvcal.profile.rotation import QK_WEIGHTINGS, align_signs, eig_basis, qk_gram, token_independence


class RowRecorder:
    """Keeps every post-RoPE row (only for tests: the real collectors never store activations)."""

    def __init__(self):
        self.rows = {}

    def add(self, layer, query, key, value):
        self.rows.setdefault(layer, []).append((query.double().clone(), key.double().clone(), value.double().clone()))


@pytest.fixture(scope="module")
def captured():
    model, tok = make_model("llama")
    a = adapter_for(model.config)
    stats, rec = GramCollector(a), RowRecorder()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad(), capturing(model, stats, rec):
        for offset in (0, 100, 300):
            ids = torch.randint(3, len(tok), (1, 64), generator=g)
            model(input_ids=ids, position_ids=torch.arange(offset, offset + 64)[None], use_cache=False)
    return a, stats, rec


def test_capture_leaves_outputs_unchanged():
    model, tok = make_model("llama")
    ids = torch.randint(3, len(tok), (2, 32))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with capturing(model, GramCollector(adapter_for(model.config))):
            got = model(input_ids=ids).logits
    assert torch.equal(ref, got)
    assert model.config._attn_implementation != "kvcal_capture"   # restored afterwards


@pytest.mark.parametrize("weighting", list(QK_WEIGHTINGS))
def test_rotation_orthonormal_and_exact_at_full_rank(captured, weighting):
    a, stats, rec = captured
    R, spectrum = eig_basis(qk_gram(stats, weighting))
    eye = torch.eye(a.head_dim, dtype=torch.float64)
    assert (R.transpose(-1, -2) @ R - eye).abs().max() < 1e-5
    assert (spectrum[..., 1:] <= spectrum[..., :-1] + 1e-12).all()
    for layer, chunks in rec.rows.items():
        q, k, _ = chunks[0]
        for h in range(a.num_kv_heads):
            qh = q[0, a.query_heads(h)]                       # [g, S, d]
            kh = k[0, h]                                      # [S, d]
            Rh = R[layer, h]
            exact = qh @ kh.T
            rotated = (qh @ Rh) @ (kh @ Rh).T
            assert ((rotated - exact).norm() / exact.norm()) < 1e-5


def test_truncation_error_falls_with_rank(captured):
    a, stats, rec = captured
    R, _ = eig_basis(qk_gram(stats, "fdc"))
    q, k, _ = rec.rows[1][1]
    for h in range(a.num_kv_heads):
        x = torch.cat([q[0, a.query_heads(h)].reshape(-1, a.head_dim), k[0, h]])   # the rows R was built from
        errors = []
        for r in range(1, a.head_dim + 1):
            P = R[1, h][:, :r]
            errors.append((x - x @ P @ P.T).norm().item())
        assert all(e2 <= e1 + 1e-9 for e1, e2 in zip(errors, errors[1:]))
        assert errors[-1] < 1e-8 * max(errors[0], 1)


def test_streaming_gram_matches_batch_svd(captured):
    a, stats, rec = captured
    R, spectrum = eig_basis(qk_gram(stats, "fdc"))
    for layer, chunks in rec.rows.items():
        for h in range(a.num_kv_heads):
            rows = torch.cat([torch.cat([q[0, a.query_heads(h)].reshape(-1, a.head_dim), k[0, h]])
                              for q, k, _ in chunks])
            _, s, vh = torch.linalg.svd(rows, full_matrices=False)
            torch.testing.assert_close(spectrum[layer, h], s, rtol=1e-7, atol=1e-9)
            # singular vectors agree up to sign
            assert torch.allclose(align_signs(vh.T, R[layer, h]), R[layer, h], atol=1e-6)
            v = torch.cat([v_[0, h] for _, _, v_ in chunks])
            torch.testing.assert_close(stats.vv[layer, h], v.T @ v)


def test_eig_basis_is_deterministic_under_sign():
    g = torch.randn(5, 8, 8, dtype=torch.float64)
    gram = g @ g.transpose(-1, -2)
    R1, _ = eig_basis(gram)
    R2, _ = eig_basis(gram.clone())
    assert torch.equal(R1, R2)
    idx = R1.abs().argmax(dim=-2)
    assert (torch.gather(R1, -2, idx[..., None, :]) > 0).all()


def test_token_independence_metric():
    g = torch.randn(3, 16, 16, dtype=torch.float64)
    R, _ = eig_basis(g @ g.transpose(-1, -2))
    flipped = R * torch.tensor([1.0, -1.0] * 8, dtype=torch.float64)
    same = token_independence(flipped, R)
    assert same["ratio"] < 1e-12 and abs(same["overlap_half"] - 1) < 1e-12
    h = torch.randn(3, 16, 16, dtype=torch.float64)
    other, _ = eig_basis(h @ h.transpose(-1, -2))
    diff = token_independence(other, R)
    assert diff["ratio"] > 0.1 and diff["overlap_half"] < 1.0


def test_eig_basis_is_canonical_inside_near_degenerate_clusters():
    """Two Grams that differ in their last bits have near-degenerate eigenpairs (as RoPE makes them): LAPACK's raw
    eigenvectors inside a cluster differ by O(1) between them, the canonical basis by O(perturbation)."""
    torch.manual_seed(0)
    d = 16
    q, _ = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))
    lam = torch.tensor([9.0, 5.0, 5.0, 5.0, 3.0, 2.0, 2.0] + [1.0 / (i + 2) for i in range(d - 7)],
                       dtype=torch.float64)
    gram = q @ torch.diag(lam) @ q.T
    noise = torch.randn(d, d, dtype=torch.float64) * 1e-13
    other = gram + (noise + noise.T)
    raw = [torch.linalg.eigh(g)[1].flip(-1) for g in (gram, other)]
    raw_gap = min((raw[0][:, 1:4] - s * raw[1][:, 1:4]).abs().max() for s in (1, -1))
    assert raw_gap > 1e-3          # LAPACK picks another basis of the 3-dim cluster: the test has teeth
    (a, sa), (b, sb) = eig_basis(gram), eig_basis(other)
    assert (a - b).abs().max() < 1e-9 and torch.allclose(sa, sb)
    torch.testing.assert_close(a.T @ a, torch.eye(d, dtype=torch.float64))
    # the canonical basis spans the same eigenspaces: it still diagonalises the Gram
    torch.testing.assert_close(a.T @ gram @ a, torch.diag(lam), atol=1e-9, rtol=0)
