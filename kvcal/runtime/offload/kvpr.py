"""KVPR partial-recompute offloading: the per-layer cost model and the split solver (pure Python, no torch).

Based on Jiang et al., "KVPR: Efficient LLM Inference with I/O-Aware KV Cache Partial Recomputation", Eq. 6-11.
The KV cache lives on the host. For one layer and one decode step, the host sends the layer input ``X[0:l]`` of ``l``
kept tokens, and the device recomputes their K/V from it, while the KV of the other ``s - l`` kept tokens comes over
the same link. ``l`` trades link bytes for device FLOPs.

Paper notation -> this module (per layer, per decode step; b = ``batch``, s' = ``tokens``):

* p (bytes/element, undefined in the paper)  -> ``x_bytes_per_elem`` for X; the stored KV has its own byte count.
* Eq. 6  M_X[0:l] = b·l·h·p                  -> ``x_transfer_time`` = b·l·β_X / v_com, β_X = h·p_X
* Eq. 6  M_KV[l:s'] = 2·b·(s'-l)·h·p         -> ``kv_transfer_time`` = b·(s'-l)·β_KV / v_com, β_KV = stored B/token
* Eq. 8/9 N = 4·b·l·h², t_recomp = N / v_gpu -> ``recompute_time`` = b·l·φ / v_gpu, φ = 2·h·2·h_kv·d (+ extra)
* Eq. 10 t = M_X/v_com + max(t_recomp, M_KV/v_com)   -> ``Schedule.COLUMN`` (throughput schedule, the default)
* row-by-row: Eq. 10 without the X term              -> ``Schedule.ROW`` (latency schedule)
* Eq. 11 min_l t s.t. 0 <= l <= bound                -> ``solve_split`` (closed form) / ``solve_split_brute``

Each transfer and each recompute kernel that actually runs (nonzero size) also pays a fixed latency; the paper has
none (§7-D), so both default to 0. Only recompute counts as device work: Q/O projections, attention, the FFN and the
weight loads are outside the model, as in the paper (§7-H, §7-I).

Closed form. Write a = b·β_X/v_com, c = b·φ/v_gpu, d = b·β_KV/v_com. For 0 < l < s' every fixed latency is paid, so
t(l) is a linear term plus the max of two lines: convex and piecewise linear, with one breakpoint where the two lines
cross (``l_balance``; without latencies l_bal = d·s'/(c+d) for ROW/COLUMN). The integer optimum is therefore among
l = 0, the upper bound, the ends of the interior range and the two integers around l_bal; the solver evaluates just
those (plus a short bisection for ties, below). Without latencies, COLUMN gives l* = 0 exactly when β_X >= β_KV
(left of l_bal the slope is a - d) or when a + c >= d·s' (one token's X plus its recompute already costs as much as
all the KV); ROW gives l* = 0 exactly when c >= d·s'; PIPELINED when β_X >= β_KV or c >= d·s'. For uncompressed
GQA with X and KV in one dtype, β_X >= β_KV reads h >= 2·h_kv·d: recompute never wins.

Ties. Times within a relative 1e-9 of the minimum count as equal (float rounding makes an exact plateau such as
β_X == β_KV wiggle by ~1e-16) and the smallest such l wins: recompute costs device work and host memory for X, so it
is not worth doing for no gain. An exact floor/ceil tie around l_bal thus goes to the floor, and the closed form
bisects the convex interior for the first l inside the band, so it returns the same l as ``solve_split_brute``.
Monotonicity (faster device: l* never drops; faster link: l* never rises) holds for exact minima; the band can
reverse it only between two l whose times tie.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

_TIE_RTOL = 1e-9  # relative time difference below which two splits count as equal (see module docstring)


class Schedule(StrEnum):
    """How the step time combines the three terms (the paper's two schedules plus a pipelined reading, §7-G).

    ROW ignores X's bytes, which is optimistic since X shares the link; where β_X >= β_KV prefer COLUMN (§6).
    """

    ROW = "row"  # latency schedule: max(recompute, KV transfer); X is assumed off the critical path
    COLUMN = "column"  # throughput schedule, Eq. 10: X transfer, then max(recompute, KV transfer)
    PIPELINED = "pipelined"  # steady state of a prefetching pipeline: max(link busy = X + KV, device busy = recompute)


def _int(name: str, value: object, low: int) -> int:
    try:
        value = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}") from None
    if value < low:
        raise ValueError(f"`{name}` must be an integer >= {low}, got {value}")
    return value


def _real(name: str, value: object, *, positive: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0 if positive else value >= 0)  # type: ignore[operator]
    if not ok:
        raise ValueError(f"`{name}` must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class LayerWorkload:
    """One layer's decode step in kvcal's terms. Defaults: an OPT-6.7B layer as in the paper's Table 1.

    X is the input of the K/V projections, i.e. the hidden state *after* the attention input norm (Llama/Qwen2
    ``input_layernorm``, OPT ``self_attn_layer_norm``), ``[batch, tokens, hidden]``. Recompute is then exactly what
    prefill ran to make K/V: ``X·W_K (+b_K)``, RoPE at the token's original position, kvcal's post-RoPE K rotation
    to rank, and ``X·W_V (+b_V)`` with its basis; no norm kernel and no dependence on other tokens. The pre-norm
    residual would also be exact but adds a norm to every recompute (§7-A). Its width is ``hidden_size`` in every
    supported family (not heads·head_dim, which differs in Gemma3).
    """

    batch: int = 32  # b: sequences in the step (Table 1 uses 32)
    tokens: int = 1024  # s': KV tokens kept per sequence after pruning; pruned tokens cost nothing and are absent
    hidden: int = 4096  # h: width of X (see class docstring); OPT-6.7B
    kv_heads: int = 32  # h_kv: KV heads; GQA makes h_kv·d much smaller than h
    head_dim: int = 128  # d: per-head K/V width before any low-rank projection
    x_bytes_per_elem: float = 2.0  # p_X: bytes per element of X on the host (fp16/bf16 activations)
    kv_bytes_per_token: float | None = None  # β_KV: stored K+V bytes per token, all KV heads, as kvcal holds them
    # (ranks x bits / 8 plus scales/zeros); None = uncompressed, 2·h_kv·d·p_X, the paper's 2·h·p when h_kv·d = h
    extra_flops_per_token: float = 0.0  # work beyond the K/V GEMMs, e.g. kvcal's K rotation 2·d·r_k per KV head
    # (post-RoPE, so it cannot fold into W_K); RoPE and quantization are a few FLOPs per element and ignored
    x_tokens: int | None = None  # kept tokens whose X the host holds, the bound on l; None = all (§7-B: Eq. 11
    # bounds l by the prompt length, the text by s'; kvcal stores X for every kept token)

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # the dataclass is frozen
        for name, low in (("batch", 1), ("tokens", 0), ("hidden", 1), ("kv_heads", 1), ("head_dim", 1)):
            put(name, _int(name, getattr(self, name), low))
        put("x_bytes_per_elem", _real("x_bytes_per_elem", self.x_bytes_per_elem, positive=True))
        kv = self.kv_bytes_per_token
        kv = 2.0 * self.kv_heads * self.head_dim * self.x_bytes_per_elem if kv is None else kv
        put("kv_bytes_per_token", _real("kv_bytes_per_token", kv, positive=True))
        put("extra_flops_per_token", _real("extra_flops_per_token", self.extra_flops_per_token, positive=False))
        if self.x_tokens is not None:
            put("x_tokens", _int("x_tokens", self.x_tokens, 0))

    @property
    def x_token_bytes(self) -> float:
        """β_X = h·p_X: host bytes of X for one token (B)."""
        return self.hidden * self.x_bytes_per_elem

    @property
    def kv_token_bytes(self) -> float:
        """β_KV: stored K+V bytes for one token (B)."""
        return self.kv_bytes_per_token  # type: ignore[return-value]  # resolved in __post_init__

    @property
    def recompute_flops_per_token(self) -> float:
        """φ = 2·h·(k_dim + v_dim) + extra, k_dim = v_dim = h_kv·d (FLOP); MHA gives Eq. 8's 4·h²."""
        return 2.0 * self.hidden * 2 * self.kv_heads * self.head_dim + self.extra_flops_per_token

    @property
    def max_recompute(self) -> int:
        """Upper bound on l: kept tokens whose X is on the host."""
        return self.tokens if self.x_tokens is None else min(self.x_tokens, self.tokens)


@dataclass(frozen=True)
class Hardware:
    """Host->device link and device speed, profiled once as in the paper (§2.1). Defaults: A100 + PCIe 4.0 x16."""

    link_bytes_per_s: float = 32 * 2**30  # v_com: H2D bytes/s for X and KV alike; the paper's "32 GB/s" is GiB/s
    matmul_flops_per_s: float = 312e12  # v_gpu: achieved K/V-projection FLOP/s; A100 dense FP16 peak, measure yours
    link_latency_s: float = 0.0  # fixed cost of each H2D transfer that runs; the paper has none
    kernel_latency_s: float = 0.0  # fixed cost of the recompute launch when l > 0; the paper has none

    def __post_init__(self) -> None:
        for name in ("link_bytes_per_s", "matmul_flops_per_s"):
            object.__setattr__(self, name, _real(name, getattr(self, name), positive=True))
        for name in ("link_latency_s", "kernel_latency_s"):
            object.__setattr__(self, name, _real(name, getattr(self, name), positive=False))


def _schedule(mode: Schedule | str) -> Schedule:
    try:
        return Schedule(mode)
    except ValueError:
        raise ValueError(f"`mode` must be one of {[m.value for m in Schedule]}, got {mode!r}") from None


def _check_l(w: LayerWorkload, l: int) -> int:
    l = _int("l", l, 0)
    if l > w.tokens:
        raise ValueError(f"`l` must be <= tokens = {w.tokens}, got {l}")
    return l


# ---- cost model (Eq. 6-10) -------------------------------------------------------------------------------------


def x_transfer_time(w: LayerWorkload, hw: Hardware, l: int) -> float:
    """Seconds to send X[0:l] (Eq. 6 / v_com): b·l·β_X / v_com, plus the link latency when l > 0."""
    l = _check_l(w, l)
    return 0.0 if l == 0 else hw.link_latency_s + w.batch * l * w.x_token_bytes / hw.link_bytes_per_s


def kv_transfer_time(w: LayerWorkload, hw: Hardware, l: int) -> float:
    """Seconds to send the stored KV[l:s'] (Eq. 6 / v_com): b·(s'-l)·β_KV / v_com, plus the latency when l < s'."""
    n = w.tokens - _check_l(w, l)
    return 0.0 if n == 0 else hw.link_latency_s + w.batch * n * w.kv_token_bytes / hw.link_bytes_per_s


def recompute_time(w: LayerWorkload, hw: Hardware, l: int) -> float:
    """Seconds to recompute KV[0:l] from X (Eq. 8-9): b·l·φ / v_gpu, plus the kernel latency when l > 0."""
    l = _check_l(w, l)
    return 0.0 if l == 0 else hw.kernel_latency_s + w.batch * l * w.recompute_flops_per_token / hw.matmul_flops_per_s


def step_time(w: LayerWorkload, hw: Hardware, l: int, mode: Schedule | str = Schedule.COLUMN) -> float:
    """Predicted seconds for this layer's step with split l (Eq. 10 for COLUMN; see ``Schedule``)."""
    mode = _schedule(mode)
    tx, tkv, tr = x_transfer_time(w, hw, l), kv_transfer_time(w, hw, l), recompute_time(w, hw, l)
    if mode is Schedule.ROW:
        return max(tr, tkv)
    if mode is Schedule.COLUMN:
        return tx + max(tr, tkv)  # one link: X first, then the KV suffix streams while the device recomputes
    return max(tx + tkv, tr)


def balance_point(w: LayerWorkload, hw: Hardware, mode: Schedule | str = Schedule.COLUMN) -> float:
    """Real l where recompute and the transfer it overlaps meet, fixed latencies included (nan: lines parallel).

    ROW/COLUMN: c·l + L_k = d·(s'-l) + L_l  ->  l = (d·s' + L_l - L_k) / (c + d)
    PIPELINED:  c·l + L_k = a·l + d·(s'-l) + 2·L_l  ->  l = (d·s' + 2·L_l - L_k) / (c + d - a)
    """
    mode = _schedule(mode)
    a = w.batch * w.x_token_bytes / hw.link_bytes_per_s
    c = w.batch * w.recompute_flops_per_token / hw.matmul_flops_per_s
    d = w.batch * w.kv_token_bytes / hw.link_bytes_per_s
    links = 2 if mode is Schedule.PIPELINED else 1
    num = d * w.tokens + links * hw.link_latency_s - hw.kernel_latency_s
    den = c + d - (a if mode is Schedule.PIPELINED else 0.0)
    return num / den if den != 0 else math.nan


# ---- solver (Eq. 11) -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """The chosen split of one layer: recompute KV[0:l] from X, transfer KV[l:tokens]."""

    l: int  # tokens recomputed from X
    tokens: int  # s': kept tokens per sequence
    time_s: float  # predicted step time at l
    baseline_s: float  # predicted step time at l = 0 (plain offloading)
    l_balance: float  # real-valued balance point (may lie outside [0, tokens]; nan if none)
    mode: Schedule  # schedule the times refer to
    reason: str = ""  # one line: why this l

    @property
    def speedup(self) -> float:
        """baseline / time (1.0 when both are 0)."""
        return 1.0 if self.time_s == 0 else self.baseline_s / self.time_s


def _pick(times: dict[int, float]) -> int:
    best = min(times.values())
    return min(l for l, t in times.items() if t <= best * (1 + _TIE_RTOL))


def _reason(w: LayerWorkload, mode: Schedule, l: int, l_bal: float) -> str:
    s, bound = w.tokens, w.max_recompute
    if s == 0:
        return "no kept tokens: nothing to transfer or recompute"
    if l == 0:
        if bound == 0:
            return "recompute impossible: the host holds no X for this layer (x_tokens = 0)"
        if mode is not Schedule.ROW and w.x_token_bytes >= w.kv_token_bytes:
            return (
                f"recompute never wins: X costs {w.x_token_bytes:g} B/token vs {w.kv_token_bytes:g} B/token "
                "of stored KV"
            )
        return f"recompute does not pay: no split beats sending all KV (balance point {l_bal:.3g})"
    if l == s:
        return f"recompute everything: recomputing all {s} tokens beats sending any KV"
    if l == bound:
        return f"capped by x_tokens: recompute all {l} tokens with X on the host (balance point {l_bal:.1f})"
    return f"balanced: recompute {l} of {s} tokens while the KV of the other {s - l} transfers"


def _split(w: LayerWorkload, hw: Hardware, mode: Schedule, times: dict[int, float]) -> Split:
    l, l_bal = _pick(times), balance_point(w, hw, mode)
    return Split(l, w.tokens, times[l], step_time(w, hw, 0, mode), l_bal, mode, _reason(w, mode, l, l_bal))


def solve_split(w: LayerWorkload, hw: Hardware, mode: Schedule | str = Schedule.COLUMN) -> Split:
    """Closed-form optimal l (Eq. 11): evaluate t at 0, the bound, the interior ends and floor/ceil(l_balance)."""
    mode = _schedule(mode)
    bound = w.max_recompute
    cands = {0, bound}
    hi = min(bound, w.tokens - 1)  # interior 1..hi: every fixed latency is paid there, so t is convex on it
    if hi >= 1:
        cands |= {1, hi}
        l_bal = balance_point(w, hw, mode)
        if not math.isnan(l_bal):
            k = min(max(l_bal, 1.0), float(hi))  # clamp before floor/ceil: l_bal may be +-inf or far outside
            cands |= {math.floor(k), math.ceil(k)}
    times = {l: step_time(w, hw, l, mode) for l in cands}
    # Ties: the interior l within the tie band form one run (t is convex there); bisect for its first member, so the
    # closed form returns the smallest near-optimal l exactly as the brute force does, not just any tied candidate.
    thr = min(times.values()) * (1 + _TIE_RTOL)
    lo, first = 1, min((l for l in cands if 1 <= l <= hi and times[l] <= thr), default=1)
    while lo < first:
        mid = (lo + first) // 2
        times[mid] = step_time(w, hw, mid, mode)
        lo, first = (lo, mid) if times[mid] <= thr else (mid + 1, first)
    return _split(w, hw, mode, times)


def solve_split_brute(w: LayerWorkload, hw: Hardware, mode: Schedule | str = Schedule.COLUMN) -> Split:
    """Reference solver: evaluate t(l) for every l = 0..bound (O(s'); a test oracle, not for the decode loop)."""
    mode = _schedule(mode)
    return _split(w, hw, mode, {l: step_time(w, hw, l, mode) for l in range(w.max_recompute + 1)})


def solve_model(layers: Sequence[LayerWorkload], hw: Hardware, mode: Schedule | str = Schedule.COLUMN) -> list[Split]:
    """One split per layer. The paper uses one l for all layers; kvcal's ranks (hence β_KV) differ per layer."""
    return [solve_split(w, hw, mode) for w in layers]


# ---- paper Table 1 ---------------------------------------------------------------------------------------------

# OPT models of Table 1: hidden size h and attention heads (MHA, head_dim 128, so h_kv·d = h).
OPT_TABLE1 = {"OPT-6.7B": (4096, 32), "OPT-13B": (5120, 40), "OPT-30B": (7168, 56)}


@dataclass(frozen=True)
class Table1Row:
    """One row of the paper's Table 1: per-layer KV size and its PCIe transfer time."""

    model: str  # OPT model name
    hidden: int  # h
    kv_mib: float  # per-layer K+V bytes / 2**20 (the paper's "MB")
    transfer_ms: float  # the paper's "PCIe latency (ms)"


def table1(batch: int = 32, tokens: int = 1024, hw: Hardware | None = None) -> list[Table1Row]:
    """Reproduce Table 1's KV size and PCIe columns: ``kv_transfer_time`` at l = 0 for one OPT layer, fp16.

    bytes = 2 (K,V) · b · s · h · 2 B; OPT-6.7B: 2·32·1024·4096·2 = 536,870,912 B = 512 MiB, and
    512 MiB / 32 GiB/s = 1/64 s = 15.625 ms (printed 15.6). OPT-13B: 640 MiB -> 19.531 ms (19.5); OPT-30B:
    896 MiB -> 27.344 ms (27.3). With 32e9 B/s instead, 6.7B would take 16.8 ms, so the paper's GB/s means GiB/s.
    The "Comp. latency" column is attention reading the KV from HBM, not recompute; it is not modelled here.
    """
    hw = hw or Hardware(link_bytes_per_s=32 * 2**30)
    rows = []
    for model, (hidden, heads) in OPT_TABLE1.items():
        w = LayerWorkload(batch=batch, tokens=tokens, hidden=hidden, kv_heads=heads, head_dim=hidden // heads)
        mib = w.batch * w.tokens * w.kv_token_bytes / 2**20
        rows.append(Table1Row(model, hidden, mib, 1e3 * kv_transfer_time(w, hw, 0)))
    return rows
