"""Measure only to set the budget and to confirm it.

The allocation's hull (kvcal.profile.allocate.frontier) orders candidates from the least predicted loss (most bytes)
to the most (fewest bytes). Measured quality falls along it, so:

1. `bisect`: end-to-end probes on the search windows (the batched probe) bisect the hull for the cheapest point
   that meets the target at its Wilson bound, in at most `max_probes` probes. Once a point that meets and one that
   misses are known, the next probe goes where the line through them in (log predicted loss, log shortfall) crosses
   the target (`shortfall`: 1 at the target), not to the middle: the predicted loss tracks the measured error over
   the hull, so the crossing lands near the boundary where halving would need several probes. It stops once the
   points left between them would hold at most `RESOLUTION` fewer bytes than the one that meets: the evaluation
   text moves the choice by more than that. Where the hull's next point alone is a larger step than that
   (`coarse`), the caller can measure the moves past it and continue along a new stretch of candidates (`known`);
2. `confirm`: that point is measured once more, stepwise, on evaluation text. If it misses, the gap between the texts
   is measured there (`Gap`): the ratio of its top-1 disagreement with dense on evaluation text to that on search
   text, and the same ratio of the disagreements at the target's bound (1 - `QualityTarget.top1_bound`: Wilson's, or
   the between-window bound where that is lower). The budget steps back to the cheapest point that meets the target
   under both (search quality measured where it was probed, interpolated along the hull between probed points
   elsewhere; when none does, the safest point probed, or halfway to the safest end), and that one is confirmed, up
   to `max_checks` checks in all. A ratio, not a difference, because both disagreements vanish together as the
   coding error does: a harder text multiplies the errors a format causes, it does not add errors where there are
   none. Two ratios, because each misses what the other sees: the plain one scales the errors themselves (a bound's
   noise term, the same on both texts, pulls the bound ratio towards 1), and the bound one sees a check that one
   document defeats (plain top-1 can then be as good as the search text's: a ratio near 1, a step of one hull point).
   With a `gauge` (the coded probe on the evaluation windows, a sixth of a check's time), a point is checked only
   once its gauge meets the target: a gauge's miss measures the gap and steps back just as a check's miss does, so
   the checks that the search text's optimism would have spent on misses are gauges instead. A step back lands
   where the search text, scaled by the gap, expects a meet, and that is often far short of where the evaluation
   text stops meeting: once a point's gauge meets below one the evaluation text defeated, the gauges left bisect
   the points between them (`bisect`, the same crossing and resolution) and the cheapest whose gauge meets is
   checked. Only while no check has missed where its gauge met: the gauges are then known to be optimistic.

Both take `measure(index) -> dict` (a Fidelity as a dict: top1, kl, ppl_ratio, predictions, top1_windows,
memory.ratio_to_fp16) and return what they measured as `Probe` rows, which the report lists.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvcal.eval import QualityTarget

Measure = Callable[[int], dict]
RESOLUTION = 0.02      # the bisection stops once the bracket's cheapest point could save at most this share of bytes


@dataclass
class Probe:
    index: int                 # position on the hull
    split: str                 # "search" or "evaluation"
    fidelity: dict
    met: bool                  # at the target's bounds
    gap: Gap | None = None     # the gap between the texts assumed when this point was picked


@dataclass(frozen=True)
class Gap:
    """Evaluation / search top-1 disagreement, plain (`top1`) and at the target's bound (`bound`)."""

    top1: float = 1.0
    bound: float = 1.0

    @classmethod
    def measured(cls, on_search: dict | None, on_evaluation: dict, target: QualityTarget) -> Gap:
        """Both ratios of one point's two measurements (1 where the search did not measure around it)."""
        if on_search is None:
            return cls()
        # a search disagreement of 0 is one in `predictions` at most: the ratios stay finite
        floor = 1.0 / max(on_search.get("predictions") or 1, 1)
        return cls((1.0 - on_evaluation["top1"]) / max(1.0 - on_search["top1"], floor),
                   (1.0 - target.top1_bound(on_evaluation)) / max(1.0 - target.top1_bound(on_search), floor))

    def __or__(self, other: Gap) -> Gap:
        return Gap(max(self.top1, other.top1), max(self.bound, other.bound))

    def expects_met(self, on_search: dict, target: QualityTarget, predictions: int) -> bool:
        """Whether a point of search quality `on_search` should meet `target` on evaluation text over `predictions`:
        its top-1 disagreement times `top1` at the Wilson bound, its bound disagreement times `bound` within the
        target's, its perplexity ratio as measured."""
        plain = {**on_search, "top1": max(1.0 - self.top1 * (1.0 - on_search["top1"]), 0.0),
                 "predictions": predictions, "top1_windows": None}
        return (target.met(plain)
                and self.bound * (1.0 - target.top1_bound(on_search)) <= 1.0 - target.top1 + 1e-12)


