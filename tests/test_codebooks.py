"""Non-uniform scalar codebooks (kvcal.profile.codebooks): weighted k-means per (layer, KV head)."""

from __future__ import annotations

import pytest
import torch

from kvcal.profile.codebooks import decode, distortion, encode, fit_codebooks


def _samples(seed=0, shape=(2, 3, 3000)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) / torch.rand(shape, generator=g).clamp(min=0.05).sqrt()   # heavy tails
    w = torch.rand(shape, generator=g) ** 3                                                        # uneven weights
    return x, w


@pytest.mark.parametrize("weighted", [False, True])
def test_distortion_does_not_increase_as_bits_grow(weighted):
    x, w = _samples()
    w = w if weighted else None
    books = fit_codebooks(x, (1, 2, 3, 4, 5), weight=w)
    d = torch.stack([distortion(x, books[b], w) for b in (1, 2, 3, 4, 5)])          # [5, L, H]
    assert bool((d[1:] <= d[:-1] * (1 + 1e-6)).all())
    assert bool((d[-1] < 0.2 * d[0]).all())                                          # and it does drop
    for b, c in books.items():
        assert c.shape == (2, 3, 1 << b) and bool((c[..., 1:] >= c[..., :-1]).all())


def test_codebooks_beat_a_uniform_grid_of_the_same_size():
    x, _ = _samples(seed=1, shape=(1, 1, 4000))
    c = fit_codebooks(x, (3,))[3]
    lo, hi = x.min(), x.max()
    uniform = torch.linspace(float(lo), float(hi), 8)[None, None]
    assert float(distortion(x, c)) < 0.5 * float(distortion(x, uniform))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_exact_on_data_with_at_most_2_to_the_b_distinct_values(bits):
    g = torch.Generator().manual_seed(bits)
    for n_distinct in {1, (1 << bits) - 1, 1 << bits}:
        values = torch.randn(2, n_distinct, generator=g) * 5
        idx = torch.randint(n_distinct, (2, 500), generator=g)
        x = values.gather(1, idx)                                                    # [2, 500]
        c = fit_codebooks(x, (bits,), weight=torch.rand(2, 500, generator=g))[bits]
        assert torch.equal(decode(encode(x, c), c), x)
        assert float(distortion(x, c).max()) == 0.0


def test_fitting_is_deterministic_and_validates_its_input():
    x, w = _samples(seed=2, shape=(4, 800))
    a, b = fit_codebooks(x, (2, 4), weight=w), fit_codebooks(x.clone(), (2, 4), weight=w.clone())
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="ascending"):
        fit_codebooks(x, (4, 2))
    with pytest.raises(ValueError, match="non-negative"):
        fit_codebooks(x, (2,), weight=-w)
    with pytest.raises(ValueError, match="no calibration samples"):
        fit_codebooks(x[:, :0], (2,))
