"""Tests for kvcal.runtime.offload.kvpr: KVPR's cost model (Eq. 6-10), the split solver (Eq. 11) and the paper's
Table 1."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcal.runtime.offload.kvpr import (
    Hardware,
    LayerWorkload,
    Schedule,
    balance_point,
    kv_transfer_time,
    recompute_time,
    solve_model,
    solve_split,
    solve_split_brute,
    step_time,
    table1,
    x_transfer_time,
)

A100 = Hardware(link_bytes_per_s=32 * 2**30, matmul_flops_per_s=312e12)
MODES = list(Schedule)

# ---- strategies ------------------------------------------------------------------------------------------------

workloads = st.builds(
    LayerWorkload,
    batch=st.integers(1, 64),
    tokens=st.integers(0, 300),  # the brute-force oracle is O(tokens)
    hidden=st.integers(1, 8192),
    kv_heads=st.integers(1, 64),
    head_dim=st.sampled_from([1, 16, 64, 128, 256]),
    x_bytes_per_elem=st.sampled_from([0.5, 0.5625, 1.0, 2.0, 4.0]),
    kv_bytes_per_token=st.none() | st.floats(0.01, 1e6),
    extra_flops_per_token=st.just(0.0) | st.floats(0, 1e7),
    x_tokens=st.none() | st.integers(0, 320),
)
hardware = st.builds(
    Hardware,
    link_bytes_per_s=st.floats(1e3, 1e30),  # up to "bandwidth huge"
    matmul_flops_per_s=st.floats(1e-3, 1e30),  # down to "compute tiny"
    link_latency_s=st.just(0.0) | st.floats(0, 1e-2),
    kernel_latency_s=st.just(0.0) | st.floats(0, 1e-2),
)
no_latency_hw = st.builds(Hardware, link_bytes_per_s=st.floats(1e6, 1e14), matmul_flops_per_s=st.floats(1e6, 1e17))


# ---- cost model ------------------------------------------------------------------------------------------------


def test_terms_match_paper_equations_for_mha():
    # OPT-6.7B layer, fp16: Eq. 6 (bytes), Eq. 8 (4·b·l·h² FLOPs), Eq. 10 (column step time), row = Eq. 10 minus X.
    b, s, h, p = 32, 1024, 4096, 2
    w = LayerWorkload(batch=b, tokens=s, hidden=h, kv_heads=32, head_dim=128, x_bytes_per_elem=p)
    v_com, v_gpu = A100.link_bytes_per_s, A100.matmul_flops_per_s
    assert w.recompute_flops_per_token == 4 * h * h
    for l in (0, 1, 300, 1023, 1024):
        tx, tkv, tr = b * l * h * p / v_com, 2 * b * (s - l) * h * p / v_com, 4 * b * l * h * h / v_gpu
        assert x_transfer_time(w, A100, l) == pytest.approx(tx, rel=1e-12, abs=0)
        assert kv_transfer_time(w, A100, l) == pytest.approx(tkv, rel=1e-12, abs=0)
        assert recompute_time(w, A100, l) == pytest.approx(tr, rel=1e-12, abs=0)
        assert step_time(w, A100, l, "column") == pytest.approx(tx + max(tr, tkv), rel=1e-12, abs=0)
        assert step_time(w, A100, l, "row") == pytest.approx(max(tr, tkv), rel=1e-12, abs=0)
        assert step_time(w, A100, l, "pipelined") == pytest.approx(max(tx + tkv, tr), rel=1e-12, abs=0)


def test_fixed_latencies_are_paid_only_by_transfers_and_kernels_that_run():
    w = LayerWorkload(batch=1, tokens=4, hidden=4, kv_heads=1, head_dim=4)
    hw = Hardware(link_bytes_per_s=1e30, matmul_flops_per_s=1e30, link_latency_s=1.0, kernel_latency_s=10.0)
    assert [x_transfer_time(w, hw, l) for l in (0, 2, 4)] == pytest.approx([0, 1, 1])
    assert [kv_transfer_time(w, hw, l) for l in (0, 2, 4)] == pytest.approx([1, 1, 0])
    assert [recompute_time(w, hw, l) for l in (0, 2, 4)] == pytest.approx([0, 10, 10])


def test_table1_reproduced():
    rows = table1()
    assert [r.model for r in rows] == ["OPT-6.7B", "OPT-13B", "OPT-30B"]
    assert [r.hidden for r in rows] == [4096, 5120, 7168]
    assert [r.kv_mib for r in rows] == [512, 640, 896]  # the paper's "KV cache (MB)"
    assert [round(r.transfer_ms, 1) for r in rows] == [15.6, 19.5, 27.3]  # printed precision
    assert [r.transfer_ms for r in rows] == pytest.approx([15.625, 19.53125, 27.34375], rel=1e-12)
    # Decimal GB/s would not match: the paper's 32 GB/s is 32 GiB/s.
    assert round(table1(hw=Hardware(link_bytes_per_s=32e9))[0].transfer_ms, 1) != 15.6


def test_digest_worked_example():
    # Digest §1.4: b=32, s'=1024, h=4096, fp16, 32 GiB/s, 312 TFLOPS -> l*=706; row 4.86 ms, column 10.25 ms.
    w = LayerWorkload(batch=32, tokens=1024, hidden=4096, kv_heads=32, head_dim=128)
    row, col = solve_split(w, A100, "row"), solve_split(w, A100, "column")
    assert row.l == col.l == 706
    assert col.l_balance == pytest.approx(1024 * 2 * 312e12 / (2 * 4096 * 32 * 2**30 + 2 * 312e12))
    assert round(row.time_s * 1e3, 2) == 4.86 and round(col.time_s * 1e3, 2) == 10.25
    assert round(col.baseline_s * 1e3, 2) == 15.62
    assert "balanced" in col.reason


# ---- closed form == brute force --------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(w=workloads, hw=hardware, mode=st.sampled_from(MODES))
def test_closed_form_matches_brute_force(w, hw, mode):
    fast, ref = solve_split(w, hw, mode), solve_split_brute(w, hw, mode)
    assert 0 <= fast.l <= w.max_recompute
    assert fast.time_s == step_time(w, hw, fast.l, mode)
    assert fast.time_s <= ref.time_s * (1 + 2e-9)  # never worse than the true minimum
    assert fast.l == ref.l  # same tie rule: the smallest l within 1e-9 of the minimum time (bisected if needed)
    assert fast.baseline_s == ref.baseline_s and fast.time_s <= fast.baseline_s


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "hw",
    [
        A100,
        Hardware(link_bytes_per_s=1e30),
        Hardware(matmul_flops_per_s=1e-3),
        Hardware(matmul_flops_per_s=1e30),
        Hardware(link_latency_s=1e-3, kernel_latency_s=1e-5),
    ],
    ids=["a100", "link-huge", "compute-tiny", "compute-huge", "latencies"],
)
def test_edge_cases_closed_form_matches_brute_force(mode, tokens, hw):
    w = LayerWorkload(batch=4, tokens=tokens, hidden=256, kv_heads=2, head_dim=128)  # β_X = 512 < β_KV = 1024
    fast, ref = solve_split(w, hw, mode), solve_split_brute(w, hw, mode)
    assert (fast.l, fast.time_s) == (ref.l, ref.time_s)


def test_edge_case_outcomes():
    w = LayerWorkload(batch=4, tokens=512, hidden=4096, kv_heads=32, head_dim=128)
    empty = solve_split(LayerWorkload(tokens=0), A100)
    assert (empty.l, empty.time_s, empty.speedup) == (0, 0.0, 1.0) and "no kept tokens" in empty.reason
    assert solve_split(w, Hardware(link_bytes_per_s=1e30)).l == 0  # free link: nothing to save
    assert solve_split(w, Hardware(matmul_flops_per_s=1e-3)).l == 0  # glacial device
    everything = solve_split(w, Hardware(matmul_flops_per_s=1e30))
    assert everything.l == 512 and everything.reason.startswith("recompute everything")
    capped = solve_split(LayerWorkload(batch=4, tokens=512, hidden=4096, kv_heads=32, head_dim=128, x_tokens=100), A100)
    assert capped.l == 100 and capped.reason.startswith("capped by x_tokens")
    none_held = solve_split(LayerWorkload(x_tokens=0), A100)
    assert none_held.l == 0 and "x_tokens = 0" in none_held.reason


def test_exact_tie_between_floor_and_ceil_picks_the_smaller_l():
    # φ = 2·4·2·1·4 = 64 FLOP, β_KV = 16 B; c = d = 1 s/token; row, s'=3: t(1) = max(1, 2) = 2 = t(2) = max(2, 1).
    w = LayerWorkload(batch=1, tokens=3, hidden=4, kv_heads=1, head_dim=4)
    hw = Hardware(link_bytes_per_s=16.0, matmul_flops_per_s=64.0)
    assert [step_time(w, hw, l, "row") for l in range(4)] == [3.0, 2.0, 2.0, 3.0]
    assert balance_point(w, hw, "row") == 1.5
    assert solve_split(w, hw, "row").l == solve_split_brute(w, hw, "row").l == 1


# ---- when recompute cannot win ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hidden, kv_heads, head_dim, wins",
    [
        (4096, 8, 128, False),  # Llama-3-8B: h = 4096 >= 2·h_kv·d = 2048
        (576, 3, 64, False),  # SmolLM2-135M: 576 >= 384
        (4096, 16, 128, False),  # boundary h == 2·h_kv·d: a tie, and ties go to l = 0
        (4096, 17, 128, True),  # just past it: 4096 < 4352
        (4096, 32, 128, True),  # MHA (OPT-6.7B, LLaMa2-7B)
    ],
)
@pytest.mark.parametrize("mode", [Schedule.COLUMN, Schedule.PIPELINED])
def test_gqa_inequality_uncompressed(hidden, kv_heads, head_dim, wins, mode):
    # X and KV in one dtype: β_X = h·p, β_KV = 2·h_kv·d·p, so recompute can win only if h < 2·h_kv·d.
    w = LayerWorkload(batch=8, tokens=2048, hidden=hidden, kv_heads=kv_heads, head_dim=head_dim)
    split = solve_split(w, A100, mode)
    assert (split.l > 0) == wins
    if not wins:
        assert split.reason == (
            f"recompute never wins: X costs {2 * hidden} B/token vs {4 * kv_heads * head_dim} B/token of stored KV"
        )


def test_compressed_kv_inequality_both_sides():
    # kvcal's stored KV: l* = 0 iff β_X = h·p_X >= β_KV (column mode, no fixed latencies, a + c < d·s').
    def split(kv_bytes):
        return solve_split(
            LayerWorkload(tokens=4096, hidden=576, kv_heads=3, head_dim=64, kv_bytes_per_token=kv_bytes), A100
        )

    assert split(96).reason == "recompute never wins: X costs 1152 B/token vs 96 B/token of stored KV"
    assert split(1152).l == 0 and split(1152).reason.startswith("recompute never wins")
    assert split(1153).l > 0 and split(1153).time_s < split(1153).baseline_s


@settings(max_examples=300, deadline=None)
@given(
    w=workloads.filter(lambda w: w.tokens >= 1 and w.x_tokens is None), hw=no_latency_hw, mode=st.sampled_from(MODES)
)
def test_exact_l_zero_criterion(w, hw, mode):
    # Per-token a = b·β_X/v_com, c = b·φ/v_gpu, d = b·β_KV/v_com. With no fixed latencies t(l) is convex on [0, s'],
    # so l* = 0 iff t(1) >= t(0): COLUMN a + max(c, d(s'-1)) >= d·s' <=> β_X >= β_KV or a + c >= d·s';
    # ROW c >= d·s'; PIPELINED β_X >= β_KV or c >= d·s'.
    a = w.batch * w.x_token_bytes / hw.link_bytes_per_s
    c = w.batch * w.recompute_flops_per_token / hw.matmul_flops_per_s
    d = w.batch * w.kv_token_bytes / hw.link_bytes_per_s
    s = w.tokens
    assume(abs(w.x_token_bytes - w.kv_token_bytes) > 1e-6 * w.kv_token_bytes)  # clear of rounding at the boundary
    assume(abs(a + c - d * s) > 1e-6 * d * s and abs(c - d * s) > 1e-6 * d * s)
    x_heavy = w.x_token_bytes >= w.kv_token_bytes
    expect_zero = {
        Schedule.COLUMN: x_heavy or a + c >= d * s,
        Schedule.ROW: c >= d * s,
        Schedule.PIPELINED: x_heavy or c >= d * s,
    }[mode]
    assert (solve_split(w, hw, mode).l == 0) == expect_zero


# ---- monotonicity -----------------------------------------------------------------------------------------------


def _tied(w, hws, mode, l1, l2) -> bool:
    # Monotonicity is exact for exact minima; the 1e-9 tie band (smallest l wins) can move an l whose gain is below
    # it, so a reversal is allowed only between two l that tie under one of the two machines.
    return any(math.isclose(step_time(w, hw, l1, mode), step_time(w, hw, l2, mode), rel_tol=2e-9) for hw in hws)


@settings(max_examples=300, deadline=None)
@given(w=workloads, hw=hardware, mode=st.sampled_from(MODES), k=st.floats(1.0, 1e3))
def test_faster_compute_never_lowers_l(w, hw, mode, k):
    fast = Hardware(hw.link_bytes_per_s, hw.matmul_flops_per_s * k, hw.link_latency_s, hw.kernel_latency_s)
    l_fast, l_slow = solve_split(w, fast, mode).l, solve_split(w, hw, mode).l
    assert l_fast >= l_slow or _tied(w, (hw, fast), mode, l_fast, l_slow)


@settings(max_examples=300, deadline=None)
@given(w=workloads, hw=hardware, mode=st.sampled_from(MODES), k=st.floats(1.0, 1e3))
def test_faster_link_never_raises_l(w, hw, mode, k):
    fast = Hardware(hw.link_bytes_per_s * k, hw.matmul_flops_per_s, hw.link_latency_s, hw.kernel_latency_s)
    l_fast, l_slow = solve_split(w, fast, mode).l, solve_split(w, hw, mode).l
    assert l_fast <= l_slow or _tied(w, (hw, fast), mode, l_fast, l_slow)


def test_monotonicity_reversal_needs_a_tie():
    # Found by fuzzing: β_KV = β_X·(1 + 1e-7) makes recompute gain ~1e-12 of the step per token on a slow link, inside
    # the tie band, so l = 123 (smallest tied) beats 124; a 183x faster link widens the gain past the band -> 124.
    w = LayerWorkload(
        batch=27,
        tokens=124,
        hidden=7721,
        kv_heads=21,
        head_dim=64,
        x_bytes_per_elem=1.0,
        kv_bytes_per_token=7721.0007721,
    )
    slow = Hardware(link_bytes_per_s=18318.846187415977, matmul_flops_per_s=140917524783.2864, link_latency_s=2.85e-08)
    fast = Hardware(slow.link_bytes_per_s * 182.68, slow.matmul_flops_per_s, slow.link_latency_s)
    l_slow, l_fast = solve_split(w, slow, "pipelined").l, solve_split(w, fast, "pipelined").l
    assert (l_slow, l_fast) == (123, 124) and _tied(w, (slow,), "pipelined", 123, 124)


def test_l_independent_of_batch_and_non_decreasing_in_tokens():
    base = dict(hidden=4096, kv_heads=32, head_dim=128)
    for mode in MODES:
        ls = [solve_split(LayerWorkload(batch=b, tokens=1000, **base), A100, mode).l for b in (1, 2, 8, 64)]
        assert len(set(ls)) == 1
        by_s = [solve_split(LayerWorkload(batch=4, tokens=s, **base), A100, mode).l for s in range(0, 600, 7)]
        assert by_s == sorted(by_s)


def test_pipelined_never_slower_than_column():
    w = LayerWorkload(batch=16, tokens=777, hidden=2048, kv_heads=16, head_dim=128)
    assert all(step_time(w, A100, l, "pipelined") <= step_time(w, A100, l, "column") for l in range(0, 778, 37))


# ---- whole model --------------------------------------------------------------------------------------------------


def test_solve_model_per_layer():
    # kvcal ranks differ per layer, so β_KV does too: a layer compressed below β_X keeps l = 0, the others recompute.
    layers = [
        LayerWorkload(tokens=2048, hidden=1024, kv_heads=8, head_dim=64, kv_bytes_per_token=kv)
        for kv in (3072.0, 512.0, 8192.0)
    ]  # β_X = 2048
    splits = solve_model(layers, A100)
    assert [s.l for s in splits] == [solve_split(w, A100).l for w in layers]
    assert splits[1].l == 0 and splits[0].l > 0 and splits[2].l > splits[0].l
    assert solve_model([], A100) == []


# ---- validation ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: LayerWorkload(batch=0), "batch"),
        (lambda: LayerWorkload(batch=1.5), "batch"),
        (lambda: LayerWorkload(tokens=-1), "tokens"),
        (lambda: LayerWorkload(hidden=0), "hidden"),
        (lambda: LayerWorkload(kv_heads=0), "kv_heads"),
        (lambda: LayerWorkload(head_dim=0), "head_dim"),
        (lambda: LayerWorkload(x_bytes_per_elem=0), "x_bytes_per_elem"),
        (lambda: LayerWorkload(kv_bytes_per_token=float("nan")), "kv_bytes_per_token"),
        (lambda: LayerWorkload(kv_bytes_per_token=-1.0), "kv_bytes_per_token"),
        (lambda: LayerWorkload(extra_flops_per_token=-1.0), "extra_flops_per_token"),
        (lambda: LayerWorkload(x_tokens=-1), "x_tokens"),
        (lambda: Hardware(link_bytes_per_s=0), "link_bytes_per_s"),
        (lambda: Hardware(matmul_flops_per_s=float("inf")), "matmul_flops_per_s"),
        (lambda: Hardware(link_latency_s=-1e-6), "link_latency_s"),
        (lambda: Hardware(kernel_latency_s="1us"), "kernel_latency_s"),
        (lambda: step_time(LayerWorkload(tokens=8), A100, 9), "l"),
        (lambda: step_time(LayerWorkload(tokens=8), A100, -1), "l"),
        (lambda: solve_split(LayerWorkload(), A100, "diagonal"), "mode"),
    ],
)
def test_validation_is_one_line_value_error(make, name):
    with pytest.raises(ValueError) as info:
        make()
    msg = str(info.value)
    assert f"`{name}`" in msg and "\n" not in msg
