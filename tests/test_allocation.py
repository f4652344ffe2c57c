"""The quality model (kvcal.profile.quality_model) and the allocation by it (kvcal.profile.allocate): the predicted
loss orders allocations as the runtime's decode probe measures them, and the allocator's choices are Pareto-optimal
in (predicted loss, bytes) and respect the budget."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_model, random_bundle, random_text

from kvcal.eval import DecodeProbe
from kvcal.models import adapter_for
from kvcal.profile.allocate import Allocation, allocate, at_price, base_settings, frontier, to_config
from kvcal.profile.quality_model import ALPHAS, BASE_ALPHA, BITS, HIGH, FormatCosts, bundle_levels, spearman
from kvcal.profile.ranks import ranks_of
from kvcal.profile.recording import record_search
from kvcal.runtime.storage.bases import served_bases

pytestmark = pytest.mark.usefixtures("one_thread")


def _table(L: int = 3, H: int = 2, seed: int = 0) -> FormatCosts:
    """A random table shaped like the quality model's: loss grows and bytes fall as bits fall; a higher heavy-hitter
    threshold moves tokens from the high tier to the allocated formats (more loss there, fewer tokens high)."""
    g = torch.Generator().manual_seed(seed)
    A = len(ALPHAS)
    steps = torch.rand(L, H, 2, len(BITS), 1, generator=g, dtype=torch.float64).cumsum(-2) ** 3
    low_tokens = torch.linspace(90, 99, A, dtype=torch.float64)
    nbytes = torch.tensor([b / 8 + 0.25 for b in BITS], dtype=torch.float64).expand(L, 2, -1).clone()
    high = torch.rand(L, H, 2, 1, 1, generator=g, dtype=torch.float64) * (100 - low_tokens) / 10
    return FormatCosts(steps * low_tokens / 90, nbytes, low_tokens.expand(L, -1).clone(), [False] * L,
                       torch.cat([torch.zeros_like(high), high], -2),
                       torch.tensor([2.0, 1.0 + 1 / 16], dtype=torch.float64).expand(L, 2, -1).clone(),
                       (100 - low_tokens).expand(L, -1).clone())


def test_hull_points_are_pareto_optimal_and_ordered():
    costs = _table()
    everything = [torch.tensor(c).view(3, 2) for c in itertools.product(BITS, repeat=6)]
    priced = [(costs.predicted(b, high, alpha), costs.held_bytes(b, high, alpha))
              for b in everything for high in range(len(HIGH)) for alpha in range(len(ALPHAS))]
    hull = frontier(costs)
    assert len(hull) > 3
    assert hull[0].bits.eq(8).all() and hull[0].high == 0 and hull[-1].bits.eq(2).all() and hull[-1].high == 1
    assert {a.high for a in hull} == {0, 1}             # the high tier's formats are both on the frontier here
    assert len({a.alpha for a in hull}) > 1             # and more than one threshold
    for a, b in zip(hull, hull[1:]):
        assert a.predicted <= b.predicted and a.held_bytes > b.held_bytes
    for a in hull:          # nothing has both less loss and fewer bytes than a hull point
        assert not any(p < a.predicted - 1e-9 and n < a.held_bytes - 1e-9 for p, n in priced)


def test_allocate_keeps_the_budget_and_spends_it():
    costs = _table(seed=1)
    hull = frontier(costs)
    for budget in (0.0, hull[2].predicted, hull[-2].predicted * 0.99, float("inf")):
        chosen = allocate(costs, budget)
        assert chosen.predicted <= max(budget, hull[0].predicted)
        cheaper = [a for a in hull if a.held_bytes < chosen.held_bytes]
        assert all(a.predicted > budget for a in cheaper)
    assert at_price(costs, 0.0).bits.eq(8).all()


def _tiny_costs(L: int = 4):
    model, tok = make_model("llama", num_hidden_layers=L)
    a = adapter_for(model.config)
    bundle = random_bundle(model, tok)
    ids = tok([random_text(400, seed=5)], return_tensors="pt").input_ids[:, :161]
    base = base_settings(a.layer_types).with_tiering(window=8)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base, None)
    rec = record_search(model, ids[:, :112], ids[:, 112:], served, base, list(a.layer_types), a.head_dim)
    bundle.extras.update(bundle_levels(rec.levels, L, a.num_kv_heads))
    return model, tok, bundle, ids, base, rec.costs


def test_the_predicted_loss_orders_allocations_as_the_probe_measures_them():
    """Allocations from all 8-bit to all 2-bit on a 4-layer model, measured stepwise by the decode probe: the rank
    correlation of predicted loss and measured KL stays high. A predictor that weighs the wrong tokens or sides
    breaks the order, and this fails."""
    model, tok, bundle, ids, base, costs = _tiny_costs()
    assert costs.costs.shape == (4, 2, 2, len(BITS), len(ALPHAS)) and (costs.costs >= 0).all()
    base_costs = costs.costs[..., BASE_ALPHA]
    assert (base_costs[..., 2] > base_costs[..., 0]).all()              # 2 bits cost more than 8, per head
    probe = DecodeProbe(model, bundle, ids[:, :112], ids[:, 112:], tokenizer=tok)
    g = torch.Generator().manual_seed(0)
    allocations = [torch.full((4, 2), b) for b in BITS]
    allocations += [torch.tensor(BITS)[torch.randint(3, (4, 2), generator=g)] for _ in range(7)]
    predicted = [costs.predicted(b) for b in allocations]
    measured = [probe.measure(to_config(base, costs, Allocation.of(costs, b))).kl for b in allocations]
    assert spearman(predicted, measured) >= 0.8, list(zip(predicted, measured))


def test_each_kv_head_takes_its_own_bits_and_a_sliding_layers_heads_one():
    """A head 100 times as sensitive as its neighbour keeps more bits at some price; no per-head allocation of a
    2-layer table has both less predicted loss and fewer bytes than a hull point; a sliding layer's heads always
    choose alike (the runtime has one format per sliding layer)."""
    costs = _table(L=2, seed=2)
    costs.costs[:, 0] *= 100
    hull = frontier(costs)
    assert any((a.bits[:, 0] > a.bits[:, 1]).any() for a in hull)
    for high, alpha in {(a.high, a.alpha) for a in hull}:
        priced = [(costs.predicted(b, high, alpha), costs.held_bytes(b, high, alpha))
                  for b in (torch.tensor(c).view(2, 2, 2) for c in itertools.product(BITS, repeat=8))]
        for a in (a for a in hull if (a.high, a.alpha) == (high, alpha)):
            assert not any(p < a.predicted - 1e-9 and n < a.held_bytes - 1e-9 for p, n in priced)
    costs.sliding[0] = True
    assert all(a.bits[0, 0].eq(a.bits[0, 1]).all() for a in frontier(costs))


def test_to_config_sets_only_the_layers_that_differ():
    model, tok, bundle, ids, base, costs = _tiny_costs(L=2)
    bits = torch.tensor([[4, 4], [2, 8]])
    config = to_config(base, costs, Allocation.of(costs, bits))
    assert config.low_layers == ((1, base.low.__class__.parse("K2cnV8m8")),)
    assert to_config(base, costs, Allocation.of(costs, torch.full((2, 2), 4))) == base
    assert to_config(base, costs, Allocation.of(costs, bits, 1, 3)).tiering.alpha_high == ALPHAS[3]
    # per KV head: a layer takes the format most of its heads take (the lowest head's on a tie), the others their own
    per_head = torch.tensor([[[4, 4], [2, 2]], [[2, 8], [2, 8]]])
    config = to_config(base, costs, Allocation.of(costs, per_head))
    assert config.low_layers == ((1, base.low.__class__.parse("K2cnV8m8")),)
    assert config.low_heads == ((0, 1, base.low.__class__.parse("K2cnV2nm8")),)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 6]) == pytest.approx(1.0)


def _fid(top1: float, n: int = 1000) -> dict:
    return {"top1": top1, "predictions": n, "ppl_ratio": 1.0, "kl": 1 - top1, "top1_windows": []}


def test_the_budget_bisection_finds_the_last_point_that_meets_in_few_probes():
    """Quality falls along the hull; the bisection lands on the last index that meets at the Wilson bound."""
    from kvcal.eval import QualityTarget
    from kvcal.profile.budget import bisect

    target = QualityTarget(0.97, 1.02, 1.5)
    quality = [1.0 - 0.001 * i for i in range(100)]          # meets at the bound up to index 21 (n = 1000)
    last = max(i for i, q in enumerate(quality) if target.met(__import__("types").SimpleNamespace(**_fid(q))))
    seen = []
    index, probes = bisect(100, lambda i: seen.append(i) or _fid(quality[i]), target, max_probes=7)
    assert index == last and len(probes) == len(seen) <= 7
    index, probes = bisect(100, lambda i: _fid(quality[i]), target, max_probes=6)
    assert index <= last and last - index <= 2 and len(probes) == 6      # 6 probes: within 100 / 2^6 of it
    index, probes = bisect(100, lambda i: _fid(0.5), target, max_probes=6)
    assert index == -1 and probes[-1].index == 0                         # nothing meets: the safest end was tried



def test_predicted_losses_place_the_probes_and_the_bytes_end_the_search():
    """Where measured disagreement follows the predicted loss (as the quality model's Spearman table shows), cutting
    the bracket where the line through its ends crosses the target lands next to the last point that meets, in fewer
    probes than halving; the search ends once the bracket is finer than `RESOLUTION` in bytes; and predictions that
    say nothing (flat) leave halving's answer."""
    import math
    import types

    from kvcal.eval import QualityTarget
    from kvcal.profile.budget import RESOLUTION, bisect

    target = QualityTarget(0.97, 1.02, 1.5)
    n = 200
    predicted = [0.05 * math.exp(i / 25) for i in range(n)]                 # 0.05 .. 139, rising along the hull
    quality = [max(1.0 - 0.004 * p ** 0.8, 0.0) for p in predicted]        # disagreement ~ a power of the loss
    held = [1.0 - 0.004 * i for i in range(n)]                             # bytes fall along the hull
    met = [target.met(types.SimpleNamespace(**_fid(q))) for q in quality]
    last = max(i for i in range(n) if met[i])

    halving, plain = bisect(n, lambda i: _fid(quality[i]), target, max_probes=6)
    guided, probes = bisect(n, lambda i: _fid(quality[i]), target, 6, predicted, held)
    assert met[guided] and held[guided] - held[last] <= RESOLUTION * held[guided] + 1e-12
    assert len(probes) < len(plain) == 6 and held[guided] <= held[halving] + 1e-12
    # a flat prediction cannot place a probe: halving, as without predictions
    flat, probes = bisect(n, lambda i: _fid(quality[i]), target, 6, [1.0] * n)
    assert (flat, [p.index for p in probes]) == (halving, [p.index for p in plain])


def test_the_hulls_moves_past_a_point_are_its_own_and_the_path_orders_them_by_measured_loss_per_byte():
    """`hull_steps` lists the groups the hull moves next, each once, as they move; `measured_path` takes them in the
    order of the measured increases it is given (not the table's), its predictions rise, and its end holds them all."""
    from kvcal.profile.allocate import hull_steps, measured_path

    costs = _table(L=4, H=2, seed=3)
    hull = frontier(costs)
    start = 8                       # the high tier and the threshold stay as they are from here for 12 points
    assert len({(a.high, a.alpha) for a in hull[start:start + 12]}) == 1
    moves = hull_steps(hull, start)[:4]
    assert len(moves) == 4
    assert len({(m.layer, m.side, h) for m in moves for h in m.heads}) == sum(len(m.heads) for m in moves)
    for m in moves:         # each move is one the hull makes: those entries reach these bits further on
        assert hull[start].bits[m.layer, list(m.heads), m.side].gt(torch.tensor(m.bits)).all()
        assert any(a.bits[m.layer, list(m.heads), m.side].tolist() == list(m.bits) for a in hull[start + 1:])
    # measured increases that reverse the table's order of loss per byte
    s = hull[start]
    saved = [s.held_bytes - Allocation.of(costs, m.applied(s.bits), s.high, s.alpha).held_bytes for m in moves]
    added = [saved[j] * (len(moves) - j) for j in range(len(moves))]          # the last move: cheapest per byte
    path = measured_path(costs, s, moves, added)
    assert len(path) == len(moves)
    assert path[0].bits.equal(moves[-1].applied(s.bits))
    end = s.bits
    for m in moves:
        end = m.applied(end)
    assert path[-1].bits.equal(end)
    assert all(a.predicted < b.predicted and a.held_bytes > b.held_bytes for a, b in zip([s, *path], path))
    assert path[-1].predicted == pytest.approx(s.predicted + sum(added))
    # a move not measured: the table's increase at the measured moves' median ratio to it (here 10)
    table = [Allocation.of(costs, m.applied(s.bits), s.high, s.alpha).predicted - s.predicted for m in moves]
    path = measured_path(costs, s, moves, [10 * t for t in table[:-1]] + [None])
    assert path[-1].predicted == pytest.approx(s.predicted + 10 * sum(table))


def test_a_bisection_continued_from_known_probes_spends_its_probes_past_them():
    """Known probes bracket the search from the start: no probe at or below the known point that meets, at most
    `max_probes` new ones, and the same answer as a search that measured everything itself."""
    from kvcal.eval import QualityTarget
    from kvcal.profile.budget import Probe, bisect

    target = QualityTarget(0.97, 1.02, 1.5)
    quality = [1.0 - 0.001 * i for i in range(40)]
    fresh, _ = bisect(40, lambda i: _fid(quality[i]), target, max_probes=8)
    known = [Probe(5, "search", _fid(quality[5]), True)]
    seen = []
    index, probes = bisect(40, lambda i: seen.append(i) or _fid(quality[i]), target, 6, known=known)
    assert index == fresh and probes[0] is known[0] and len(seen) <= 6 and min(seen) > 5


def test_a_hull_is_coarse_where_its_next_point_missed_and_saves_more_than_the_resolution():
    from kvcal.profile.budget import RESOLUTION, Probe, coarse

    held = [1.0, 0.99, 0.95, 0.94]
    miss = lambda i: Probe(i, "search", _fid(0.9), False)          # noqa: E731
    meet = lambda i: Probe(i, "search", _fid(1.0), True)           # noqa: E731
    assert 1 - 0.99 <= RESOLUTION < 0.99 - 0.95
    assert coarse(1, [meet(1), miss(2)], held)                      # 4% in one step
    assert not coarse(0, [meet(0), miss(1)], held)                  # 1%: the bisection resolved it
    assert not coarse(1, [meet(1), miss(3)], held)                  # the next point was not probed
    assert not coarse(3, [meet(3)], held) and not coarse(-1, [miss(0)], held)


def test_confirmation_steps_back_by_the_measured_gap():
    from kvcal.eval import QualityTarget
    from kvcal.profile.budget import Probe, confirm

    target = QualityTarget(0.97, 1.02, 0.0)
    searched = [Probe(i, "search", _fid(1.0 - 0.005 * i), True) for i in (0, 2, 4, 6)]
    evaluation = {i: _fid(1.0 - 1.6 * 0.005 * i) for i in range(10)}     # evaluation text: 1.6x the disagreement
    index, checks = confirm(6, searched, evaluation.__getitem__, target)
    # between the probed 2 and 4, index 3's interpolated search disagreement (0.015) times the gap is 0.024 <= 0.03;
    # index 4's (0.02 x 1.6 = 0.032) is not. A gap taken as a difference (0.018) would have stepped back to index 2
    assert [c.index for c in checks] == [6, 3] and checks[-1].met and index == 3
    assert checks[1].gap.top1 == pytest.approx(1.6)
    index, checks = confirm(6, searched, lambda i: _fid(0.5), target, max_checks=3)
    assert [c.index for c in checks] == [6, 0] and not any(c.met for c in checks)   # nothing safer than index 0
    # a gap no probed point covers: the safest probed point next, not a jump past everything measured
    searched = [Probe(i, "search", _fid(0.985 - 0.001 * i), True) for i in (10, 20, 30)]
    index, checks = confirm(30, searched, lambda i: _fid(0.94), target, max_checks=3)
    assert [c.index for c in checks] == [30, 10, 5]


def test_a_check_that_one_document_defeats_steps_back_by_the_between_window_shortfall():
    """A check whose plain top-1 is as good as the search text's but whose windows spread (one document far below the
    others) misses by the between-window bound: the step back is sized by that bound's shortfall, not by the plain
    top-1 ratio (near 1 here, a step of one hull point), and stops where the scaled search bound is within the
    target's."""
    from kvcal.eval import QualityTarget
    from kvcal.profile.budget import Gap, Probe, confirm, search_quality, step_back

    target = QualityTarget(0.97, 1.02, 1.5, held_out_predictions=0)     # the bounds over all 1024 predictions

    def fid(top1: float, windows: list[float] | None = None) -> dict:
        return {**_fid(top1, 1024), "top1_windows": windows or []}

    searched = [Probe(i, "search", fid(1.0 - 0.0008 * i), True) for i in (0, 10, 20, 30)]
    # at 30: search 0.976; evaluation 0.979 overall, but windows 0.98 0.996 0.945 0.996 (qwen2.5-coder-1.5b's check)
    spread = fid(0.979, [0.98, 0.996, 0.945, 0.996])
    assert target.top1_bound(spread) < 0.97 < target.top1_bound({**spread, "top1_windows": []})
    gap = Gap.measured(search_quality(searched, 30), spread, target)
    assert gap.top1 < 1 < gap.bound                              # the plain ratio alone would step one point back
    checked = []
    index, rows = confirm(30, searched, lambda i: checked.append(i) or (spread if i == 30 else fid(0.99)), target)
    assert checked[0] == 30 and rows[0].met is False
    step = checked[1]
    for j in range(step, 30):        # every point skipped would, scaled by the gap, still miss at its bound
        q = {**_fid(1.0 - 0.0008 * j, 1024), "top1_windows": []}
        assert (j == step) == (gap.bound * (1 - target.top1_bound(q)) <= 0.03)
    assert step < 29 and rows[1].met and index == step
    # a plain miss over every window alike: the bound ratio is pulled towards 1 by the bound's noise term, so the step
    # goes at least as far back as the plain ratio alone takes it
    plain = fid(1 - 1.6 * 0.024)
    gap = Gap.measured(search_quality(searched, 30), plain, target)
    assert 1 < gap.bound < gap.top1 == pytest.approx(1.6)
    assert step_back(searched, 30, gap, 1024, target) <= step_back(searched, 30, Gap(gap.top1, 0.0), 1024, target) < 29


def test_gauges_spend_the_misses_and_a_check_confirms():
    """With a gauge (the coded probe on evaluation text), points the evaluation text defeats cost a gauge each, the
    gauge's miss steps back by the measured gap just as a check's does, and the runtime checks only the point whose
    gauge met; a check that misses after its gauge met steps back and gauges again."""
    from kvcal.eval import QualityTarget
    from kvcal.profile.budget import Probe, confirm

    target = QualityTarget(0.97, 1.02, 0.0)
    searched = [Probe(i, "search", _fid(1.0 - 0.005 * i), True) for i in (0, 2, 4, 6)]
    evaluation = {i: _fid(1.0 - 1.6 * 0.005 * i) for i in range(10)}
    checked, gauged = [], []
    index, rows = confirm(6, searched, lambda i: checked.append(i) or evaluation[i], target, 3,
                          lambda i: gauged.append(i) or evaluation[i], max_gauges=4)
    assert index == 3 and gauged == [6, 3] and checked == [3]
    assert [r.split for r in rows] == ["evaluation, coded", "evaluation, coded", "evaluation"] and rows[-1].met
    # the runtime is harder than its gauge: 6 and 3 pass their gauges, the check at 3 misses by a wider gap
    stepwise = {i: _fid(1.0 - 2.2 * 0.005 * i) for i in range(10)}
    gauges = {i: _fid(1.0 - 0.005 * i) for i in range(10)}
    index, rows = confirm(6, searched, stepwise.__getitem__, target, 3, gauges.__getitem__, max_gauges=4)
    assert [(r.index, r.split) for r in rows] == [(6, "evaluation, coded"), (6, "evaluation"),
                                                  (2, "evaluation, coded"), (2, "evaluation")]
    assert index == 2 and rows[-1].met
    # no gauges left: checks as without them; every gauge missing down to the end: the best gauged point is checked
    index, rows = confirm(6, searched, evaluation.__getitem__, target, 3, evaluation.__getitem__, max_gauges=0)
    assert [r.split for r in rows] == ["evaluation"] * 2 and index == 3
    index, rows = confirm(6, searched, lambda i: _fid(0.5), target, 3, lambda i: _fid(0.6 - 0.01 * i), max_gauges=4)
    assert [r.split for r in rows][-1] == "evaluation" and index == 0 and not rows[-1].met


def test_the_gauges_left_after_a_step_back_bisect_the_points_it_stepped_over():
    """A gap measured where the evaluation text falls off steeply scales the whole search text's error by it, so the
    step back lands far short of where the evaluation text stops meeting (qwen2.5-coder-1.5b's check stepped from
    hull point 140 to 89). The gauges left bisect between the met and the missed point, and the cheapest point whose
    gauge met is checked; once a check has missed where its gauge met, the gauges are optimistic and do not refine."""
    from kvcal.eval import QualityTarget
    from kvcal.profile.budget import Probe, confirm

    target = QualityTarget(0.97, 1.02, 0.0)
    searched = [Probe(i, "search", _fid(1.0 - 0.0005 * i), True) for i in (0, 20, 40)]
    # evaluation text: meets up to index 30, then falls off twelve times as steeply
    evaluation = {i: _fid(1.0 - (0.001 * i if i <= 30 else 0.03 + 0.012 * (i - 30))) for i in range(41)}
    predicted, held = [i + 1.0 for i in range(41)], [100.0 - i for i in range(41)]
    checked, gauged = [], []
    index, rows = confirm(40, searched, evaluation.__getitem__, target, 3, evaluation.__getitem__, max_gauges=5)
    assert index == 8 and [r.index for r in rows] == [40, 8, 8]      # the gap (7.5x) alone: a step to 8
    index, rows = confirm(40, searched, lambda i: checked.append(i) or evaluation[i], target, 3,
                          lambda i: gauged.append(i) or evaluation[i], 5, predicted, held)
    assert gauged[:2] == [40, 8] and len(gauged) == 5 and checked == [index] and rows[-1].met
    assert 20 < index <= 30 and all(evaluation[i]["top1"] >= 0.97 for i in gauged if i <= index)
    assert [r.split for r in rows] == ["evaluation, coded"] * 5 + ["evaluation"]
    # the runtime harder than its gauge: the check at 6 misses where its gauge met, the step back is not refined
    searched = [Probe(i, "search", _fid(1.0 - 0.005 * i), True) for i in (0, 2, 4, 6)]
    stepwise = {i: _fid(1.0 - 2.2 * 0.005 * i) for i in range(10)}
    gauges = {i: _fid(1.0 - 0.005 * i) for i in range(10)}
    index, rows = confirm(6, searched, stepwise.__getitem__, target, 3, gauges.__getitem__, 6,
                          [i + 1.0 for i in range(10)], [100.0 - 5 * i for i in range(10)])
    assert [(r.index, r.split) for r in rows] == [(6, "evaluation, coded"), (6, "evaluation"),
                                                  (2, "evaluation, coded"), (2, "evaluation")]


def test_measuring_in_float32_gives_the_model_back_with_its_own_buffers():
    """The search casts a bf16 model to float32 and back (`choose.measuring_in`): its parameters come back bf16 and
    bit for bit, its float32 rotary frequencies as they were. A plain `.to()` there and back would round them to
    bf16."""
    from kvcal.profile.choose import measuring_in

    model, _ = make_model("llama")
    for p in model.parameters():                        # as a model loaded in bf16 is: float32 RoPE frequencies
        p.data = p.data.bfloat16()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    assert any(b.dtype == torch.float32 for b in buffers.values())
    restore = measuring_in(model, torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    restore()
    assert all(torch.equal(p, params[n]) and p.dtype == torch.bfloat16 for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[n]) and b.dtype == buffers[n].dtype for n, b in model.named_buffers())
    model.to(torch.float32).to(torch.bfloat16)
    assert any(b.dtype != buffers[n].dtype for n, b in model.named_buffers())     # what the helper avoids
