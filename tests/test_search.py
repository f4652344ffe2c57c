"""The search's decision rules, with mocks where the rule is the point (a monotone feasibility, a grid of points)."""

from kvcal.profile.search import LOW_TIERS, PRECISION_LADDER, Point, QualityTarget, Search, cheapest, largest_feasible
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.layout import TierFormat

BASE = CompressionConfig()                   # K8V4 / K4cV2, window 64: the search's starting candidate


def test_largest_feasible_under_a_monotone_mock():
    for threshold in (0.0, 0.013, 0.05, 0.1234, 0.29, 0.5):
        calls = []

        def feasible(x, t=threshold, calls=calls):
            calls.append(x)
            return x <= t

        got = largest_feasible(feasible, (0.01, 0.02, 0.04, 0.08, 0.16, 0.3), iters=8)
        if threshold < 0.01:
            assert got is None and calls == [0.01]
        elif threshold >= 0.3:
            assert got == 0.3
        else:
            assert got <= threshold and threshold - got < 0.16 / 2 ** 8 + 1e-12   # within the final bracket
            assert all(x <= threshold for x in calls if x <= got)


def _point(bytes_ratio, top1, ppl=1.0, label=""):
    p = Point("tiers", label, {}, bytes_ratio, top1, 0.0, ppl, {}, False, 0.0, predictions=0)
    p.feasible = QualityTarget().met(p)
    return p


def test_cheapest_feasible_point_is_chosen():
    pts = [_point(0.5, 0.99, label="a"), _point(0.3, 0.98, label="b"), _point(0.2, 0.95, label="c"),
           _point(0.25, 0.99, ppl=1.05, label="d"), _point(0.3, 0.975, label="e")]
    assert cheapest(pts).label == "b"
    assert cheapest([_point(0.1, 0.5)]) is None


class GridProbe:
    """A fake probe: bytes fall and quality falls with alpha; the search must pick the cheapest feasible point."""

    def __init__(self, limit_high, limit_low):
        self.limit_high, self.limit_low, self.calls = limit_high, limit_low, []

    def measure(self, config, bundle):
        from kvcal.profile.quality import Fidelity

        a_h = config.tiering.alpha_high or 0.0
        a_l = config.tiering.alpha_low
        self.calls.append((config.low.name, a_h, a_l))
        ok = a_h <= self.limit_high and a_l <= self.limit_low
        channel_bonus = 0.01 if config.low.k_mode == "channel" else 0.0
        return Fidelity(kl=0.0, top1=0.99 if ok else 0.9, ppl=1.0, ppl_dense=1.0, ppl_ratio=1.0, predictions=10**6,
                        prompt_tokens=1, memory={"ratio_to_fp16": 0.5 - 0.05 * a_h - 0.02 * a_l - channel_bonus},
                        tiers={})


def test_alpha_grid_picks_the_cheapest_point_meeting_the_target():
    import torch

    from kvcal.bundle import Bundle, ModelInfo

    bundle = Bundle(ModelInfo("m", "f", "w", "t", "llama", 1, 1, 1, 4, ["full_attention"]), torch.eye(4)[None, None],
                    torch.ones(1, 1, 4), torch.full((1, 1), 4, dtype=torch.int32), torch.eye(4)[None, None],
                    torch.ones(1, 1, 4), torch.full((1, 1), 4, dtype=torch.int32), "both", "trace", "activations-text")
    probe = GridProbe(limit_high=3.0, limit_low=1.0)
    search = Search(probe, bundle, QualityTarget())
    best = search.tiers(BASE)
    assert best.settings["alpha_high"] == 3.0 and best.settings["alpha_low"] == 1.0
    k4c = LOW_TIERS[0]
    assert best.settings["low"] == k4c                         # the cheaper key mode at equal alphas
    # bisection: alpha_high 3 then 4 (2 of 5), alpha_low 1, 2, 1.5 (3 of the 7 up to 3), for each low tier
    assert [call for call in probe.calls if call[0] == k4c] == [(k4c, 3.0, 0.0), (k4c, 4.0, 0.0), (k4c, 3.0, 1.0),
                                                                 (k4c, 3.0, 2.0), (k4c, 3.0, 1.5)]
    assert all(p.settings for p in search.path)
    # a resumed search does not measure known points again
    again = Search(probe, bundle, QualityTarget(), memo=search.memo)
    n = len(probe.calls)
    assert again.tiers(BASE).settings == best.settings and len(probe.calls) == n


