"""What "meets the target" means: `QualityTarget`, one rule for calibrate's search, its report and `kvcal bench`.

Top-1 agreement with dense must hold at a lower confidence bound, not as measured: the search keeps the cheapest point
that passes, so a point that passes by luck is exactly what it would pick (docs/calibration.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import SimpleNamespace


@dataclass(frozen=True)
class QualityTarget:
    """What "meets the target" means, for calibrate's search, its report and `kvcal bench` alike."""

    top1: float = 0.97          # top-1 agreement with dense on held-out text
    ppl_ratio: float = 1.02     # continuation perplexity / dense perplexity
    z: float = 1.5              # top-1 must hold at this many standard errors (Wilson lower bound), see `met`

    def met(self, measured) -> bool:
        """`measured` (a `Fidelity`, or its dict as reports hold it: top1, predictions, ppl_ratio and optionally
        top1_windows) meets the target: top-1's lower bound at `z` reaches it, and so does the perplexity ratio.

        The search keeps the cheapest point that passes, so a point that passes by luck is exactly what it would
        pick; the bound asks for more evidence the closer a point sits to the target (docs/calibration.md).
        """
        ppl_ratio = measured["ppl_ratio"] if isinstance(measured, Mapping) else measured.ppl_ratio
        return self.top1_bound(measured) >= self.top1 and ppl_ratio <= self.ppl_ratio

    def top1_bound(self, measured) -> float:
        """The lower of two bounds on top-1: Wilson over all predictions (binomial noise), and, with two or more
        windows, the mean of per-window top-1 less z standard errors of that mean (variation between documents,
        which the binomial bound does not see: a point can pass on one set of windows and miss on another).
        `measured`: a `Fidelity`, or its dict."""
        if isinstance(measured, Mapping):
            measured = SimpleNamespace(top1=measured["top1"], predictions=measured.get("predictions", 0),
                                       top1_windows=measured.get("top1_windows"))
        bound = wilson_lower(measured.top1, measured.predictions, self.z)
        return min(bound, window_lower(getattr(measured, "top1_windows", None) or [], self.z))

    def with_(self, **changes) -> QualityTarget:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, float]:
        return {"top1": self.top1, "ppl_ratio": self.ppl_ratio, "z": self.z}

    @classmethod
    def from_dict(cls, data: dict | None) -> QualityTarget:
        """The target a report or bundle recorded (keys top1, ppl_ratio, z; absent ones take the defaults); ValueError
        on anything else, so a hand-edited file cannot pass as a target it is not."""
        data = dict(data or {})
        unknown = set(data) - {"top1", "ppl_ratio", "z"}
        if unknown:
            raise ValueError(f"quality target has unknown keys {sorted(unknown)}; it takes top1, ppl_ratio and z")
        try:
            return cls(**{k: float(v) for k, v in data.items()})
        except (TypeError, ValueError):
            raise ValueError(f"quality target {data} holds a value that is not a number") from None


def window_lower(per_window: list[float], z: float) -> float:
    """Mean of per-window values less z standard errors of the mean (sample sd); 1.0 with fewer than two windows."""
    n = len(per_window)
    if n < 2 or z <= 0:
        return 1.0
    mean = sum(per_window) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in per_window) / (n - 1))
    return mean - z * sd / math.sqrt(n)


def wilson_lower(p: float, n: int, z: float) -> float:
    """Wilson score lower bound of a proportion p observed over n trials."""
    if n <= 0 or z <= 0:
        return p
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n)
