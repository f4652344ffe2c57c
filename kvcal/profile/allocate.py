"""Allocation by the quality model: per layer and KV head, keys and values apart, the bits that minimise bytes under
a predicted-loss budget (a multiple-choice knapsack).

Every (layer, KV head, side) of a paged layer is one group with one choice per entry of the catalogue
(`quality_model.BITS`), each with a predicted loss (the quality model's table) and a byte cost at the recorded
context; a sliding-window layer's heads choose together (the runtime stores one format per sliding layer). The high
tier's format (`quality_model.HIGH`) and the heavy-hitter threshold (`quality_model.ALPHAS`) are each one choice for
every layer.
For a price λ every group takes argmin loss + λ · bytes; sweeping λ traces the lower convex hull of the bytes-loss
frontier (`frontier`), cheapest in loss first. A budget picks the cheapest hull
point within it (`allocate`). The cost is linear in groups × choices, a few milliseconds for any model here.

    hull = frontier(costs)              # [Allocation], predicted loss ascending, bytes descending
    bits = allocate(costs, budget).bits
    config = to_config(base, costs, allocation)

Past a point that meets the target, the hull's next moves (`hull_steps`) can be measured one at a time and taken in
the order of their measured loss per byte, the others in the table's order (`measured_path`): the table prices each
move from one recording, and a move whose error the network amplifies more than its gradient says is priced too
cheap (docs/calibration.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcal.profile.quality_model import ALPHAS, BASE_ALPHA, BITS, HIGH, FormatCosts, layer_format
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.storage.layout import TierFormat

# The frame the allocation fills in (KIVI's layout inside DiffKV's tiers): the newest WINDOW tokens held exact
# outside the pages (`exact_window`), the heavy hitters (mean attention >= HEAVY_HITTERS / N) in the high tier, every
# other token of a paged layer in its low-tier format, keys per channel over pages of PAGE_TOKENS low tokens, 2- and
# 4-bit codes on calibrated levels (`quality_model.LEVELED`); a sliding-window layer's window in its sliding format,
# keys per channel over blocks of PAGE_TOKENS tokens (KIVI's layout: per-token keys at 4 bits read 8 times the KL),
# values per token in groups of 32 channels where the head dim allows (a whole 256-wide vector at 4 bits reads twice
# the KL), no recent tokens at 16 bits (`sliding_recent`: the quality model and the coded probe read it when set; why
# it is not, and those measurements: docs/calibration.md).
WINDOW, HEAVY_HITTERS, PAGE_TOKENS = 16, ALPHAS[BASE_ALPHA], 32
LOW, SLIDING = "K4cnV4nm8", "K8cV8g32m8"


def base_settings(layer_types: list[str], window: int | None = None, head_dim: int | None = None) -> CompressionConfig:
    """The settings an allocation changes the bits of (the formats above; `window` newest tokens held exact,
    default `WINDOW`; a head dim that 32 does not divide codes sliding values in one group)."""
    sliding = TierFormat.parse(SLIDING) if "sliding_attention" in layer_types else None
    if sliding is not None and head_dim is not None and head_dim % sliding.v_group:
        sliding = dataclasses.replace(sliding, v_group=None)
    return CompressionConfig(high=TierFormat(16, 16), low=TierFormat.parse(LOW), page_tokens=PAGE_TOKENS,
                             tiering=TieringConfig(window=window or WINDOW, alpha_high=HEAVY_HITTERS), sliding=sliding,
                             exact_window=True)


@dataclass(frozen=True)
class Allocation:
    bits: torch.Tensor        # long [L, H, 2]: (K bits, V bits) per layer and KV head, entries of BITS
    predicted: float          # the loss it adds (FormatCosts.predicted)
    held_bytes: float         # bytes its formats hold at the recorded context (FormatCosts.held_bytes)
    high: int = 0             # the high tier's format: HIGH[high]
    alpha: int = BASE_ALPHA   # the heavy-hitter threshold: ALPHAS[alpha]

    @classmethod
    def of(cls, costs: FormatCosts, bits: torch.Tensor, high: int = 0, alpha: int = BASE_ALPHA) -> Allocation:
        """bits long [L, H, 2] or [L, 2] (every head of a layer alike; entries of BITS), the high tier HIGH[high],
        heavy hitters at ALPHAS[alpha], priced."""
        bits = costs.per_head(bits).clone()
        return cls(bits, costs.predicted(bits, high, alpha), costs.held_bytes(bits, high, alpha), high, alpha)


def _priced(costs: FormatCosts, alpha: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, bytes) float64 [L, H, 2, len(BITS)] per (layer, KV head, side) and choice, heavy hitters at
    ALPHAS[alpha]."""
    return costs.costs[..., alpha], costs.head_bytes() * costs.tokens[:, alpha, None, None, None]


