"""The CPU kernels' quantize-and-dequantize round trip (kvcal.runtime.backends.cpu.coding), which the quality model
and the coded probe code every candidate format with, against quant's torch reference."""

from __future__ import annotations

import pytest
import torch

from kvcal.profile import quality_model
from kvcal.runtime.backends.cpu import coding
from kvcal.runtime.storage import quant
from kvcal.runtime.storage.layout import TierFormat

pytestmark = [pytest.mark.float_order,
              pytest.mark.skipif(not coding.available(), reason="the CPU kernels do not build here")]


def _x(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * torch.linspace(0.05, 6.0, shape[-1])      # outlier channels


def _levels(H, bits, seed=1):
    """Sorted levels [H, 2**bits] at least half a step apart, endpoints 0 and 2**bits - 1 (as fitted ones are)."""
    K = 1 << bits
    gen = torch.Generator().manual_seed(seed)
    levels = torch.arange(K, dtype=torch.float32) + (torch.rand(H, K, generator=gen) - 0.5) * 0.5
    levels[:, 0], levels[:, -1] = 0.0, K - 1
    return levels


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("meta_bits", [16, 8])
@pytest.mark.parametrize("calibrated", [False, True])
@pytest.mark.parametrize("layout", ["channel", "token", "token-groups"])
def test_round_trip_is_quants(bits, meta_bits, calibrated, layout):
    """Every format the catalogue offers, coded by the kernel as quant codes it: uniform codes give the same floats,
    bit for bit (zero + scale · code is exact where the code is an integer); calibrated levels the same codes, so the
    values differ by at most the rounding a fused multiply-add saves, far below one level's step."""
    if calibrated and bits == 8:
        pytest.skip("8-bit sides are served uniform")
    H, S, n = 3, 256, 64
    x = _x((H, S, n))
    levels = _levels(H, bits) if calibrated else None
    if layout == "channel":
        x = x.reshape(H, S // 32, 32, n)
        lut = None if levels is None else levels[:, None, None]
        want = quant.round_trip_per_channel(x, bits, meta_bits, lut)
        got = coding.round_trip(x, bits, meta_bits, lut, channel=True)
    else:
        group = 32 if layout == "token-groups" else None
        lut = None if levels is None else levels[:, None]
        want = quant.round_trip_per_token(x, bits, group, meta_bits, lut)
        got = coding.round_trip(x, bits, meta_bits, lut, channel=False, group=group)
    if not calibrated:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=4e-7 * float(x.abs().max()))


@pytest.mark.parametrize("channel", [True, False])
def test_errors_are_those_of_the_coded_values(channel):
    """With g2 the kernel returns each token's Σ g2 (coded - x)² of the values it codes, in float64."""
    H, S, n = 2, 128, 32
    x = _x((H, S // 32, 32, n) if channel else (H, S, n), seed=2)
    g2 = torch.rand(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    lut = _levels(H, 4)[:, None, None] if channel else _levels(H, 4)[:, None]
    coded = coding.round_trip(x, 4, 8, lut, channel=channel)
    err = coding.round_trip(x, 4, 8, lut, channel=channel, g2=g2)
    assert err.shape == x.shape[:-1] and err.dtype == torch.float64
    torch.testing.assert_close(err, (g2 * (coded.double() - x.double()) ** 2).sum(-1), rtol=1e-12, atol=0)


def test_result_does_not_depend_on_threads():
    """Each block is coded by one thread, in one order: 1 and 2 threads give the same bits."""
    x = _x((4, 16, 32, 64), seed=4)
    lut = _levels(4, 2)[:, None, None]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = coding.round_trip(x, 2, 8, lut, channel=True)
        torch.set_num_threads(2)
        two = coding.round_trip(x, 2, 8, lut, channel=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("bad, words", [(float("nan"), "finite"), (float("inf"), "finite"),
                                        (7e4, "beyond the float16 range")])
def test_bad_values_are_refused_as_quant_refuses_them(bad, words):
    x = _x((2, 64, 16))
    x[1, 5, 3] = bad
    for run in (lambda: quant.round_trip_per_token(x, 4, None, 8),
                lambda: coding.round_trip(x, 4, 8, None, channel=False)):
        with pytest.raises(ValueError, match=words):
            run()


def test_quality_model_codes_alike_with_or_without_the_kernels(monkeypatch):
    """`coding_errors` and `coded_keys` by the kernel and by quant's torch reference (the kernels switched off):
    the same sums up to float order, the same keys up to the multiply-add's rounding."""
    H, S, n = 2, 200, 64
    x = _x((H, S, n), seed=5)
    g2 = torch.rand(H, S, n, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    levels = _levels(H, 4)
    cases = [(TierFormat.parse("K4cnV4nm8"), "k", 32), (TierFormat.parse("K4cnV4nm8"), "v", 1),
             (TierFormat.parse("K2V2kg32m8"), "k", 1), (TierFormat.parse("K8V8"), "v", 1)]
    runs = []
    for kernels in (True, False):
        monkeypatch.setattr(coding, "available", lambda kernels=kernels: kernels)
        runs.append([(quality_model.coding_errors(x, g2, fmt, side, page, levels if fmt.k_bits == 4 else None),
                      quality_model.coded_keys(x, fmt, page, levels if fmt.k_bits == 4 else None))
                     for fmt, side, page in cases])
    for (err_k, keys_k), (err_t, keys_t) in zip(*runs):
        torch.testing.assert_close(err_k, err_t, rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(keys_k, keys_t, rtol=0, atol=4e-7 * float(x.abs().max()))
    assert runs[0][0][0][:, -(S % 32):].eq(0).all()                  # per-channel keys' raw tail: no error