def shortfall(fid: dict, target: QualityTarget) -> float:
    """How far `fid` is from missing `target`, as a ratio that is 1 at the target and grows with the error: the larger
    of top-1's bound disagreement (1 - its lower bound) over the disagreement the target allows, and the perplexity
    ratio's excess over the excess it allows."""
    top1 = (1.0 - target.top1_bound(fid)) / max(1.0 - target.top1, 1e-12)
    ppl = (fid["ppl_ratio"] - 1.0) / max(target.ppl_ratio - 1.0, 1e-12)
    return max(top1, ppl, 1e-6)


def bisect(n: int, measure: Measure, target: QualityTarget, max_probes: int = 6, predicted: list[float] | None = None,
           held: list[float] | None = None, known: list[Probe] = ()) -> tuple[int, list[Probe]]:
    """The largest hull index in [0, n) whose probe meets `target` (taking quality to fall with the index), found
    in at most `max_probes` probes; -1 if the safest point (index 0) misses. Returns (index, probes). With the hull's
    `predicted` losses, a bracket is cut where its ends' shortfalls cross the target (module docstring); with its
    `held` bytes, the search stops once the bracket is finer than `RESOLUTION`. `known`: points of this hull already
    probed (a bisection continued on a new stretch of hull), which bracket it from the start; the returned probes
    begin with them."""
    probes: list[Probe] = list(known)
    new = lambda: len(probes) - len(known)                                           # noqa: E731
    met_at = [p.index for p in probes if p.met]
    lo = max(met_at, default=-1)         # lo: the largest index known to meet; hi: the smallest known to miss
    hi = min((p.index for p in probes if not p.met and p.index > lo), default=n)

    def probe(i: int) -> bool:
        fid = measure(i)
        probes.append(Probe(i, "search", fid, target.met(fid)))
        return probes[-1].met

    def fine() -> bool:
        return held is not None and 0 <= lo < hi < n and held[lo] - held[hi - 1] <= RESOLUTION * held[lo]

    while hi - lo > 1 and new() < max_probes and not fine():
        # the first probe goes to the middle; once a miss is known, the safest end is worth checking only if
        # nothing met yet and one probe is left
        mid = 0 if (lo < 0 and new() == max_probes - 1) else (lo + hi) // 2
        if predicted is not None and 0 <= lo < hi < n:
            if held is not None and probes[-1].met == probes[-2].met:
                mid = _resolution_step(lo, hi, held, probes[-1].met)
            else:
                mid = _crossing(lo, hi, predicted, {p.index: p.fidelity for p in probes}, target, probes)
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def coarse(index: int, probes: list[Probe], held: list[float]) -> bool:
    """Whether the hull cannot resolve the budget past `index`, the bisection's answer: the next point was probed
    and missed, and it holds more than `RESOLUTION` fewer bytes (one move of the hull is then too large a step)."""
    missed = {p.index for p in probes if not p.met}
    return (0 <= index < len(held) - 1 and index + 1 in missed
            and held[index] - held[index + 1] > RESOLUTION * held[index])


def _resolution_step(lo: int, hi: int, held: list[float], met: bool) -> int:
    """After two probes on one side, the line keeps landing near that end: the next probe is the point just past
    `RESOLUTION` of it, so that one more probe on the other side ends the search. `met`: the last probe was lo."""
    inside = range(lo + 1, hi)
    if met:
        return next((j for j in inside if held[lo] - held[j] > RESOLUTION * held[lo]), hi - 1)
    return next((j for j in inside if held[j] - held[hi - 1] <= RESOLUTION * held[j]), lo + 1)


def _crossing(lo: int, hi: int, predicted: list[float], at: dict, target: QualityTarget, probes: list[Probe]) -> int:
    """The index in (lo, hi) whose predicted loss is nearest where log shortfall, taken linear in log predicted loss
    through the bracket's ends, reaches 1; halfway when the last two probes fell on the same side and no bytes are
    known (`_resolution_step`), or the predictions do not rise across the bracket."""
    middle = (lo + hi) // 2
    if probes[-1].met == probes[-2].met:
        return middle
    a, b = predicted[lo], predicted[hi]
    if not 0 < a < b:
        return middle
    ra, rb = math.log(shortfall(at[lo], target)), math.log(shortfall(at[hi], target))
    if not ra <= 0 <= rb or ra == rb:
        return middle
    goal = math.log(a) + (math.log(b) - math.log(a)) * (-ra) / (rb - ra)
    return min(range(lo + 1, hi), key=lambda j: abs(math.log(max(predicted[j], 1e-30)) - goal))


