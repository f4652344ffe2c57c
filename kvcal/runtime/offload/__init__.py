"""KVPR offloading: the KV cache on the host, a prefix of it recomputed on the device each decode step.

    cache.py     HostTier (X and K/V on the host) and OffloadedCache (a transformers Cache: recompute + transfer)
    kvpr.py      the cost model (KVPR Eq. 6-11) and the split solver, pure Python
    profiler.py  link and recompute throughput of this machine, cached per machine

See docs/offload.md.
"""

from kvcal.runtime.offload.cache import HostTier, OffloadedCache, OffloadedLayer

__all__ = ["HostTier", "OffloadedCache", "OffloadedLayer"]