def test_target_asks_for_more_evidence_near_the_threshold():
    from kvcal.profile.search import wilson_lower

    t = QualityTarget(top1=0.97, ppl_ratio=1.02, z=1.0)   # z=1: 0.988 over 256 passes, 0.977 does not
    near = Point("tiers", "", {}, 0.3, 0.977, 0.0, 1.0, {}, False, 0.0, predictions=256)
    clear = Point("tiers", "", {}, 0.3, 0.988, 0.0, 1.0, {}, False, 0.0, predictions=256)
    assert not t.met(near) and t.met(clear)
    assert QualityTarget(z=0).met(near)
    assert wilson_lower(0.977, 256, 1.0) < 0.977 and abs(wilson_lower(0.977, 10**9, 1.0) - 0.977) < 1e-4


class LadderProbe:
    """A fake probe where quality grows with the high tier's value bits and value groups (smaller group = better)."""

    def __init__(self, quality):
        self.quality, self.calls = quality, []

    def measure(self, config, bundle):
        from kvcal.profile.quality import Fidelity

        self.calls.append((config.high.name, bundle.v_rank.tolist()))
        return Fidelity(kl=0.0, top1=self.quality[config.high.name], ppl=1.0, ppl_dense=1.0, ppl_ratio=1.0,
                        predictions=10**6, prompt_tokens=1, memory={"ratio_to_fp16": 0.5}, tiers={})


def _bundle(d=64, v_spectrum=None, layers=1, types=None):
    import torch

    from kvcal.bundle import Bundle, ModelInfo

    eye = torch.eye(d).expand(layers, 1, d, d)
    rank = torch.full((layers, 1), d, dtype=torch.int32)
    spec = torch.ones(layers, 1, d) if v_spectrum is None else v_spectrum
    types = types or ["full_attention"] * layers
    return Bundle(ModelInfo("m", "f", "w", "t", "llama", layers, 1, 1, d, types), eye,
                  torch.ones(layers, 1, d), rank, eye, spec, rank, "both", "trace", "activations-text")


def test_precision_ladder_takes_the_cheapest_high_tier_meeting_the_target():
    k8v4, g32, g16, k8v8 = PRECISION_LADDER
    quality = {k8v4: 0.95, g32: 0.96, g16: 0.99, k8v8: 0.999}
    probe = LadderProbe(quality)
    point = Search(probe, _bundle(), QualityTarget()).precision(BASE)
    assert point.settings["high"] == g16 and [c[0] for c in probe.calls] == [k8v4, g32, g16]
    # a head dim that 32 does not divide skips the 32-channel groups, and one of 32 has no 32-channel groups to split
    for d in (48, 32):
        probe = LadderProbe(quality)
        Search(probe, _bundle(d=d), QualityTarget()).precision(BASE)
        assert [c[0] for c in probe.calls] == [k8v4, g16]
    # nothing feasible: the first (cheapest) point comes back, marked infeasible
    probe = LadderProbe(dict.fromkeys(quality, 0.5))
    assert Search(probe, _bundle(), QualityTarget()).precision(BASE).settings["high"] == k8v4


def test_v_ranks_are_rounded_up_to_the_value_group():
    import torch

    from kvcal.profile.ranks import ranks_of

    spectrum = torch.linspace(10, 0.1, 64).reshape(1, 1, 64)
    bundle = _bundle(v_spectrum=spectrum)
    plain = ranks_of(bundle, BASE.with_(v_removal_rate=0.3))[1]
    grouped = ranks_of(bundle, BASE.with_(high=TierFormat.parse("K8V4g16"), v_removal_rate=0.3))[1]
    assert int(plain) % 16 != 0                                 # the test needs a rank the group does not divide
    assert int(grouped) % 16 == 0 and int(plain) < int(grouped) < int(plain) + 16


