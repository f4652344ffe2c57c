"""What "meets the target" means: `QualityTarget`, one rule for calibrate's search, its report and `kvcal bench`.

Top-1 agreement with dense must hold at a lower confidence bound, not as measured: the search keeps the cheapest point
that passes, so a point that passes by luck is exactly what it would pick (docs/calibration.md). The bound is the one a
held-out evaluation of `held_out_predictions` would apply: a measurement over more predictions (calibrate's probes and
checks score 1024) is held to that smaller evaluation's stricter bound, the margin a bundle needs to meet the target
on text it was not confirmed on.
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
    held_out_predictions: int = 512     # the bound is taken over at most this many predictions (0: over all):
                                        # `kvcal bench`'s default evaluation, 8 windows x 64 steps

    def met(self, measured) -> bool:
        """`measured` (a `Fidelity`, or its dict as reports hold it: top1, predictions, ppl_ratio and optionally
        top1_windows) meets the target: top-1's lower bound at `z` reaches it, and so does the perplexity ratio.

        The search keeps the cheapest point that passes, so a point that passes by luck is exactly what it would
        pick; the bound asks for more evidence the closer a point sits to the target (docs/calibration.md).
        """
        ppl_ratio = measured["ppl_ratio"] if isinstance(measured, Mapping) else measured.ppl_ratio
        return self.top1_bound(measured) >= self.top1 and ppl_ratio <= self.ppl_ratio

    def top1_bound(self, measured) -> float:
        """The lower of two bounds on top-1: Wilson over the predictions, at most `held_out_predictions` of them
        (binomial noise, as the held-out evaluation a bundle must meet would see it: a check that meets its own
        looser bound with no room to spare misses that evaluation about as often as it meets it), and, with two or
        more windows, the mean of per-window top-1 less z standard errors of that mean (variation between
        documents, which the binomial bound does not see: a point can pass on one set of windows and miss on
        another). `measured`: a `Fidelity`, or its dict."""
        if isinstance(measured, Mapping):
            measured = SimpleNamespace(top1=measured["top1"], predictions=measured.get("predictions", 0),
                                       top1_windows=measured.get("top1_windows"))
        n = measured.predictions
        bound = wilson_lower(measured.top1, min(n, self.held_out_predictions) if self.held_out_predictions else n,
                             self.z)
        return min(bound, window_lower(getattr(measured, "top1_windows", None) or [], self.z))

    def with_(self, **changes) -> QualityTarget:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, float]:
        return {"top1": self.top1, "ppl_ratio": self.ppl_ratio, "z": self.z,
                "held_out_predictions": self.held_out_predictions}

    @classmethod
    def from_dict(cls, data: dict | None) -> QualityTarget:
        """The target a report or bundle recorded (keys top1, ppl_ratio, z, held_out_predictions; absent ones take
        the defaults, except held_out_predictions: 0, the bound over every prediction that targets recorded before it
        were decided by); ValueError on anything else, so a hand-edited file cannot pass as a target it is not."""
        data = {"held_out_predictions": 0, **(data or {})}
        unknown = set(data) - {"top1", "ppl_ratio", "z", "held_out_predictions"}
        if unknown:
            raise ValueError(f"quality target has unknown keys {sorted(unknown)}; it takes top1, ppl_ratio, z and "
                             "held_out_predictions")
        try:
            values = {k: float(v) for k, v in data.items()}
            count = values["held_out_predictions"]
            if count != int(count) or count < 0:
                raise ValueError
            return cls(**{**values, "held_out_predictions": int(count)})
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"quality target {data} holds a value that is not a number (held_out_predictions: a "
                             "count >= 0)") from None


def bound_in_words(target: Mapping) -> str:
    """A recorded target's (its dict's) top-1 bound as reports say it: 'Wilson bound at z = 1.5 over at most 512
    predictions'; targets recorded before `held_out_predictions` took the bound over every prediction."""
    n = target.get("held_out_predictions", 0)
    over = f"at most {n} predictions" if n else "every prediction"
    return f"Wilson bound at z = {target.get('z', 0):g} over {over}"


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
