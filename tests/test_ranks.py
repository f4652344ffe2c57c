"""FDC Eq. 1: removal rate -> per-head rank."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal.profile.ranks import energy_kept, rank_from_removal_rate


def test_zero_rate_keeps_all_even_zero_singular_values():
    s = torch.tensor([[4.0, 2.0, 1.0, 0.0]])
    assert rank_from_removal_rate(s, 0.0).tolist() == [4]


def test_rate_near_one_keeps_one():
    s = torch.tensor([[4.0, 2.0, 1.0, 0.5]])
    assert rank_from_removal_rate(s, 0.999).tolist() == [1]
    assert rank_from_removal_rate(s, 1.0).tolist() == [1]


def test_worked_example():
    # sum 10: tails from dim k: k=1: 6/10, k=2: 3/10, k=3: 1/10, k=4: 0
    s = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert [rank_from_removal_rate(s, r).item() for r in (0.05, 0.1, 0.2, 0.3, 0.5, 0.6, 0.7)] == [4, 3, 3, 2, 2, 1, 1]


def test_ties_and_shapes():
    s = torch.ones(3, 2, 8)
    r = rank_from_removal_rate(s, 0.25)        # each dim is 1/8; removing 2 dims = 0.25 <= 0.25
    assert r.shape == (3, 2) and r.dtype == torch.int32 and (r == 6).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=32), st.floats(0, 1), st.floats(0, 1))
def test_monotone_and_bounded(values, r1, r2):
    s = torch.tensor(sorted(values, reverse=True), dtype=torch.float64)
    lo, hi = min(r1, r2), max(r1, r2)
    k_lo, k_hi = rank_from_removal_rate(s, lo).item(), rank_from_removal_rate(s, hi).item()
    assert 1 <= k_hi <= k_lo <= len(values)
    if s.sum() > 0 and lo > 0:
        # the removed tail is within the budget
        assert s[k_lo:].sum() / s.sum() <= lo + 1e-9


def test_a_spectrum_of_subnormal_values_keeps_its_shares():
    """Found by hypothesis: a floor on the total made tiny values' tail shares vanish (rank 1 at any rate)."""
    s = torch.tensor([2.2251e-308, 2.2251e-308], dtype=torch.float64)
    assert rank_from_removal_rate(s, 0.25).item() == 2 and rank_from_removal_rate(s, 0.5).item() == 1


def test_energy_kept():
    s = torch.tensor([[3.0, 4.0 ** 0.5, 0.0]])
    assert torch.allclose(energy_kept(s, torch.tensor([1])), torch.tensor([9 / 13], dtype=torch.float64))
    assert torch.allclose(energy_kept(s, torch.tensor([3])), torch.tensor([1.0], dtype=torch.float64))