def test_tier_format_names_round_trip():
    from kvcal.runtime.layout import TierFormat

    for spec in ("K8V4", "K4cV2", "K8V4g32", "K8V4g16kg32", "K4cV2g16", "K16V16", "K4sV4", "K2sV2g16"):
        assert TierFormat.parse(spec).name == spec
    assert TierFormat.parse("K8V4g32").v_group == 32 and TierFormat.parse("K8V4g32").k_group is None
    import pytest

    with pytest.raises(ValueError, match="K8V4g32"):
        TierFormat.parse("K8V4x")


def test_rates_with_the_same_ranks_are_measured_once():
    import torch

    quality = {"K8V4g16": 0.99}
    probe = LadderProbe(quality)
    spectrum = torch.cat([torch.full((60,), 10.0), torch.full((4,), 1e-3)]).reshape(1, 1, 64)
    search = Search(probe, _bundle(v_spectrum=spectrum), QualityTarget())
    base = BASE.with_(high=TierFormat.parse("K8V4g16"))
    a = search.measure("precision", "start", base)
    from kvcal.profile.ranks import rank_from_removal_rate

    assert int(rank_from_removal_rate(spectrum, 0.0001)) < 64          # a real change without value groups
    b = search.measure("ranks", "v 0.0001", base.with_(v_removal_rate=0.0001))   # rounded up to 64 (groups of 16)
    assert len(probe.calls) == 1 and b.label == "v 0.0001" and b.top1 == a.top1 and b.seconds == 0.0
    search.measure("ranks", "v 0.9", base.with_(v_removal_rate=0.9))              # a real rank change
    assert len(probe.calls) == 2 and probe.calls[-1][1] != [[64]]


class ResidualProbe:
    """A fake probe for the residual family: 2-bit keys miss the target, so does every token leaving the window at
    4-bit keys, so do windows under 32 and pruning past alpha_low 0.5; with `quantized_high_misses`, so does any high
    tier that is not fp16."""

    def __init__(self, quantized_high_misses=False):
        self.calls, self.quantized_high_misses = [], quantized_high_misses

    def measure(self, config, bundle):
        from kvcal.profile.quality import Fidelity

        p, low = config.tiering, config.low
        self.calls.append((low.name, p.alpha_high, p.window, p.alpha_low))
        ok = (low.k_bits >= 4 and not (low.k_bits == 4 and p.alpha_high > 100) and p.window >= 32
              and p.alpha_low <= 0.5 and not (self.quantized_high_misses and config.high.k_bits < 16))
        ratio = (0.2 + 0.02 * low.k_bits + 0.01 * low.v_bits + p.window / 1e3 - 0.01 * p.alpha_low
                 - 1e-5 * min(p.alpha_high, 100))
        return Fidelity(kl=0.0, top1=0.99 if ok else 0.9, ppl=1.0, ppl_dense=1.0, ppl_ratio=1.0, predictions=10**6,
                        prompt_tokens=1, memory={"ratio_to_fp16": ratio}, tiers={})


def test_residual_family_walks_cheaper_low_tiers_then_bisects_windows_then_pruning():
    from kvcal.profile.search import RESIDUAL_HIGHS, RESIDUAL_PAGE_TOKENS

    probe = ResidualProbe()
    best = Search(probe, _bundle(), QualityTarget()).residual(BASE)
    c = best.config
    assert (c.high.name, c.low.name, c.page_tokens) == (RESIDUAL_HIGHS[0], "K4cV2m8", RESIDUAL_PAGE_TOKENS)
    # alpha 64 is the first feasible; 16 and 4 keep more heavy hitters for under 1% more bytes, so 4 is taken
    assert (c.tiering.alpha_high, c.tiering.window, c.tiering.alpha_low) == (4.0, 32, 0.5)
    assert ("K2cV2m8", 16.0, 64, 0.0) in probe.calls and not any(call[0] == "K2cV2m8" and call[2] < 64
                                                                for call in probe.calls)
    assert not any(call[2] == 16 and call[3] > 0 for call in probe.calls)     # windows stop at their first miss
    # a search whose residual family misses everywhere keeps none of it
    assert Search(ResidualProbe(), _bundle(), QualityTarget()).residual(BASE.with_tiering(window=8)) is None


