"""Token policies as components: the contract between `CompressedKV` and each policy it serves with.

A token policy decides which tokens the cache keeps and at which tier. It is one small class with one method for
the prompt and one for each decode token. `CompressedKV` builds the policies its config enables, in the order of
`CACHE_POLICIES`, and calls them in turn, so a new policy is one file and one line there.

    prefill(layer, tier, prompt) -> tier   tier int8 [B, H, n] (policy.TIER_HIGH / TIER_LOW / TIER_PRUNED) of the
                                           prompt, as the policies before this one left it
    decode(layer)                          after each new token of `layer` is stored (one step of the policy)

A policy that needs more of the prompt than its significance (FastGen's recovery of each head) computes it in
`prompt_statistics`, from the uncompressed prompt; the result is recorded with the prefill (`CompressedKV.recorder`),
so a search can replay the prompt into caches with other settings without running the model again.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

# name -> "module:Class", in the order the policies run (DiffKV tiers first: FastGen prunes what it drops from them)
CACHE_POLICIES = {
    "diffkv": "kvcal.runtime.policy:DiffKVTiers",
    "fastgen": "kvcal.runtime.fastgen:FastGenEviction",
}


@dataclass
class Prompt:
    """What a policy sees of a prompt at prefill."""

    score: torch.Tensor        # float32 [B, H, n] significance from the dense prefill attention
    pos: torch.Tensor          # int64 [B, H, n] cache index, -1 = padding
    length: torch.Tensor       # int64 [B] cache length (padding included)
    statistics: dict = field(default_factory=dict)   # policy name -> its `prompt_statistics` (None: not recorded)


class CachePolicy(ABC):
    """One token policy of one `CompressedKV` (it reads the cache's config, store, lengths and padding)."""

    name: ClassVar[str]

    def __init__(self, kv):
        self.kv = kv

    @classmethod
    def enabled(cls, config) -> bool:
        """Whether `config` (a CompressionConfig) turns this policy on."""
        return True

    def prompt_statistics(self, query, key, real, score, scale) -> torch.Tensor | None:
        """Statistics of the uncompressed prompt this policy needs at prefill: query [B, H, g, n, d], key
        [B, H, n, d], real bool [B, n], score [B, H, n]. None: it needs none."""
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


def cache_policies(kv) -> list[CachePolicy]:
    """The policies `kv.config` enables, built for `kv`, in `CACHE_POLICIES` order."""
    out = []
    for where in CACHE_POLICIES.values():
        module, name = where.split(":")
        cls = getattr(importlib.import_module(module), name)
        if cls.enabled(kv.config):
            out.append(cls(kv))
    return out
