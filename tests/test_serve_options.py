"""ServeOptions: serving choices live there and only there (never in the settings a bundle stores), are resolved once
per compressed state, and `threads` holds torch's threads only while the cache runs. Also the token-policy registry
that `CompressionConfig` reads."""

import dataclasses

import pytest
import torch
from conftest import make_model, random_bundle

from kvcal.runtime.backends import TorchBackend
from kvcal.runtime.cache import CompressedKV
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies import CACHE_POLICIES, TOKEN_POLICY_CONFIGS
from kvcal.runtime.policies.h2o import H2OConfig


def test_serving_choices_are_not_settings():
    fields = {f.name for f in dataclasses.fields(CompressionConfig)}
    assert not fields & {"backend", "page_bytes", "threads"}
    cfg = CompressionConfig(h2o=H2OConfig(0.5))
    assert "backend" not in cfg.to_dict() and "page_bytes" not in cfg.to_dict()
    assert cfg.page_size(64, 4096) == 4096 and cfg.page_size(64) == cfg.page_size(64, None)


@pytest.mark.parametrize("bad", [{"page_bytes": 0}, {"threads": 0}, {"threads": -2}])
def test_bad_options_raise(bad):
    with pytest.raises(ValueError, match="must be a positive"):
        ServeOptions(**bad)


def test_the_registry_holds_every_policy_in_run_order():
    assert list(CACHE_POLICIES) == ["diffkv", "fastgen", "h2o", "snapkv", "streamingllm"]
    assert list(TOKEN_POLICY_CONFIGS) == ["fastgen", "h2o", "snapkv", "streamingllm"]
    assert TOKEN_POLICY_CONFIGS["h2o"] is H2OConfig and CACHE_POLICIES["h2o"].name == "h2o"
    cfg = CompressionConfig.from_dict({"h2o": {"fraction": 0.5}})
    assert cfg.h2o == H2OConfig(0.5) and cfg.snapkv is None


def test_options_reach_the_store_and_threads_hold_only_while_the_cache_runs(monkeypatch):
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    seen = []
    real = CompressedKV._forward

    def forward(self, *args):
        seen.append(torch.get_num_threads())
        return real(self, *args)

    monkeypatch.setattr(CompressedKV, "_forward", forward)
    cache = KvcalCache.from_bundle(bundle, model, serve=ServeOptions("torch", page_bytes=1024, threads=want))
    with torch.no_grad():
        model(input_ids=torch.arange(3, 20)[None], cache=cache, use_cache=True)
        model(input_ids=torch.tensor([[21]]), cache=cache, use_cache=True)
    assert cache.kv.backend is TorchBackend and cache.kv.store.page_bytes == 1024
    assert seen and set(seen) == {want}
    assert torch.get_num_threads() == before
