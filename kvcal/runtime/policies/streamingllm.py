"""StreamingLLM as a cache policy: attention sinks plus a recent window.

Based on Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024 (arXiv 2309.17453), §3.2:
the first `sinks` tokens plus the most recent budget - sinks. Cached keys keep their original RoPE positions (the
paper re-indexes positions inside the cache; within the model's window the original positions are the usual
re-implementation, as in kvpress).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.runtime.policies.cache_policy import register
from kvcal.runtime.policies.eviction import BudgetEviction, TokenBudget


@dataclass(frozen=True)
class StreamingLLMConfig(TokenBudget):
    sinks: int = 4                 # first tokens always kept (the paper's 4 attention sinks)

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"`sinks={self.sinks}` must be >= 0")

    @property
    def min_tokens(self) -> int:
        return self.sinks + 1


@register("streamingllm", config=StreamingLLMConfig)
class StreamingLLMEviction(BudgetEviction):

    def keep(self, score, pos, length, budget):
        sinks = self.settings.sinks
        real = pos - self.kv.n_pad[:, None, None]
        return (real < sinks) | (pos >= (length - (budget - sinks))[:, None, None])