def at_price(costs: FormatCosts, price: float, high: int = 0, alpha: int = BASE_ALPHA) -> Allocation:
    """Every group's argmin loss + price · bytes (ties: the wider format), with the high tier in HIGH[high] and heavy
    hitters at ALPHAS[alpha]."""
    loss, nbytes = _priced(costs, alpha)
    total = loss + price * nbytes                                                  # [L, H, 2, len(BITS)]
    tied = torch.tensor(costs.sliding)[:, None, None]                              # a sliding layer's heads together
    choice = torch.where(tied, total.sum(1).argmin(-1)[:, None], total.argmin(-1))
    return Allocation.of(costs, torch.tensor(BITS)[choice], high, alpha)


def frontier(costs: FormatCosts, steps: int = 400) -> list[Allocation]:
    """The distinct allocations along λ from 0 (every group at its least loss) to a price where every group takes
    its fewest bytes, predicted loss ascending. λ runs over a log grid spanning the ratios of loss to bytes that occur
    in the table, so every breakpoint of the hull lies between two grid points (up to ties). The high tier and the
    heavy-hitter threshold are each one choice for all layers (the runtime has one of each): at each λ, the pair
    whose allocation costs least at that price."""
    ratios = []
    for alpha in range(len(ALPHAS)):
        loss, nbytes = _priced(costs, alpha)
        d_loss = (loss[..., 1:] - loss[..., :1]).abs()
        d_bytes = (nbytes[..., :1] - nbytes[..., 1:]).abs().clamp(min=1e-12)
        ratios.append((d_loss / d_bytes)[d_loss > 0])
    ratios = torch.cat(ratios)
    prices = [0.0]
    if ratios.numel():
        low, high = ratios.min().log10().item() - 1, ratios.max().log10().item() + 1
        prices += torch.logspace(low, high, steps, dtype=torch.float64).tolist()
    hull, seen = [], set()
    for price in prices:
        a = min((at_price(costs, price, tier, alpha) for tier in range(len(HIGH)) for alpha in range(len(ALPHAS))),
                key=lambda a: a.predicted + price * a.held_bytes)
        key = (a.high, a.alpha, *a.bits.flatten().tolist())
        if key not in seen:
            seen.add(key)
            hull.append(a)
    return sorted(hull, key=lambda a: (a.predicted, -a.held_bytes))


def allocate(costs: FormatCosts, budget: float) -> Allocation:
    """The fewest-bytes hull point whose predicted loss is within `budget` (the least-loss one if none is)."""
    hull = frontier(costs)
    within = [a for a in hull if a.predicted <= budget]
    return min(within, key=lambda a: a.held_bytes) if within else hull[0]


@dataclass(frozen=True)
class Step:
    """One move of the hull: the entries of one (layer, side) that change together (every KV head of a sliding
    layer; one head of a paged layer) and the bits each takes."""

    layer: int
    side: int                                # 0: keys, 1: values
    heads: tuple[int, ...]
    bits: tuple[int, ...]                    # per head in `heads`, entries of BITS

    def applied(self, bits: torch.Tensor) -> torch.Tensor:
        """bits long [L, H, 2] with this move made (a copy)."""
        bits = bits.clone()
        bits[self.layer, list(self.heads), self.side] = torch.tensor(self.bits)
        return bits

    def alone(self, costs: FormatCosts, start: Allocation) -> Allocation:
        """`start` with this move alone made."""
        return Allocation.of(costs, self.applied(start.bits), start.high, start.alpha)

    def __str__(self) -> str:
        return f"layer {self.layer} {'KV'[self.side]} heads {','.join(map(str, self.heads))} -> {self.bits[0]} bits"


