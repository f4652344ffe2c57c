"""Token policies: which tokens the cache keeps, and at which tier (contract: `cache_policy.CachePolicy`).

Each policy is one module that registers its class (and settings dataclass) with `@register`. The imports below fill
the registries, and their order is the order the policies run: DiffKV's tiers first, because the others prune what
they drop from them. A new policy is one file and one line here.
"""

from kvcal.runtime.policies import diffkv, fastgen, h2o, snapkv, streamingllm  # noqa: F401  (registers, in order)
from kvcal.runtime.policies.cache_policy import CACHE_POLICIES, TOKEN_POLICY_CONFIGS, CachePolicy

__all__ = ["CACHE_POLICIES", "TOKEN_POLICY_CONFIGS", "CachePolicy", "cache_policies"]


def cache_policies(kv) -> list[CachePolicy]:
    """The policies `kv.config` enables, built for `kv`, in `CACHE_POLICIES` order."""
    return [cls(kv) for cls in CACHE_POLICIES.values() if cls.enabled(kv.config)]
