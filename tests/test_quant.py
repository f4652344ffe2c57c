import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal.runtime.storage.quant import (
    LOG_SCALES,
    SUPPORTED_BITS,
    decode_meta,
    dequantize_per_channel,
    dequantize_per_token,
    meta8_decode,
    meta8_encode,
    meta_from_bytes,
    meta_to_bytes,
    pack,
    packed_size,
    quantize_per_channel,
    quantize_per_token,
    round_trip_per_token,
    unpack,
)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _slack(scale, zero, bits):
    # scale and zero are rounded to fp16 before encoding; the clamped end codes can then be off by the fp16 rounding
    # of zero plus (2**bits - 1) times that of scale (relative half-ulp 2**-11). 2**-10 is a comfortable bound.
    s, z = scale.float(), zero.float()
    return 2**-10 * (z.abs() + ((1 << bits) - 1) * s) + 1e-6


# ---- packing -------------------------------------------------------------------------------------------------------


def test_packed_size():
    assert [packed_size(n, 4) for n in (0, 1, 2, 3)] == [0, 1, 1, 2]
    assert [packed_size(n, 2) for n in (1, 4, 5)] == [1, 1, 2]
    assert packed_size(5, 8) == 5


def test_pack_layout_hand_computed():
    codes = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert pack(codes, 4).tolist() == [0x21, 0x03]
    # bits=2: codes [1, 2, 3, 0, 3] -> byte0 = 1 | 2<<2 | 3<<4 = 0x39, byte1 = 3
    assert pack(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2).tolist() == [0x39, 0x03]
    assert pack(torch.tensor([7, 255], dtype=torch.uint8), 8).tolist() == [7, 255]


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from((1, 2, 4, 8)),
    lead=st.lists(st.integers(0, 3), max_size=2),
    n=st.integers(0, 37),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_round_trip(bits, lead, n, seed):
    codes = torch.randint(0, 1 << bits, (*lead, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, packed_size(n, bits))
    assert torch.equal(unpack(packed, bits, n), codes)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="codes"):
        pack(torch.tensor([16], dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="dtype"):
        pack(torch.tensor([1], dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="packed"):
        unpack(torch.zeros(3, dtype=torch.uint8), 4, 3)


# ---- per-token -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", [None, 16, 32])
def test_per_token_round_trip_bound(bits, group_size):
    x = _randn(3, 5, 64) * 2 + 0.5
    codes, scale, zero = quantize_per_token(x, bits, group_size)
    ng = 1 if group_size is None else 64 // group_size
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scale.dtype == zero.dtype == torch.float16
    assert scale.shape == zero.shape == (3, 5, ng)
    assert int(codes.max()) < 1 << bits
    x_hat = dequantize_per_token(codes, scale, zero, group_size)
    assert x_hat.dtype == torch.float32 and x_hat.shape == x.shape
    g = 64 // ng
    bound = (scale.float() / 2 + _slack(scale, zero, bits)).repeat_interleave(g, dim=-1)
    assert ((x - x_hat).abs() <= bound).all()


@pytest.mark.parametrize("group_size", [None, 16])
def test_per_token_error_decreases_with_bits(group_size):
    x = _randn(8, 64, seed=1)
    errs = [
        (dequantize_per_token(*quantize_per_token(x, b, group_size), group_size) - x).abs().mean() for b in (2, 4, 8)
    ]
    assert errs[0] > errs[1] > errs[2]


def test_per_token_dtype_and_half_input():
    x = _randn(4, 32).half()
    codes, scale, zero = quantize_per_token(x, 4, 8)
    out = dequantize_per_token(codes, scale, zero, 8, dtype=torch.float16)
    assert out.dtype == torch.float16 and out.shape == x.shape


def test_per_token_constant_input_exact():
    x = torch.full((2, 3, 16), 3.25)
    x[1, 2] = -7.5
    for bits in SUPPORTED_BITS:
        codes, scale, zero = quantize_per_token(x, bits, 8)
        assert (codes == 0).all() and (scale == 0).all()
        assert torch.equal(dequantize_per_token(codes, scale, zero, 8), x)


def test_per_token_empty():
    codes, scale, zero = quantize_per_token(torch.zeros(2, 0), 4)
    assert codes.shape == (2, 0) and scale.shape == zero.shape == (2, 1)
    assert dequantize_per_token(codes, scale, zero).shape == (2, 0)
    codes, scale, zero = quantize_per_token(torch.zeros(0, 32), 4, 16)
    assert codes.shape == (0, 32) and scale.shape == (0, 2)
    assert dequantize_per_token(codes, scale, zero, 16).shape == (0, 32)


# ---- per-channel ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_per_channel_round_trip_bound(bits):
    x = _randn(2, 3, 32, 64, seed=2) * torch.linspace(0.1, 5, 64)
    codes, scale, zero = quantize_per_channel(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scale.dtype == zero.dtype == torch.float16
    assert scale.shape == zero.shape == (2, 3, 64)
    x_hat = dequantize_per_channel(codes, scale, zero)
    assert x_hat.dtype == torch.float32 and x_hat.shape == x.shape
    bound = (scale.float() / 2 + _slack(scale, zero, bits)).unsqueeze(-2)
    assert ((x - x_hat).abs() <= bound).all()


def test_per_channel_valid_mask_excludes_outlier():
    x = _randn(2, 16, 32, seed=3)
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[:, 10:] = False  # partially filled block
    ref = quantize_per_channel(x[:, :10], 4)
    x_bad = x.clone()
    x_bad[:, 12] = 1e4  # huge outlier in an invalid slot
    x_bad[:, 14] = float("nan")  # garbage in an unfilled slot is ignored too
    codes, scale, zero = quantize_per_channel(x_bad, 4, valid)
    assert torch.equal(scale, ref[1]) and torch.equal(zero, ref[2])
    assert torch.equal(codes[:, :10], ref[0])
    assert (codes[:, 10:] == 0).all()


def test_per_channel_no_valid_tokens_and_empty():
    x = _randn(4, 8)
    codes, scale, zero = quantize_per_channel(x, 2, torch.zeros(4, dtype=torch.bool))
    assert (codes == 0).all() and (scale == 0).all() and (zero == 0).all()
    codes, scale, zero = quantize_per_channel(torch.zeros(3, 0, 8), 4)
    assert codes.shape == (3, 0, 8) and scale.shape == zero.shape == (3, 8)
    assert dequantize_per_channel(codes, scale, zero).shape == (3, 0, 8)


def test_per_channel_constant_input_exact():
    x = _randn(8, 4)
    x[:, 1] = 1.5
    codes, scale, zero = quantize_per_channel(x, 4)
    assert scale[1] == 0 and (codes[:, 1] == 0).all()
    assert torch.equal(dequantize_per_channel(codes, scale, zero)[:, 1], x[:, 1])


@pytest.mark.parametrize("bits,max_rel_err", [(4, 0.2), (2, 0.6)])
def test_planted_outlier_channels(bits, max_rel_err):
    keys = _randn(64, 64, seed=4)
    outliers = [5, 41]
    keys[:, outliers] *= 50
    normal = torch.ones(64, dtype=torch.bool)
    normal[outliers] = False

    k_ch = dequantize_per_channel(*quantize_per_channel(keys, bits))
    k_tok = dequantize_per_token(*quantize_per_token(keys, bits))
    err_ch = (k_ch - keys)[:, normal].abs().mean()
    err_tok = (k_tok - keys)[:, normal].abs().mean()
    assert err_ch < max_rel_err * keys[:, normal].std()
    assert err_tok > 5 * err_ch


# ---- bad input -----------------------------------------------------------------------------------------------------


def test_bad_bits():
    x = _randn(4, 8)
    for fn in (quantize_per_token, quantize_per_channel):
        with pytest.raises(ValueError, match="bits"):
            fn(x, 5)
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(4, dtype=torch.uint8), 6)
    with pytest.raises(ValueError, match="bits"):
        packed_size(4, 7)


def test_three_bit_codes_fill_a_little_endian_bit_stream():
    """Eight 3-bit codes fill three bytes, codes 2 and 5 straddling a byte boundary; a row whose length 8 does not
    divide ends in a zero-padded partial byte, and unpack inverts pack at every length."""
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    stream = int.from_bytes(bytes(pack(codes, 3).tolist()), "little")
    assert [(stream >> (3 * i)) & 7 for i in range(8)] == codes.tolist() and packed_size(8, 3) == 3
    gen = torch.Generator().manual_seed(3)
    for n in (1, 3, 5, 8, 11, 64):
        c = torch.randint(0, 8, (2, n), generator=gen, dtype=torch.uint8)
        packed = pack(c, 3)
        assert packed.shape == (2, -(-3 * n // 8)) and torch.equal(unpack(packed, 3, n), c)
        assert int(packed[:, -1].max()) < 1 << (3 * n - 8 * (packed.shape[-1] - 1))      # the padding is zero


def test_non_finite_input():
    x = _randn(4, 8)
    x[2, 3] = float("nan")
    for fn in (quantize_per_token, quantize_per_channel):
        with pytest.raises(ValueError, match="finite"):
            fn(x, 4)
    x[2, 3] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        quantize_per_token(x, 4)


def test_out_of_fp16_range():
    x = _randn(4, 8)
    x[1, 1] = 1e6
    for fn in (quantize_per_token, quantize_per_channel):
        with pytest.raises(ValueError, match="max abs value 1e\\+06"):
            fn(x, 8)
    # in range, but at 1 bit the span 120000 itself overflows a fp16 scale
    y = torch.tensor([[-60000.0, 60000.0]])
    with pytest.raises(ValueError, match="max abs value"):
        quantize_per_token(y, 1)
    quantize_per_token(y, 2)  # fine: scale = 40000


def test_bad_group_size_and_shapes():
    x = _randn(4, 24)
    with pytest.raises(ValueError, match="group_size"):
        quantize_per_token(x, 4, 16)
    codes, scale, zero = quantize_per_token(x, 4, 8)
    with pytest.raises(ValueError, match="scale"):
        dequantize_per_token(codes, scale, zero, 12)
    with pytest.raises(ValueError, match="valid"):
        quantize_per_channel(x, 4, torch.ones(3, dtype=torch.bool))


# ---- 8-bit metadata (formats ending in m8) -------------------------------------------------------------------------


def test_meta8_scales_are_fp16_numbers_on_a_log_grid():
    s = LOG_SCALES.double()
    assert len(s) == 256 and s[0] == 2.0**-10
    assert torch.equal(LOG_SCALES.half().float(), LOG_SCALES)              # each one an fp16 number
    ratio = s[1:] / s[:-1]
    assert ((ratio - 2 ** (1 / 16)).abs() < 2e-3).all()                      # 16 steps per octave
    assert torch.equal(LOG_SCALES[16::16], LOG_SCALES[:-16:16] * 2)


def _covers(c, z, mn, mx, bits):
    s, zero = meta8_decode(c, z, bits)
    return (zero <= mn) & (zero + ((1 << bits) - 1) * s >= mx)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_meta8_picks_the_smallest_covering_scale(bits):
    gen = torch.Generator().manual_seed(bits)
    span = torch.rand(4000, generator=gen).double().exp2().mul(3).float()          # ranges 3 .. 6
    center = (torch.rand(4000, generator=gen) - 0.5) * 4 * span                   # 2 ranges either side of 0
    mn, mx = center - span / 2, center + span / 2
    c, z = meta8_encode(mn, mx, bits)
    assert c.dtype == torch.uint8 and z.dtype == torch.int8
    assert _covers(c, z, mn, mx, bits).all()
    # one grid step smaller covers from no int8 zero code: the floor is the only candidate (larger z lifts the top)
    smaller = (c.long() - 1).clamp(min=0)
    s = LOG_SCALES[smaller]
    z_smaller = torch.floor(mn / (s * 2.0 ** bits / 32)).clamp(-128, 127).to(torch.int8)
    assert not (_covers(smaller.to(torch.uint8), z_smaller, mn, mx, bits) & (c > 0)).any()
    # at most one grid step (fp16 mantissas: 2^(1/16) to within 0.3 %) above the scale that covers min-max from a
    # zero up to one zero unit (1/32 of the code range) below min
    top = (1 << bits) - 1
    assert (LOG_SCALES[c.long()] <= (mx - mn) / (top - 2.0**bits / 32) * 2 ** (1 / 16) * 1.003).all()


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_meta8_round_trip_bound_and_cost_against_fp16_meta(bits):
    x = _randn(64, 32, 64, seed=bits) * torch.linspace(0.1, 5, 64) + torch.linspace(-3, 3, 64)
    for quantize, dequantize, per_channel in ((quantize_per_channel, dequantize_per_channel, True),
                                              (quantize_per_token, dequantize_per_token, False)):
        codes, c, z = quantize(x, bits, meta_bits=8)
        s, zero = decode_meta(c, z, 8, bits)
        x_hat = dequantize(codes, s, zero)
        assert ((x - x_hat).abs() <= (s.unsqueeze(-2) if per_channel else s) / 2 + 1e-5).all()   # fp32 rounding
        fp16 = dequantize(*quantize(x, bits))
        assert ((x - x_hat) ** 2).mean() <= 1.3 * ((x - fp16) ** 2).mean()


def test_meta8_far_offsets_coarsen_the_scale_instead_of_clipping():
    x = torch.linspace(100.0, 101.0, 32)[:, None].repeat(1, 4)           # 100 ranges from 0
    codes, c, z = quantize_per_channel(x, 4, meta_bits=8)
    s, zero = decode_meta(c, z, 8, 4)
    assert (z == 127).all() or ((z > -128) & (z < 127)).all()
    x_hat = dequantize_per_channel(codes, s, zero)
    assert ((x - x_hat).abs() <= s / 2 * (1 + 1e-6)).all()                  # covered: no clipping
    assert (s > 1.0 / 15).all()                                              # coarser than min-max


def test_meta8_bytes_round_trip():
    x = _randn(3, 5, 32, seed=9) * 4 + 1
    for meta_bits, pair in ((8, 2), (16, 4)):
        codes, scale, zero = quantize_per_token(x, 4, 8, meta_bits)
        raw = meta_to_bytes(scale, zero)
        assert raw.dtype == torch.uint8 and raw.shape == (3, 5, 4 * pair)
        got = meta_from_bytes(raw, meta_bits, 4, (3, 5, 4))
        for a, b in zip(got, decode_meta(scale, zero, meta_bits, 4)):
            assert torch.equal(a.float(), b.float())
        assert torch.equal(round_trip_per_token(x, 4, 8, meta_bits), dequantize_per_token(codes, *got, 8))
