"""Calibration by quality: choose tiers, key mode and ranks by measured decode fidelity (DiffKV §7.1, FDC §5.2).

Every candidate is measured with the serving runtime itself (`DecodeProbe`: the runtime's write path and decode
path on held-out calibration text), so what the search accepts is what users get. A candidate is feasible when it
meets the `QualityTarget` (top-1 agreement and continuation-perplexity ratio against dense). Among feasible
candidates the search keeps the one with the fewest KV bytes per token, as measured in the page arena.

Stages, each starting from the previous stage's choice; every measured point is kept in `SearchResult.path`:

0. smoothing: with the bundle's channel smoothing factors (`qk.smoothing`), the base high tier alone is measured
   with and without; smoothing is kept for every later stage if it lowers the KL by 10% (it changes no byte);
1. precision: the cheapest high tier of `PRECISION_LADDER` (K8V4, then values in groups of 32 and 16 channels, then
   K8V8) that meets the target;
2. tiers: for each low-tier key mode (per-channel K4cV2, per-token K4V2), the largest feasible alpha_high of
   {1, ..., 5} with no pruning; then the largest feasible alpha_low of `ALPHA_LOW_GRID` (capped at alpha_high), each
   found by bisection over the grid (`last_feasible`), kept only if bytes drop: a low tier that can be pruned keeps
   each token's score and position (8 bytes), which a little pruning does not pay for. Small models need alpha_low
   far above the papers' 0.02-0.1 range to prune anything, so the grid follows the data rather than the paper;
   Alongside, the residual family (KIVI's layout inside DiffKV's tiers): the high tier holds the recent window plus
   the tokens above alpha_high (heavy hitters), in the first of `RESIDUAL_HIGHS` (8-bit, then fp16) that meets the
   target at the family's first point; the low tier has per-channel keys over pages of
   `RESIDUAL_PAGE_TOKENS` low tokens. Per-channel scales survive outlier key channels that a per-token scale spends
   its range on. It walks `RESIDUAL_LOW_TIERS` cheaper and cheaper, with alpha_high over `RESIDUAL_ALPHA_GRID` from
   "every token leaves the window to the low tier" down to keeping more heavy hitters (the first feasible, or a
   later one while it costs under `MIN_GAIN` more bytes: quality the later stages can spend), then (by bisection)
   shorter windows over `RESIDUAL_WINDOWS`, then pruning over `ALPHA_LOW_GRID`. The cheaper of the two families goes on;
   Models with sliding-window layers (Gemma3) then walk `SLIDING_FORMATS` for those layers' window
   (`CompressionConfig.sliding`, per-token formats in the rotated basis, some with the window's newest tokens at 16
   bits: `sliding_recent`), cheaper and cheaper until the target is missed; kept only if bytes drop. Every earlier
   stage already holds them in the first (8-bit) entry. Where the windows hold most of the bytes at the probe's
   context, this runs first, right after the precision stage, and the tiers build on it (`Search.run`);
3. bits: per-layer precision of the low tier and of sliding-window layers, keys and values apart (KVTuner-style;
   `Search.layer_bits`). A one-pass estimate (`sensitivity`, kvcal.profile.sensitivity: Fisher-weighted coding
   error) ranks every (layer, side) by the loss halving its bits adds per byte saved; the steps, least sensitive
   first, are then applied as many as stay feasible (bisection over the count), each candidate measured; kept only
   if bytes drop;
4. policies: FastGen's per-head patterns (chosen per prompt at prefill) on top of the tiers, recovery threshold T
   over `RECOVERY_GRID`, descending until the target is missed; kept only if bytes drop. A token FastGen drops is
   pruned whatever its tier; the tokens it keeps are tiered by significance as before;
5. ranks: the FDC removal rate for QK, then for V, ascending over `RATE_GRID` until the target is missed, refined by
   bisection; kept only if bytes drop.

Feasibility is assumed monotone along each grid (more aggressive never gets better), which is what makes early stops
and bisection valid; the path records every point, so a reader can check that assumption.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcal.profile.quality import QualityTarget, wilson_lower  # noqa: F401  (wilson_lower: re-exported)
from kvcal.profile.ranks import ranks_of
from kvcal.profile.sensitivity import SIDES, halved
from kvcal.runtime.config import CompressionConfig, split_sliding_spec
from kvcal.runtime.diffkv import EVERY_TOKEN_LOW
from kvcal.runtime.fastgen import FastGenConfig
from kvcal.runtime.layout import RAW_BITS, TierFormat
from kvcal.runtime.quant import packed_size

logger = logging.getLogger(__name__)

ALPHA_HIGH_GRID = (1.0, 2.0, 3.0, 4.0, 5.0)
ALPHA_LOW_GRID = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
LOW_TIERS = ("K4cV2m8", "K4V2m8")
# high tiers by bytes: 4-bit values with one (scale, zero) per token, per 32 and per 16 channels, then 8-bit values
# (value groups sit between K8V4 and K8V8 in bytes and in quality: docs/results, benchmarks/value_groups.py)
PRECISION_LADDER = ("K8V4m8", "K8V4g32m8", "K8V4g16m8", "K8V8m8")
# the residual family's high tier (window and heavy hitters), cheapest first: per-token 8-bit codes, which halve its
# bytes, where they pass; else fp16, KIVI's residual (docs/calibration.md, "An 8-bit high tier")
RESIDUAL_HIGHS = ("K8V8m8", "K16V16")
# by bytes, most precise first; m8: 8-bit scales and zeros (a 4-bit low tier at head dim 64: 70 bytes a token, not
# 76, for a few % more KL: docs/calibration.md)
RESIDUAL_LOW_TIERS = ("K8cV4m8", "K4cV4m8", "K4cV2m8", "K2cV2m8")
# most aggressive first; 256/N and 64/N keep little more than the attention sinks in fp16
RESIDUAL_ALPHA_GRID = (EVERY_TOKEN_LOW, 256.0, 64.0, 16.0, 4.0)
RESIDUAL_WINDOWS = (32, 16)              # shorter windows tried after the base window, longest first
RESIDUAL_PAGE_TOKENS = 32                # per-channel key group (KIVI's G = 32)
# sliding windows, by bytes, most precise first; "+r": the window's r newest tokens at 16 bits (`sliding_recent`,
# where a local layer's 4-bit values lose most: docs/calibration.md, "Where gemma3-270m's error sits"); 4-bit keys
# first with a (scale, zero) per 32 channels, which a head dim of 256 needs (docs/calibration.md, "An 8-bit high
# tier and key groups in sliding layers")
SLIDING_FORMATS = ("K8V8m8", "K8V4m8+32", "K8V4m8+16", "K8V4m8", "K4V4kg32m8", "K4V4m8", "K4V2m8")
RATE_GRID = (0.01, 0.02, 0.04, 0.08, 0.16, 0.3)   # FDC removal rates, ascending: small models fail early
RECOVERY_GRID = (0.98, 0.95, 0.9)                  # FastGen T, descending = more aggressive (paper: 0.91-0.98)
MIN_GAIN = 0.01     # a stage's change is kept only if it saves at least 1% of bytes: not worth risk for less
# smoothing is kept only if it lowers the base point's KL by 10%: one point's KL moves a few % between text samples,
# and the per-channel low tiers the later stages choose gain nothing from it (docs/calibration.md)
SMOOTHING_MIN_GAIN = 0.1


@dataclass
class Point:
    """One measured candidate."""

    stage: str
    label: str
    settings: dict             # the candidate as a bundle settings block (`CompressionConfig.to_dict`)
    bytes_ratio: float         # KV bytes held / fp16 dense bytes of the same tokens
    top1: float
    kl: float
    ppl_ratio: float
    tiers: dict
    feasible: bool
    seconds: float
    predictions: int = 0       # scored predictions behind top-1 and the perplexity ratio
    top1_windows: list = field(default_factory=list)   # top-1 per window (QualityTarget.top1_bound)

    @property
    def config(self) -> CompressionConfig:
        """The measured candidate."""
        return CompressionConfig.from_dict(self.settings)


@dataclass
class SearchResult:
    config: CompressionConfig
    qk_rank: torch.Tensor
    v_rank: torch.Tensor
    chosen: Point
    path: list[Point] = field(default_factory=list)


def largest_feasible(feasible: Callable[[float], bool], grid: tuple[float, ...], iters: int) -> float | None:
    """Largest x with feasible(x), for a feasibility that holds up to some threshold and fails above it: walk the
    ascending `grid` until the first failure, then bisect `iters` times between the last success and that failure.
    None when grid[0] already fails. Cheap when the threshold is low (small models fail on the first point)."""
    ok, bad = None, None
    for x in grid:
        if not feasible(x):
            bad = x
            break
        ok = x
    if ok is None or bad is None:
        return ok
    for _ in range(iters):
        mid = (ok + bad) / 2
        if feasible(mid):
            ok = mid
        else:
            bad = mid
    return ok


def last_feasible(candidates: list, measure: Callable[[object], Point]) -> Point | None:
    """The point of the last feasible candidate, for `candidates` ordered from least to most aggressive whose
    feasibility holds up to some index and fails after it: bisection, about log2(n) + 1 measurements where a walk
    takes up to n. None when none is feasible."""
    lo, hi, best = -1, len(candidates), None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        point = measure(candidates[mid])
        if point.feasible:
            lo, best = mid, point
        else:
            hi = mid
    return best


def _saves(candidate: Point, incumbent: Point) -> bool:
    return candidate.bytes_ratio < incumbent.bytes_ratio * (1 - MIN_GAIN)


def cheapest(points: list[Point]) -> Point | None:
    """The feasible point with the fewest bytes (ties: the earlier, i.e. less aggressive, one)."""
    ok = [p for p in points if p.feasible]
    return min(ok, key=lambda p: p.bytes_ratio) if ok else None


def settings_key(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True)


FASTGEN = FastGenConfig(r_local=0.3, r_frequent=0.3)   # r_l, r_f the probe records; the search varies only T


class Search:
    """Runs the stages against a `DecodeProbe` (see module docstring). Every candidate is a `CompressionConfig`
    whose removal rates give its ranks (`ranks_of`)."""

    def __init__(self, probe, bundle, target: QualityTarget, *, report: Callable[[Point], None] | None = None,
                 memo: dict[str, Point] | None = None, started: Callable[[str, str], None] | None = None,
                 sensitivity: Callable[[CompressionConfig, dict[int, TierFormat]], dict] | None = None):
        self.probe, self.bundle, self.target = probe, bundle, target
        # (config, {layer: format}) -> {(layer, "k_bits" | "v_bits"): loss halving adds} (profile.sensitivity); None
        # skips the bits stage
        self.sensitivity = sensitivity
        self.report = report
        self.started = started      # (stage, label) of a point about to be measured: progress display
        self.memo = memo if memo is not None else {}   # settings key -> point: a resumed search skips known points
        self.path: list[Point] = []

    def measure(self, stage: str, label: str, candidate: CompressionConfig) -> Point:
        if candidate.sliding is not None and "sliding" not in label:   # stages after the sliding one build on it
            label = f"{label}, sliding layers {candidate.sliding_spec}"
        settings = candidate.to_dict()
        qk_rank, v_rank = ranks_of(self.bundle, candidate)
        key = self._key(settings, qk_rank, v_rank)
        if key in self.memo:        # measured before (a resumed run, or other settings with the same effect)
            known = self.memo[key]
            point = known if (known.settings, known.stage) == (settings, stage) else dataclasses.replace(
                known, stage=stage, label=label, settings=settings, seconds=0.0)
            point.feasible = self.target.met(point)
            self.path.append(point)
            return point
        if self.started:
            self.started(stage, label)
        t0 = time.perf_counter()
        bundle = dataclasses.replace(self.bundle, qk_rank=qk_rank, v_rank=v_rank)
        fid = self.probe.measure(candidate, bundle)
        point = Point(stage=stage, label=label, settings=settings, bytes_ratio=fid.memory["ratio_to_fp16"],
                      top1=fid.top1, kl=fid.kl, ppl_ratio=fid.ppl_ratio, tiers=fid.tiers, feasible=False,
                      seconds=round(time.perf_counter() - t0, 2), predictions=fid.predictions,
                      top1_windows=fid.top1_windows)
        point.feasible = self.target.met(point)
        self.path.append(point)
        self.memo[key] = point
        if self.report:
            self.report(point)
        return point

    def _key(self, settings: dict, qk_rank: torch.Tensor, v_rank: torch.Tensor) -> str:
        """Memo key: the settings with removal rates replaced by the ranks they give, so two rates that give the same
        ranks (small rates, or V ranks rounded up to a value group) are measured once."""
        plain = {k: v for k, v in settings.items() if k not in ("qk_removal_rate", "v_removal_rate")}
        full = bool((qk_rank == self.bundle.qk_spectrum.shape[-1]).all()
                    and (v_rank == self.bundle.v_spectrum.shape[-1]).all())
        if not full:     # full ranks keep the plain key, so memos of full-rank points from earlier runs still match
            digest = hashlib.sha256(qk_rank.to(torch.int32).numpy().tobytes() + b"|"
                                    + v_rank.to(torch.int32).numpy().tobytes()).hexdigest()[:16]
            plain["ranks"] = digest
        return settings_key(plain)

    # ----------------------------------------------------------------------------------------------------- stages

    def _groups_split(self, fmt: TierFormat) -> bool:
        """Whether `fmt`'s channel groups divide the head dim into more than one group each: a group that does not
        divide it cannot be laid out, one as wide as the head is the ungrouped format under another name."""
        d = self.bundle.v_spectrum.shape[-1]
        return all(d % g == 0 and g < d for g in (fmt.k_group, fmt.v_group) if g)

    def precision(self, base: CompressionConfig) -> Point:
        """The cheapest high tier of `PRECISION_LADDER` that meets the target (formats whose groups do not split the
        head dim are skipped, `_groups_split`); the first one measured if none does."""
        points = []
        for name in PRECISION_LADDER:
            high = TierFormat.parse(name)
            if not self._groups_split(high):
                continue
            points.append(self.measure("precision", f"{name}, no tiers",
                                       base.with_(high=high).with_tiering(alpha_high=None)))
            if points[-1].feasible:
                return points[-1]
        return points[0]

    def tiers(self, base: CompressionConfig) -> Point | None:
        """For each low tier of `LOW_TIERS`: the largest feasible alpha_high of `ALPHA_HIGH_GRID` with nothing
        pruned, then the largest feasible alpha_low of `ALPHA_LOW_GRID` up to it (each by `last_feasible`); the
        cheapest of the low tiers' results, or None."""
        best = []
        for name in LOW_TIERS:
            low = base.with_(low=TierFormat.parse(name))
            chosen = last_feasible(ALPHA_HIGH_GRID, lambda a_h, low=low, name=name: self.measure(
                "tiers", f"{base.high.name}/{name} a=({a_h:g},0)", low.with_tiering(alpha_high=a_h, alpha_low=0.0)))
            if chosen is None:
                continue
            a_h = chosen.config.tiering.alpha_high
            pruned = last_feasible([a for a in ALPHA_LOW_GRID if a <= a_h],
                                   lambda a_l, c=chosen.config, name=name, a_h=a_h: self.measure(
                                       "tiers", f"{base.high.name}/{name} a=({a_h:g},{a_l:g})",
                                       c.with_tiering(alpha_low=a_l)))
            # pruning makes low tokens movable, so their pages keep score and position: kept only if bytes drop
            best.append(pruned if pruned is not None and _saves(pruned, chosen) else chosen)
        return cheapest(best) if best else None

    def residual(self, base: CompressionConfig) -> Point | None:
        """The residual family (module docstring, stage 2): the cheapest feasible point, or None."""
        start = base.with_(page_tokens=RESIDUAL_PAGE_TOKENS)
        for high in RESIDUAL_HIGHS:         # the cheapest high tier feasible at the family's first point
            start = start.with_(high=TierFormat.parse(high))
            first = start.with_(low=TierFormat.parse(RESIDUAL_LOW_TIERS[0])).with_tiering(
                alpha_high=RESIDUAL_ALPHA_GRID[0], alpha_low=0.0)
            if self._measure_residual(first).feasible:
                break
        chosen = None
        for name in RESIDUAL_LOW_TIERS:
            found = None
            for a_h in RESIDUAL_ALPHA_GRID:     # most aggressive first: the first feasible alpha is this tier's best,
                p = self._measure_residual(start.with_(low=TierFormat.parse(name)).with_tiering(alpha_high=a_h,
                                                                                                 alpha_low=0.0))
                if found is not None and not (p.feasible and p.bytes_ratio < found.bytes_ratio * (1 + MIN_GAIN)):
                    break
                if p.feasible:      # ... unless the next one keeps more heavy hitters for under 1% more bytes:
                    found = p       # quality the later stages can spend, bought for less than a stage may save
            if found is None:       # cheaper low tiers quantize harder: assumed infeasible too
                break
            # a cheaper low tier may pass only by keeping more heavy hitters in fp16, which can cost more in all
            chosen = found if chosen is None or found.bytes_ratio < chosen.bytes_ratio else chosen
        if chosen is None:
            return None
        chosen = self._bisect(chosen, [{"window": w} for w in RESIDUAL_WINDOWS if w < base.tiering.window])
        a_h = chosen.config.tiering.alpha_high
        pruned = self._bisect(chosen, [{"alpha_low": a} for a in ALPHA_LOW_GRID if a <= a_h])
        return pruned if _saves(pruned, chosen) else chosen       # (as in `tiers`: pruning has a byte cost)

    def _bisect(self, start: Point, changes: list[dict]) -> Point:
        """The last feasible of the tiering `changes` to `start`, each more aggressive than the last
        (`last_feasible`); `start` if none is."""
        found = last_feasible(changes, lambda change: self._measure_residual(start.config.with_tiering(**change)))
        return found or start

    def _measure_residual(self, c: CompressionConfig) -> Point:
        high = "fp16" if c.high.k_bits in RAW_BITS else c.high.name
        return self.measure("residual", f"{high} W={c.tiering.window} / {c.low.name} "
                            f"a=({c.tiering.alpha_high:g},{c.tiering.alpha_low:g})", c)

    def sliding(self, start: Point) -> Point:
        """The cheapest feasible `SLIDING_FORMATS` entry for the sliding-window layers on top of `start`; `start`
        when the model has none or none saves bytes."""
        if "sliding_attention" not in self.bundle.model.layer_types:
            return start
        best = start
        for name in SLIDING_FORMATS:
            fmt, recent = split_sliding_spec(name)
            candidate = start.config.with_(sliding=TierFormat.parse(fmt), sliding_recent=recent or 0)
            if not self._groups_split(candidate.sliding) or candidate == start.config:
                continue
            on = start.label.partition(", sliding layers ")[0]      # less the sliding part `measure` adds
            p = self.measure("sliding", f"sliding layers {name} on {on}", candidate)
            if not p.feasible:
                break
            if _saves(p, best):
                best = p
        return best

    def layer_bits(self, start: Point) -> Point:
        """Per-layer bits on top of `start` (module docstring, stage 3): the low tier of each compressed layer
        (`low_layers`) and the format of each sliding-window layer (`sliding_layers`), keys and values apart. `start`
        when the search has no `sensitivity` estimator, nothing can halve (2 bits, raw or static keys) or no step
        saves bytes."""
        config = start.config
        types = self.bundle.model.layer_types
        bases = {}                  # settings field -> (its base format, the layers it covers)
        if config.tiering.tiered and config.low.k_mode != "static" and config.low.k_bits not in RAW_BITS:
            bases["low_layers"] = (config.low, [i for i, t in enumerate(types) if t != "sliding_attention"])
        if config.sliding is not None:
            bases["sliding_layers"] = (config.sliding, [i for i, t in enumerate(types) if t == "sliding_attention"])
        where_of = {layer: where for where, (_, layers) in bases.items() for layer in layers}
        can_halve = [(layer, side) for layer, where in where_of.items() for side in SIDES
                     if halved(bases[where][0], side) is not None]
        if self.sensitivity is None or not can_halve:
            return start
        added = self.sensitivity(config, {layer: bases[where][0] for layer, where in where_of.items()})

        def with_steps(chosen: list[tuple[str, int, str]]) -> CompressionConfig:
            formats: dict[tuple[str, int], TierFormat] = {}
            for where, layer, side in chosen:
                formats[(where, layer)] = halved(formats.get((where, layer), bases[where][0]), side)
            return config.with_(**{where: tuple((layer, fmt) for (w, layer), fmt in sorted(formats.items())
                                                if w == where)
                                   for where in bases})

        # (loss added per byte saved, where, layer, side), least sensitive first
        steps = sorted((added[(layer, side)] / self._bytes_saved(bases[where_of[layer]][0], side, layer),
                        where_of[layer], layer, side) for layer, side in can_halve)

        def measure(n: int) -> Point:
            return self.measure("bits", f"bits halved in the {n} least sensitive (layer, K|V) on {start.label}",
                                with_steps([step[1:] for step in steps[:n]]))

        best = last_feasible(list(range(1, len(steps) + 1)), measure)
        return best if best is not None and _saves(best, start) else start

    def _bytes_saved(self, fmt: TierFormat, side: str, layer: int) -> float:
        """Code bytes one layer saves at the probe's context with `side` of `fmt` at half the bits: every KV head,
        every token it holds (a sliding-window layer, its window)."""
        _, H, d = self.bundle.shape
        n = self._tokens_held(self.bundle.model.layer_types[layer] == "sliding_attention")
        bits = getattr(fmt, side)
        return H * n * (packed_size(d, bits) - packed_size(d, bits // 2))

    def _tokens_held(self, sliding: bool) -> int:
        """Tokens a layer holds at the probe's context: all of them, or a sliding-window layer's window."""
        n = self.probe.prompt.shape[1] + self.probe.continuation.shape[1]
        return min(n, self.probe.model.config.sliding_window - 1) if sliding else n

    def fastgen_patterns(self, start: Point) -> Point:
        """FastGen recovery thresholds on top of `start`, most conservative first."""
        best = start
        for t in RECOVERY_GRID:
            p = self.measure("policies", f"FastGen T={t:g} on {start.label}",
                             start.config.with_(fastgen=dataclasses.replace(FASTGEN, recovery=t)))
            if not p.feasible:
                break
            if _saves(p, best):
                best = p
        return best

    def ranks(self, start: Point, rank_iters: int = 2) -> Point:
        """Removal rates for QK, then V (FDC §5.2 binary search, bracketed from below by `RATE_GRID`); a rate is
        kept only if it saves bytes."""
        best = start
        for field_name, label in (("qk_removal_rate", "qk"), ("v_removal_rate", "v")):
            base, points = best, {}

            def feasible(rate: float, field_name=field_name, label=label, base=base, points=points) -> bool:
                points[rate] = self.measure("ranks", f"{label} removal rate {rate:.3f}",
                                            base.config.with_(**{field_name: rate}))
                return points[rate].feasible

            rate = largest_feasible(feasible, RATE_GRID, rank_iters)
            if rate is not None and _saves(points[rate], best):
                best = points[rate]
        return best

    def sliding_share(self) -> float:
        """The sliding-window layers' share of an fp16 cache at the probe's context (0 without such layers)."""
        types = self.bundle.model.layer_types
        if "sliding_attention" not in types:
            return 0.0
        sliding = sum(t == "sliding_attention" for t in types) * self._tokens_held(True)
        return sliding / (sliding + sum(t != "sliding_attention" for t in types) * self._tokens_held(False))

    def smoothing(self, base: CompressionConfig) -> CompressionConfig:
        """`base` with channel smoothing on when the bundle has factors and, on `base`'s per-token high tier (the
        format an outlier key channel hurts most), smoothing lowers the KL by `SMOOTHING_MIN_GAIN`; the stages
        after build on the winner.
        Both points are measured; smoothing changes no byte."""
        if "qk.smoothing" not in self.bundle.extras or base.static_keys or not base.rotate:
            return base
        plain = self.measure("smoothing", f"{base.high.name}, no tiers, no smoothing", base.with_tiering(
            alpha_high=None))
        smooth = self.measure("smoothing", f"{base.high.name}, no tiers, smoothing", base.with_(
            smooth=True).with_tiering(alpha_high=None))
        return base.with_(smooth=smooth.kl < plain.kl * (1 - SMOOTHING_MIN_GAIN))

    def run(self, base: CompressionConfig) -> SearchResult:
        """base: the starting candidate, e.g. `CompressionConfig()` with the calibration's window. Sliding-window
        layers start every stage in the first, nearly lossless `SLIDING_FORMATS` entry, not dense: a stage that chose
        on dense sliding layers could spend the whole quality budget and leave them dense. Where those windows hold
        most of the bytes at the probe's context (`sliding_share` > 1/2, Gemma3 at 1k), the cheaper sliding formats
        are walked first, so the quality budget goes to the larger share of the bytes; else after the tiers. Channel
        smoothing is decided first, on the base's high tier (`smoothing`)."""
        base = self.smoothing(base)
        if "sliding_attention" in self.bundle.model.layer_types:      # nearly lossless, a large share of the bytes
            base = base.with_(sliding=TierFormat.parse(SLIDING_FORMATS[0]))
        start = self.precision(base)
        sliding_first = start.feasible and self.sliding_share() > 0.5
        if sliding_first:
            start = self.sliding(start)
            base = base.with_(sliding=start.config.sliding, sliding_recent=start.config.sliding_recent)
        chosen = start if start.feasible else None
        if start.feasible:
            tiered = self.tiers(start.config)
            if tiered is not None and _saves(tiered, start):
                chosen = tiered
        residual = self.residual(base)
        if residual is not None and (chosen is None or _saves(residual, chosen)):
            chosen = residual
        if chosen is not None:
            if not sliding_first:
                chosen = self.sliding(chosen)
            chosen = self.layer_bits(chosen)
            chosen = self.fastgen_patterns(chosen)
            chosen = self.ranks(chosen)
        if chosen is None:
            logger.warning("no candidate met the quality target (%s); keeping the most precise one measured",
                           self.target)
            chosen = max(self.path, key=lambda p: (p.top1, -p.ppl_ratio))
        qk_rank, v_rank = ranks_of(self.bundle, chosen.config)
        return SearchResult(config=chosen.config, qk_rank=qk_rank, v_rank=v_rank, chosen=chosen, path=self.path)
