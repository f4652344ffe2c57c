"""H2O as a cache policy: heavy hitters plus a recent window.

Based on Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
NeurIPS 2023 (arXiv 2306.14048), §3.2 and Algorithm 1. A token's score is the attention it received since it entered,
prompt and decode queries alike (the runtime's cumulative significance: per query the max over the KV head's query
heads, so for GQA a token that any head of the group relies on counts). The most recent `recent` tokens are always
kept (default half the budget, the paper's equal heavy / recent split), the rest of the budget goes to the highest
scores, and eviction is permanent. At prefill the heavy hitters are chosen from the scores of all prompt queries at
once (the paper's real-drop implementation does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.runtime.policies.cache_policy import register
from kvcal.runtime.policies.eviction import BudgetEviction, TokenBudget, rank_by_score


@dataclass(frozen=True)
class H2OConfig(TokenBudget):
    recent: int | None = None      # recent tokens always kept; None: half of the budget

    def __post_init__(self):
        super().__post_init__()
        if self.recent is not None and self.recent < 1:
            raise ValueError(f"`recent={self.recent}` must be >= 1 (or None: half the budget)")

    @property
    def min_tokens(self) -> int:
        return 2                   # one recent token and one heavy hitter

    def recent_for(self, budget: torch.Tensor) -> torch.Tensor:
        """budget int64 [B] -> recent tokens kept [B], at least 1 and leaving at least 1 for heavy hitters."""
        r = budget // 2 if self.recent is None else torch.full_like(budget, self.recent)
        return torch.maximum(torch.ones_like(r), torch.minimum(r, budget - 1))


@register("h2o", config=H2OConfig)
class H2OEviction(BudgetEviction):

    @property
    def reads_scores(self) -> bool:
        return True

    def keep(self, score, pos, length, budget):
        recent = self.settings.recent_for(budget)                                          # [B]
        is_recent = pos >= (length - recent)[:, None, None]
        older = (pos >= 0) & ~is_recent
        heavy = older & (rank_by_score(score, pos, older) < (budget - recent)[:, None, None])
        return is_recent | heavy
