"""SnapKV as a cache policy: the prompt is compressed once, by the votes of its last queries.

Based on Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024 (arXiv 2404.14469),
§4.2 and Listing 1. The last `window` prompt queries are the observation window; each earlier prompt token's score is
the attention probability those queries give it, summed over the window and over the KV head's query heads, then
average-pooled along the sequence (kernel `kernel`); the top (prompt budget - window) earlier tokens plus the window
are kept. Decode tokens are appended without further eviction, as in SnapKV. So that the budget still holds after
`reserve` decode steps, the prompt budget is budget(n + reserve) - reserve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcal.runtime.policies.cache_policy import Prompt, PromptAttention, register
from kvcal.runtime.policies.eviction import BudgetEviction, TokenBudget, rank_by_score


@dataclass(frozen=True)
class SnapKVConfig(TokenBudget):
    window: int = 32               # observation window: the last prompt queries that vote (the paper's 32)
    kernel: int = 7                # average-pooling kernel along the sequence (odd; the paper's 7)
    reserve: int = 0               # decode steps the budget must still hold after

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1 or self.reserve < 0:
            raise ValueError(f"need `window` >= 1 and `reserve` >= 0 (got {self.window}, {self.reserve})")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"`kernel={self.kernel}` must be odd and >= 1 (pooling keeps the sequence length)")

    @property
    def min_tokens(self) -> int:
        return self.window + 1

    def prompt_tokens(self, n: int) -> int:
        """Prompt tokens kept after a prefill of n, so that n + reserve tokens later the budget is met exactly."""
        return min(n, max(self.tokens(n + self.reserve) - self.reserve, self.min_tokens))


@register("snapkv", config=SnapKVConfig)
class SnapKVEviction(BudgetEviction):
    evicts_in_decode = False

    def prompt_statistics(self, attention: PromptAttention, real, score) -> torch.Tensor:
        """Window votes float32 [B, H, n]: the probability the last `window` queries give each key, summed over them
        and over the g query heads (one small extra block: the prefill's blocks do not end at the window)."""
        n = attention.query.shape[3]
        w = min(self.settings.window, n)
        return attention.probs(slice(n - w, n)).sum(dim=(2, 3))

    def budget(self, real: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.settings.prompt_tokens(int(n)) for n in real.tolist()], device=real.device)

    def prefill(self, layer: int, tier: torch.Tensor, prompt: Prompt) -> torch.Tensor:
        votes = prompt.statistics.get(self.name)
        if votes is None:
            raise ValueError("SnapKV is on but this prefill has no window votes (record with SnapKV on)")
        return super().prefill(layer, tier, Prompt(votes, prompt.pos, prompt.length, prompt.statistics))

    def keep(self, score, pos, length, budget):
        B, H, S = pos.shape
        cfg = self.settings
        start = length - cfg.window                                      # the window: the last `window` indices
        if start <= 0:                                                   # the prompt is all window
            return pos >= 0
        k = cfg.kernel
        pooled = F.avg_pool1d(score[..., :start].reshape(B * H, 1, -1), kernel_size=k, padding=k // 2, stride=1)
        pooled = torch.cat([pooled.reshape(B, H, -1), score.new_zeros(B, H, S - start)], dim=-1)
        prefix = (pos >= 0) & (pos < start)
        top = prefix & (rank_by_score(pooled, pos, prefix) < (budget - cfg.window)[:, None, None])
        return top | (pos >= start)