def test_residual_family_keeps_fp16_high_tier_where_a_quantized_one_misses():
    from kvcal.profile.search import RESIDUAL_HIGHS

    search = Search(ResidualProbe(quantized_high_misses=True), _bundle(), QualityTarget())
    best = search.residual(BASE)
    assert RESIDUAL_HIGHS[-1] == "K16V16" and best.config.high.name == "K16V16"
    # each cheaper high tier is measured once, at the family's first point, and the walk then runs on fp16
    quantized = [p for p in search.path if p.config.high.k_bits < 16]
    assert len(quantized) == len(RESIDUAL_HIGHS) - 1 and not any(p.feasible for p in quantized)
    assert best.config.low.name == "K4cV2m8" and best.feasible


class TableProbe:
    """A fake probe reading (low tier, alpha_high) -> (feasible, bytes) from a table; anything else misses."""

    def __init__(self, table):
        self.table = table

    def measure(self, config, bundle):
        from kvcal.profile.quality import Fidelity

        ok, ratio = self.table.get((config.low.name, config.tiering.alpha_high), (False, 0.9))
        ok = ok and config.tiering.window == 64 and config.tiering.alpha_low == 0.0
        return Fidelity(kl=0.0, top1=0.99 if ok else 0.9, ppl=1.0, ppl_dense=1.0, ppl_ratio=1.0, predictions=10**6,
                        prompt_tokens=1, memory={"ratio_to_fp16": ratio}, tiers={})


def test_residual_family_keeps_the_cheaper_tier_when_a_cheaper_format_passes_only_at_more_bytes():
    """Measured on smollm2-135m at 4k: K4cV4 passes at alpha 16 (0.385 of fp16), K4cV2 only at alpha 4, where it
    keeps so many fp16 heavy hitters that it costs 0.491; the search must keep K4cV4."""
    from kvcal.runtime.diffkv import EVERY_TOKEN_LOW

    table = {("K8cV4m8", EVERY_TOKEN_LOW): (True, 0.467), ("K4cV4m8", EVERY_TOKEN_LOW): (False, 0.346),
             ("K4cV4m8", 16.0): (True, 0.385), ("K4cV2m8", EVERY_TOKEN_LOW): (False, 0.284),
             ("K4cV2m8", 16.0): (False, 0.327), ("K4cV2m8", 4.0): (True, 0.491)}
    best = Search(TableProbe(table), _bundle(), QualityTarget()).residual(BASE)
    assert (best.config.low.name, best.config.tiering.alpha_high, best.bytes_ratio) == ("K4cV4m8", 16.0, 0.385)


class PruningCostsProbe:
    """A fake probe where any pruning is feasible up to alpha_low 1 but, as on real models with an untracked low
    tier, a little of it costs more bytes (the low tier's score and position) than it drops."""

    def measure(self, config, bundle):
        from kvcal.profile.quality import Fidelity

        p = config.tiering
        ok = p.alpha_low <= 1.0 and (p.alpha_high <= 3.0 or config.high.k_bits == 16)   # residual: any alpha_high
        ratio = 0.30 if p.alpha_low == 0 else 0.33 - 0.01 * p.alpha_low
        return Fidelity(kl=0.0, top1=0.99 if ok else 0.9, ppl=1.0, ppl_dense=1.0, ppl_ratio=1.0, predictions=10**6,
                        prompt_tokens=1, memory={"ratio_to_fp16": ratio}, tiers={})


def test_pruning_is_kept_only_when_it_saves_bytes():
    search = Search(PruningCostsProbe(), _bundle(), QualityTarget())
    best = search.tiers(BASE)
    assert (best.settings["alpha_high"], best.settings["alpha_low"], best.bytes_ratio) == (3.0, 0.0, 0.30)
    assert any(p.settings.get("alpha_low", 0) > 0 and p.feasible for p in search.path)   # pruning was measured
    residual = Search(PruningCostsProbe(), _bundle(), QualityTarget()).residual(BASE)
    assert residual.settings["alpha_low"] == 0.0 and residual.bytes_ratio == 0.30


