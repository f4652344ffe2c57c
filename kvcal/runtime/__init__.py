"""kvcal's runtime: serve a calibrated bundle as a compressed, paged KV cache. Depends on torch, safetensors and
transformers (for `hf/` and `offload/`), and optionally cuda-python; never on another part of kvcal.

    from kvcal.runtime import CompressionConfig, KvcalCache, load_bundle
    bundle = load_bundle("model.kvcal.safetensors")      # the artefact (`kvcal.runtime.bundle`) belongs to the runtime
    cache = KvcalCache.from_bundle(bundle, model, CompressionConfig.from_dict(bundle.settings), tokenizer=tok)

The names below are the public API; they load on first use, so importing one module of the runtime does not import
transformers. Importing it changes nothing in the host process (no environment variables, logging or torch settings).
"""

from __future__ import annotations

import importlib

_WHERE = {
    "Bundle": "kvcal.runtime.bundle",
    "BundleError": "kvcal.runtime.bundle",
    "BundleMismatchError": "kvcal.runtime.bundle",
    "load_bundle": "kvcal.runtime.bundle",
    "save_bundle": "kvcal.runtime.bundle",
    "CompressionConfig": "kvcal.runtime.config",
    "ServeOptions": "kvcal.runtime.options",
    "TieringConfig": "kvcal.runtime.policies.diffkv",
    "FastGenConfig": "kvcal.runtime.policies.fastgen",
    "H2OConfig": "kvcal.runtime.policies.h2o",
    "SnapKVConfig": "kvcal.runtime.policies.snapkv",
    "StreamingLLMConfig": "kvcal.runtime.policies.streamingllm",
    "CachePolicy": "kvcal.runtime.policies.cache_policy",
    "TierFormat": "kvcal.runtime.storage.layout",
    "PageLayout": "kvcal.runtime.storage.layout",
    "CompressedStore": "kvcal.runtime.storage.store",
    "CompressedKV": "kvcal.runtime.cache",
    "served_bases": "kvcal.runtime.storage.bases",
    "AttentionBackend": "kvcal.runtime.backends.base",
    "TorchBackend": "kvcal.runtime.backends.reference",
    "select_backend": "kvcal.runtime.backends.registry",
    "KvcalCache": "kvcal.runtime.hf",
    "OffloadedCache": "kvcal.runtime.offload",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module `kvcal.runtime` has no attribute `{name}`")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
