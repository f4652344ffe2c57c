"""transformers glue: `KvcalCache` (a `transformers.Cache` over `CompressedKV`), the `kvcal` attention function, and
`QuantizedSlidingLayer` for sliding-window layers. Importing this package imports transformers.

    from kvcal.runtime.hf import KvcalCache
    cache = KvcalCache.from_bundle(bundle, model)
"""

from kvcal.runtime.hf.cache import (
    KVCAL_IMPL,
    KvcalCache,
    KvcalLayer,
    SeenLayer,
    cache_argument,
    dense_bytes,
    install,
    kvcal_attention,
    real_tokens,
)
from kvcal.runtime.hf.sliding import QuantizedSlidingLayer

__all__ = ["KVCAL_IMPL", "KvcalCache", "KvcalLayer", "QuantizedSlidingLayer", "SeenLayer", "cache_argument",
           "dense_bytes", "install", "kvcal_attention", "real_tokens"]
