"""What `kvcal bench` compares: a `Method` names a configuration and builds a fresh cache for it. The catalogue of
methods is `kvcal.bench.methods` (the store's, the eviction and low-rank baselines) with the caches of their own in
`kvcal.bench.turboquant`, `kvquant` and `kvtuner`, which all build `Method`s; this module is what they share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcal.runtime.bundle import Bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.options import ServeOptions


@dataclass
class Method:
    key: str                   # stable id (JSON, --methods)
    name: str                  # display name
    family: str                # dense | quantization | eviction | low-rank | seed | kvcal
    series: str                # plot series
    description: str
    settings: dict = field(default_factory=dict)
    config: CompressionConfig | None = None          # KvcalCache methods
    bundle: Bundle | None = None                     # ... with these ranks
    factory: Callable[[int], Any] | None = None      # other caches: reserve (decode steps to come) -> fresh cache
    unavailable: str | None = None                   # one-line reason it cannot run here
    note: str | None = None                          # how it was built, when that needs saying
    serve: ServeOptions = ServeOptions()             # how its KvcalCache is served (backend, page size)

    @property
    def replays(self) -> bool:
        """Whether a recorded prefill can serve this method: on the store, and needing no prompt statistics the
        probes do not record (SnapKV's window votes; FastGen's are recorded)."""
        return self.config is not None and self.config.snapkv is None

    def make_cache(self, model, tokenizer, reserve: int = 0):
        """A fresh, empty cache for this method; `reserve`: decode steps to come (SnapKV budgets its prompt so
        that its memory matches after them)."""
        if self.config is not None:
            from kvcal.runtime.hf import KvcalCache

            config = self.config
            if config.snapkv is not None:
                config = config.with_(snapkv=dataclasses.replace(config.snapkv, reserve=reserve))
            return KvcalCache.from_bundle(self.bundle, model, config, tokenizer=tokenizer, serve=self.serve)
        return self.factory(reserve)