class LayerBitsProbe:
    """A fake probe where halving a layer's low keys or values adds a fixed KL (`cost[(layer, side)]`) and saves a
    fixed share of bytes; the target is missed once the added KL passes `budget`. 100 prompt + 28 continuation
    tokens, sliding windows of 512: every layer holds all 128 tokens."""

    def __init__(self, cost, budget):
        from types import SimpleNamespace

        import torch

        self.cost, self.budget, self.calls = cost, budget, []
        self.prompt, self.continuation = torch.zeros(1, 100), torch.zeros(1, 28)
        self.model = SimpleNamespace(config=SimpleNamespace(sliding_window=512))

    def measure(self, config, bundle):
        from kvcal.profile.quality import Fidelity

        self.calls.append(config.low_layers + config.sliding_layers)
        steps = [(layer, side) for base, layers in ((config.low, config.low_layers),
                                                    (config.sliding, config.sliding_layers))
                 for layer, fmt in layers for side in ("k_bits", "v_bits") if getattr(fmt, side) < getattr(base, side)]
        kl = 0.001 + sum(self.cost[s] for s in steps)
        return Fidelity(kl=kl, top1=0.99 if kl <= self.budget else 0.9, ppl=1.0, ppl_dense=1.0, ppl_ratio=1.0,
                        predictions=10**6, prompt_tokens=1, memory={"ratio_to_fp16": 0.35 - 0.002 * len(steps)},
                        tiers={})


def test_layer_bits_halves_the_least_sensitive_layers_keys_and_values_apart():
    """KVTuner-style: a one-pass estimate ranks the steps by loss added per byte saved, for the low tier of
    compressed layers and for sliding-window layers alike; as many of the least sensitive as stay feasible apply,
    each count measured."""
    cost = {(layer, side): 0.0001 * (1 + (7 * layer + 3 * (side == "v_bits")) % 11)
            for layer in range(6) for side in ("k_bits", "v_bits")}
    cost[(2, "k_bits")] = 1.0              # alone it misses the target: ranked last, never applied
    probe = LayerBitsProbe(cost, budget=0.0035)
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    asked = []

    def sensitivity(config, formats):
        asked.append({layer: fmt.name for layer, fmt in formats.items()})
        return {(layer, side): cost[(layer, side)] for layer in formats for side in ("k_bits", "v_bits")}

    search = Search(probe, _bundle(layers=6, types=types), QualityTarget(), sensitivity=sensitivity)
    start = search.measure("residual", "start", BASE.with_(low=TierFormat.parse("K4cV4"),
                                                           sliding=TierFormat.parse("K8V4")).with_tiering(alpha_high=3))
    best = search.layer_bits(start)
    assert asked == [{layer: "K4cV4" if t == "full_attention" else "K8V4" for layer, t in enumerate(types)}]
    c = best.config
    chosen = {(layer, side) for layer, fmt in c.low_layers + c.sliding_layers for side in ("k_bits", "v_bits")
              if getattr(fmt, side) < getattr(c.low if types[layer] == "full_attention" else c.sliding, side)}
    assert all(types[layer] == "full_attention" for layer, _ in c.low_layers)
    assert all(types[layer] == "sliding_attention" for layer, _ in c.sliding_layers) and c.sliding_layers
    # code bytes a halving saves per token at head dim 64: 8 -> 4 bits 32, 4 -> 2 bits 16 (every layer holds 128)
    saved = {(layer, side): 32 if (types[layer], side) == ("sliding_attention", "k_bits") else 16
             for layer, side in cost}
    ranked = sorted((cost[s] / saved[s], s) for s in cost)
    n = max(i for i in range(len(ranked) + 1) if 0.001 + sum(cost[s] for _, s in ranked[:i]) <= 0.0035)
    assert chosen == {s for _, s in ranked[:n]} and len(chosen) >= 2
    assert len(probe.calls) <= 1 + 5                          # the start, then a bisection over 12 counts
    assert best.bytes_ratio < start.bytes_ratio and best.feasible
    # a start with nothing to halve (2-bit low keys and values, no sliding format) is returned as is
    two = search.measure("residual", "two", BASE.with_(low=TierFormat.parse("K2cV2")).with_tiering(alpha_high=3))
    assert search.layer_bits(two) is two
    # without an estimator the stage is skipped
    assert Search(probe, _bundle(layers=6, types=types), QualityTarget()).layer_bits(start) is start


