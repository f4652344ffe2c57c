"""Token-budget eviction: the shared half of the H2O, SnapKV and StreamingLLM policies.

Each of them keeps, per (sequence, KV head), at most `budget(n)` of the n real tokens seen so far and drops the rest
from the store for good (at prefill: never written; at decode: `CompressedStore.drop`, whose hole the next token
reuses). They differ only in which tokens they keep (`keep`) and in when they evict (SnapKV: at prefill only).

    budget(n) = ceil(fraction * n), clipped to [min_tokens, n]

`fraction` is the share of tokens kept. A caller that budgets bytes rather than tokens converts once: `kvcal bench`
gives each baseline the fraction at which its store bytes per token (`PageLayout.bytes_per_token`) times the kept
tokens equal a bytes ratio of fp16 (docs/bench.md). Budgets count real tokens: left padding is neither counted nor
kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcal.runtime.policies.cache_policy import CachePolicy, Prompt
from kvcal.runtime.policies.diffkv import TIER_PRUNED
from kvcal.runtime.storage.pages import HIGH, LOW


@dataclass(frozen=True)
class TokenBudget:
    """The settings every budgeted eviction shares (the policies' own dataclasses extend it)."""

    fraction: float = 0.5          # share of the tokens seen that each (sequence, KV head) keeps

    def __post_init__(self):
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"`fraction={self.fraction}` (share of tokens kept) must be in (0, 1]")

    @property
    def min_tokens(self) -> int:
        """Fewest tokens kept, whatever the fraction (the policy's fixed parts must fit)."""
        return 1

    def tokens(self, n: int) -> int:
        """Tokens kept once n real tokens have been seen. The epsilon keeps exact products (0.3 * 10) from rounding
        up."""
        return min(n, max(math.ceil(self.fraction * n - 1e-9), self.min_tokens))


def rank_by_score(score: torch.Tensor, pos: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
    """int64 [B, H, S]: each slot's rank among the slots `among` (bool [B, H, S]) by score descending, ties to the
    lower cache index; slots outside `among` rank after all of them. score float32, pos int64 [B, H, S]."""
    B, H, S = pos.shape
    big = torch.iinfo(torch.int64).max
    by_pos = torch.where(among, pos, torch.full_like(pos, big)).argsort(dim=-1, stable=True)
    s = torch.where(among, score.float(), torch.full_like(score, float("-inf"), dtype=torch.float32))
    order = by_pos.gather(-1, s.gather(-1, by_pos).argsort(dim=-1, descending=True, stable=True))
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(S, device=pos.device).expand(B, H, S))
    return rank


class BudgetEviction(CachePolicy):
    """A policy that evicts down to a token budget. Subclasses give `settings` (a TokenBudget) and `keep`; set
    `evicts_in_decode = False` to evict at prefill only."""

    evicts_in_decode = True

    @property
    def settings(self) -> TokenBudget:
        return getattr(self.kv.config, self.name)

    def keep(self, score: torch.Tensor, pos: torch.Tensor, length: int, budget: torch.Tensor) -> torch.Tensor:
        """Which stored tokens to keep, bool [B, H, S], when an entry holds more than its budget.

        score float32 [B, H, S] cumulative significance (the runtime's: attention probability max over the KV head's
        query heads, summed over queries); pos int64 [B, H, S] cache index, -1 = empty slot; length: cache length
        (padding included); budget int64 [B] tokens to keep per entry of each sequence.
        """
        raise NotImplementedError

    def budget(self, real: torch.Tensor) -> torch.Tensor:
        """real int64 [B] real tokens seen -> int64 [B] tokens kept."""
        return torch.tensor([self.settings.tokens(int(n)) for n in real.tolist()], device=real.device)

    def _kept(self, score, pos, length: int) -> torch.Tensor:
        valid = pos >= 0
        budget = self.budget(length - self.kv.n_pad)                                      # [B]
        over = valid.sum(-1) > budget[:, None]                                            # [B, H]
        return valid & (~over[..., None] | self.keep(score, pos, length, budget))

    def prefill(self, layer: int, tier: torch.Tensor, prompt: Prompt) -> torch.Tensor:
        kept = self._kept(prompt.score, prompt.pos, prompt.pos.shape[-1])
        return torch.where(kept, tier, torch.full_like(tier, TIER_PRUNED))

    def decode(self, layer: int) -> None:
        if not self.evicts_in_decode:
            return
        kv = self.kv
        B, H = kv.batch, kv.store.num_kv_heads
        b, h = kv.every_entry()
        sides = [(t.view(B, H, -1) for t in kv.store.section_meta(layer, side, b, h)) for side in (HIGH, LOW)]
        (hi_s, hi_p), (lo_s, lo_p) = sides
        kept = self._kept(torch.cat([hi_s, lo_s], -1), torch.cat([hi_p, lo_p], -1), kv.length[layer])
        width = hi_p.shape[-1]
        for side, pos, k in ((HIGH, hi_p, kept[..., :width]), (LOW, lo_p, kept[..., width:])):
            db, dh, ds = torch.nonzero((pos >= 0) & ~k, as_tuple=True)
            if len(db):
                kv.store.drop(layer, side, db, dh, ds)