def confirm(start: int, searched: list[Probe], measure: Measure, target: QualityTarget, max_checks: int = 3,
            gauge: Measure | None = None, max_gauges: int = 0, predicted: list[float] | None = None,
            held: list[float] | None = None) -> tuple[int, list[Probe]]:
    """Check hull index `start` on evaluation text; on a miss step back (module docstring), gauging each point first
    while fewer than `max_gauges` gauges were spent, and with the hull's `predicted` losses and `held` bytes, refining
    a step back by the gauges left. Returns (the index whose check met, or the best checked if none did, and every
    gauge and check in order; a gauge's split is "evaluation, coded")."""
    rows: list[Probe] = []
    gap, i = Gap(), start
    gauges = lambda: sum(p.split != "evaluation" for p in rows)                    # noqa: E731

    def measured(how: Measure, split: str) -> bool:
        nonlocal gap, i
        fid = how(i)
        rows.append(Probe(i, split, fid, target.met(fid), gap))
        if not rows[-1].met:
            gap = gap | Gap.measured(search_quality(searched, i), fid, target)
            i = step_back(searched, i, gap, fid.get("predictions", 0), target)
        return rows[-1].met

    def refine() -> None:
        """Move i, whose gauge met, to the cheapest point below the nearest one evaluation text defeated whose gauge
        meets, by the gauges left (module docstring)."""
        nonlocal gap, i
        missed = [p.index for p in rows if not p.met and p.index > i]
        gauged = {p.index for p in rows if p.split != "evaluation" and p.met}
        contradicted = any(p.split == "evaluation" and not p.met and p.index in gauged for p in rows)
        if not missed or predicted is None or held is None or contradicted or gauges() >= max_gauges:
            return
        at = {p.index: p for p in rows}
        known = [Probe(i, "search", at[i].fidelity, True), Probe(min(missed), "search", at[min(missed)].fidelity,
                                                                 False)]
        i, probes = bisect(len(held), gauge, target, max_gauges - gauges(), predicted, held, known)
        for p in probes[len(known):]:
            rows.append(Probe(p.index, "evaluation, coded", p.fidelity, p.met, gap))
            if not p.met:
                gap = gap | Gap.measured(search_quality(searched, p.index), p.fidelity, target)

    while sum(p.split == "evaluation" for p in rows) < max_checks and i >= 0:
        passed_gauge = any(p.index == i and p.split != "evaluation" and p.met for p in rows)   # refine() led here
        if gauge is not None and gauges() < max_gauges and not passed_gauge:
            if not measured(gauge, "evaluation, coded"):
                continue
            refine()
        if measured(measure, "evaluation"):
            return rows[-1].index, rows
    checks = [p for p in rows if p.split == "evaluation"]
    if not checks:              # every gauge missed down to the safest end: check the best gauged point once
        best = max(rows, key=lambda p: (p.fidelity["top1"], -p.index))
        fid = measure(best.index)
        rows.append(Probe(best.index, "evaluation", fid, target.met(fid), gap))
        return best.index, rows
    best = max(checks, key=lambda p: (p.fidelity["top1"], -p.index))
    return best.index, rows


def step_back(searched: list[Probe], i: int, gap: Gap, predictions: int, target: QualityTarget) -> int:
    """The next point to try after index i missed on evaluation text: the cheapest safer point whose search quality
    `gap` expects to meet the target over `predictions`; when none does, the safest point the search measured, else
    halfway to the safest end (-1: none is left)."""
    safer = [j for j in range(i - 1, -1, -1) if (q := search_quality(searched, j)) is not None
             and gap.expects_met(q, target, predictions)]
    probed = [p.index for p in searched if p.index < i]
    return safer[0] if safer else min(probed) if probed else (i // 2 if i > 0 else -1)


def search_quality(searched: list[Probe], j: int) -> dict | None:
    """The search-text quality of hull index j: its probe's where it was probed, else top-1 and perplexity ratio
    interpolated linearly in the index between the nearest probed points either side (quality falls along the hull),
    with the lower one's prediction count; None outside the probed range."""
    at = {p.index: p.fidelity for p in searched}
    if j in at:
        return at[j]
    below, above = [i for i in at if i < j], [i for i in at if i > j]
    if not below or not above:
        return None
    a, b = max(below), min(above)
    w = (j - a) / (b - a)
    return {**at[a], "top1_windows": None,
            **{k: (1 - w) * at[a][k] + w * at[b][k] for k in ("top1", "ppl_ratio")}}