def test_layer_bits_settings_round_trip_and_refuse_other_key_modes():
    import pytest

    config = BASE.with_(low=TierFormat.parse("K4cV4"),
                        low_layers=((1, TierFormat.parse("K4cV2")), (3, TierFormat.parse("K2cV4"))))
    settings = config.to_dict()
    assert settings["low_layers"] == {"1": "K4cV2", "3": "K2cV4"}
    assert CompressionConfig.from_dict(settings) == config
    assert config.low_of(1).name == "K4cV2" and config.low_of(2).name == "K4cV4"
    with pytest.raises(ValueError, match="in bits only"):
        config.with_(low_layers=((1, TierFormat.parse("K4V2")),))
    with pytest.raises(ValueError, match="once, ascending"):
        config.with_(low_layers=((3, TierFormat.parse("K4cV2")), (1, TierFormat.parse("K4cV2"))))
    sliding = config.with_(sliding=TierFormat.parse("K8V4"), sliding_layers=((0, TierFormat.parse("K4V4")),))
    assert CompressionConfig.from_dict(sliding.to_dict()) == sliding
    assert sliding.sliding_of(0).name == "K4V4" and sliding.sliding_of(2).name == "K8V4"
    with pytest.raises(ValueError, match="set `sliding` too"):
        config.with_(sliding_layers=((0, TierFormat.parse("K4V4")),))
    with pytest.raises(ValueError, match="per token"):
        sliding.with_(sliding_layers=((0, TierFormat.parse("K4cV4")),))


class SmoothingProbe:
    """A fake probe where channel smoothing changes the KL by `effect` (negative: it helps)."""

    def __init__(self, effect):
        self.effect, self.calls = effect, []

    def measure(self, config, bundle):
        from kvcal.profile.quality import Fidelity

        self.calls.append(config.smooth)
        return Fidelity(kl=0.01 + self.effect * config.smooth, top1=0.99, ppl=1.0, ppl_dense=1.0, ppl_ratio=1.0,
                        predictions=10**6, prompt_tokens=1, memory={"ratio_to_fp16": 0.5}, tiers={})


def test_smoothing_is_kept_only_where_it_lowers_the_kl_and_needs_the_bundles_factors():
    import torch

    bundle = _bundle()
    assert Search(SmoothingProbe(-0.005), bundle, QualityTarget()).smoothing(BASE) is BASE   # no factors: off
    bundle.extras["qk.smoothing"] = torch.ones(1, 1, 64)
    for effect, kept in ((-0.005, True), (0.005, False), (-0.0005, False)):     # -5% of the KL: noise, not kept
        probe = SmoothingProbe(effect)
        assert Search(probe, bundle, QualityTarget()).smoothing(BASE).smooth is kept
        assert sorted(probe.calls) == [False, True]


def test_a_step_saves_the_code_bytes_of_the_tokens_its_layer_holds():
    """Keys 8 -> 4 bits save 32 B per token and head at head dim 64, values 4 -> 2 bits 16 B; a sliding-window layer
    holds only its window (sliding_window - 1 tokens) of the probe's 128."""
    probe = LayerBitsProbe({}, budget=1.0)
    search = Search(probe, _bundle(layers=2, types=["sliding_attention", "full_attention"]), QualityTarget())
    fmt = TierFormat.parse("K8V4")
    assert search._bytes_saved(fmt, "k_bits", 1) == 128 * 32 and search._bytes_saved(fmt, "v_bits", 1) == 128 * 16
    probe.model.config.sliding_window = 65
    assert search._bytes_saved(fmt, "k_bits", 0) == 64 * 32 and search._bytes_saved(fmt, "k_bits", 1) == 128 * 32
