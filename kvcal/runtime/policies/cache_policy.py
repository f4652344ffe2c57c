"""Token policies as components: the contract between `CompressedKV` and each policy it serves with.

A token policy decides which tokens the cache keeps and at which tier. It is one small class with one method for
the prompt and one for each decode token. `CompressedKV` builds the policies its config enables, in the order of
`CACHE_POLICIES`, and calls them in turn. A policy registers itself with `@register(name, config=...)` on its class,
so a new policy is one file and one import line in `kvcal/runtime/policies/__init__.py` (whose import order is the
run order).

    prefill(layer, tier, prompt) -> tier   tier int8 [B, H, n] (diffkv.TIER_HIGH / TIER_LOW / TIER_PRUNED) of the
                                           prompt, as the policies before this one left it
    decode(layer)                          after each new token of `layer` is stored (one step of the policy)

A policy that needs more of the prompt than its significance (FastGen's recovery of each head, SnapKV's window
votes) computes it in `prompt_statistics`, from the uncompressed prompt and the prefill's attention probabilities
(`PromptAttention`); the result is recorded with the prefill (`CompressedKV.recorder`), so a search can replay the
prompt into caches with other settings without running the model again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvcal.runtime.backends.base import prompt_probs

# name -> policy class, in the order the policies run (registration order: policies/__init__.py imports them)
CACHE_POLICIES: dict[str, type[CachePolicy]] = {}
# `CompressionConfig` field / settings key -> the settings dataclass of the policy it turns on (None there: off)
TOKEN_POLICY_CONFIGS: dict[str, type] = {}


def register(name: str, *, config: type | None = None):
    """Class decorator: enter a `CachePolicy` subclass in `CACHE_POLICIES` as `name`, and its settings dataclass
    `config` in `TOKEN_POLICY_CONFIGS` (the policy is then on where `CompressionConfig.<name>` is not None)."""
    def add(cls):
        assert name not in CACHE_POLICIES, f"cache policy `{name}` registered twice"
        cls.name = name
        CACHE_POLICIES[name] = cls
        if config is not None:
            TOKEN_POLICY_CONFIGS[name] = config
        return cls
    return add


@dataclass
class Prompt:
    """What a policy sees of a prompt at prefill."""

    score: torch.Tensor        # float32 [B, H, n] significance from the dense prefill attention
    pos: torch.Tensor          # int64 [B, H, n] cache index, -1 = padding
    length: torch.Tensor       # int64 [B] cache length (padding included)
    statistics: dict = field(default_factory=dict)   # policy name -> its `prompt_statistics` (None: not recorded)


class PromptAttention:
    """What a prefill attended with, for a policy that needs the prompt's attention probabilities again:
    query [B, H, g, n, d] and keys [B, H, n, d] float32, mask bool [B, n, n] causal, the softmax scale."""

    def __init__(self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float):
        self.query, self.keys, self.mask, self.scale = query, keys, mask, scale

    def probs(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """float32 [B, H, g, c, w] probabilities of query rows `rows` (`backends.base.prompt_probs`: the same function
        the prefill ran, so the same numbers)."""
        return prompt_probs(self.query, self.keys, self.mask, self.scale, rows)


class CachePolicy(ABC):
    """One token policy of one `CompressedKV` (it reads the cache's config, store, lengths and padding)."""

    name: ClassVar[str]

    def __init__(self, kv):
        self.kv = kv

    @classmethod
    def enabled(cls, config) -> bool:
        """Whether `config` (a CompressionConfig) turns this policy on: its settings field is set, or always for a
        policy registered without settings."""
        return cls.name not in TOKEN_POLICY_CONFIGS or getattr(config, cls.name) is not None

    @property
    def reads_scores(self) -> bool:
        """Whether `decode` reads the stored tokens' cumulative scores, so decode attention must keep adding to them
        (tracking costs a second pass over the probabilities on every backend)."""
        return False

    def prompt_statistics(self, attention: PromptAttention, real: torch.Tensor,
                          score: torch.Tensor) -> torch.Tensor | None:
        """Statistics of the uncompressed prompt this policy needs at prefill: attention (what the prefill attended
        with), real bool [B, n], score [B, H, n]. None: it needs none."""
        return None

    @abstractmethod
    def prefill(self, layer: int, tier: torch.Tensor, prompt: Prompt) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, layer: int) -> None: ...

    def select_rows(self, index: torch.Tensor) -> None:
        """Sequence i is now old sequence index[i] (beam search, batch selection): re-index per-sequence state.
        A policy with none keeps this default."""
        return

    def crop(self, length: int) -> None:
        """The cache was cut back to `length` tokens (CompressedKV.crop): forget state of the removed tokens.
        A policy with none keeps this default."""
        return