def hull_steps(hull: list[Allocation], start: int) -> list[Step]:
    """The moves the hull makes past hull[start], in hull order: the entries that change between consecutive
    points, one move per (layer, side) and KV head (its first). Stops where the high tier or the heavy-hitter
    threshold changes: a move is then not one group's."""
    steps, seen = [], set()
    for a, b in zip(hull[start:], hull[start + 1:]):
        if (a.high, a.alpha) != (b.high, b.alpha):
            break
        changed = (a.bits != b.bits).nonzero().tolist()                     # [(layer, head, side)]
        for layer, side in dict.fromkeys((layer, side) for layer, _, side in changed):
            heads = tuple(h for m, h, s in changed if (m, s) == (layer, side) and (layer, h, side) not in seen)
            if heads:
                seen.update((layer, h, side) for h in heads)
                steps.append(Step(layer, side, heads, tuple(b.bits[layer, h, side].item() for h in heads)))
    return steps


def measured_path(costs: FormatCosts, start: Allocation, steps: list[Step], added: list[float | None]
                  ) -> list[Allocation]:
    """`start` with the moves taken one more at a time, cheapest in loss per byte saved first: `added`
    [len(steps)], each move's loss increase measured alone on `start` (in the table's units), or None where it was
    not measured: the table's increase times the median ratio of measured to table increases (the table ranks the
    moves it was not asked about; the measurements correct its scale). A path point's `predicted` is start's plus
    the increases it holds (the first-order sum the table also assumes), so the path's predictions rise as the
    hull's do."""
    moved = [s.alone(costs, start) for s in steps]
    table = [a.predicted - start.predicted for a in moved]
    ratios = sorted(m / t for m, t in zip(added, table) if m is not None and t > 0)
    scale = ratios[len(ratios) // 2] if ratios else 1.0
    added = [max(t * scale if m is None else m, 0.0) for m, t in zip(added, table)]
    saved = [start.held_bytes - a.held_bytes for a in moved]
    order = sorted(range(len(steps)), key=lambda j: added[j] / max(saved[j], 1e-12))
    path, bits, predicted = [], start.bits, start.predicted
    for j in order:
        bits = steps[j].applied(bits)
        predicted += added[j] + 1e-12 * max(abs(predicted), 1.0)                    # strictly rising
        path.append(dataclasses.replace(Allocation.of(costs, bits, start.high, start.alpha), predicted=predicted))
    return path


def to_config(base: CompressionConfig, costs: FormatCosts, allocation: Allocation) -> CompressionConfig:
    """`base` with the allocation's bits [L, H, 2], its high tier and heavy-hitter threshold: a paged layer's low
    tier at the format most of its KV heads take (`low_layers`, unless it is the base format), each other head's in
    `low_heads`; a sliding layer's format in `sliding_layers` (unless it is the base's)."""
    low, heads, sliding = [], [], []
    for layer, per_head in enumerate(allocation.bits.tolist()):
        is_sliding = costs.sliding[layer]
        fmts = [layer_format(base, is_sliding, k, v) for k, v in per_head]
        fmt = max(fmts, key=fmts.count)                 # the most common, the lowest head's on a tie
        if fmt != (base.sliding if is_sliding else base.low):
            (sliding if is_sliding else low).append((layer, fmt))
        heads += [(layer, h, own) for h, own in enumerate(fmts) if own != fmt]
    return base.with_tiering(alpha_high=ALPHAS[allocation.alpha]).with_(
        high=TierFormat.parse(HIGH[allocation.high]), low_layers=tuple(low), low_heads=tuple(heads),
        sliding_layers=tuple(sliding))
