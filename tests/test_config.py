"""The settings codec: `CompressionConfig.to_dict` / `from_dict` is the bundle's settings block (metadata `policy`,
format v1)."""

import json
from pathlib import Path

import pytest

from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import SETTINGS_KEYS, CompressionConfig
from kvcal.runtime.policies.fastgen import FastGenConfig
from kvcal.runtime.storage.layout import TierFormat

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("path", [ROOT / "tests/data/v1-tiny-llama.kvcal.safetensors",
                                  ROOT / "artifacts/smollm2-135m.kvcal.safetensors"])
def test_v1_policy_blocks_decode_and_encode_to_the_same_json(path):
    if not path.is_file():
        pytest.skip(f"{path} not present")
    policy = load_bundle(path).settings
    config = CompressionConfig.from_dict(policy)
    assert json.dumps(config.to_dict()) == json.dumps(policy)           # same keys, same order, same values


def test_round_trip_of_every_setting_the_block_holds():
    configs = [
        CompressionConfig(),
        CompressionConfig(high=TierFormat.parse("K8V4g16"), low=TierFormat.parse("K4V2")).with_tiering(
            window=16, alpha_high=3.0, alpha_low=0.0),
        CompressionConfig(fastgen=FastGenConfig(0.9), qk_removal_rate=0.02, v_removal_rate=0.04).with_tiering(
            alpha_high=2.0, alpha_low=0.5, threshold_base="position"),
        CompressionConfig(high=TierFormat.parse("K16V16"), low=TierFormat.parse("K4cV4"), page_tokens=32).with_tiering(
            window=32, alpha_high=1e9, alpha_low=0.25),
        CompressionConfig(low=TierFormat.parse("K4cnV4nm8"), low_layers=((1, TierFormat.parse("K2cnV2nm8")),),
                          low_heads=((0, 2, TierFormat.parse("K8cV4nm8")), (3, 0, TierFormat.parse("K2cnV4nm8"))),
                          sliding=TierFormat.parse("K8V8kg32m8"),
                          sliding_layers=((2, TierFormat.parse("K4V4kg32m8")),)),
    ]
    for config in configs:
        d = config.to_dict()
        assert list(d) == [k for k in SETTINGS_KEYS if k in d]
        assert CompressionConfig.from_dict(json.loads(json.dumps(d))) == config
    assert "alpha_low" not in configs[0].to_dict() and "fastgen" not in configs[1].to_dict()
    assert configs[2].to_dict()["fastgen"] == {"recovery": 0.9, "r_local": 0.3, "r_frequent": 0.3}


def test_eviction_settings_round_trip_and_are_off_when_absent():
    """H2O, SnapKV and StreamingLLM are one settings block each; a block without them (every bundle written before
    they existed) reads them as off, and a config without them writes none of their keys."""
    from kvcal.runtime.policies.h2o import H2OConfig
    from kvcal.runtime.policies.snapkv import SnapKVConfig
    from kvcal.runtime.policies.streamingllm import StreamingLLMConfig

    config = CompressionConfig(h2o=H2OConfig(0.25, recent=8), snapkv=SnapKVConfig(0.3, window=16, reserve=4),
                               streamingllm=StreamingLLMConfig(0.5, sinks=2))
    d = json.loads(json.dumps(config.to_dict()))
    assert list(d) == [k for k in SETTINGS_KEYS if k in d]
    assert d["h2o"] == {"fraction": 0.25, "recent": 8} and d["streamingllm"] == {"fraction": 0.5, "sinks": 2}
    assert CompressionConfig.from_dict(d) == config
    old = CompressionConfig.from_dict({"window": 64, "high": "K8V4"})
    assert old.h2o is None and old.snapkv is None and old.streamingllm is None
    assert not {"h2o", "snapkv", "streamingllm"} & set(CompressionConfig().to_dict())
    for bad, fix in (({"h2o": {"fraction": 0.0}}, "must be in \\(0, 1\\]"),
                     ({"snapkv": {"fraction": 0.5, "kernel": 4}}, "must be odd"),
                     ({"streamingllm": {"fraction": 0.5, "sinks": -1}}, "must be >= 0")):
        with pytest.raises(ValueError, match=fix):
            CompressionConfig.from_dict(bad)


def test_unsearched_block_records_the_window_only_and_reads_back_defaults():
    config = CompressionConfig().with_tiering(window=32)
    assert config.to_dict(searched=False) == {"window": 32}
    assert CompressionConfig.from_dict({"window": 32}) == config


def test_unknown_policy_key_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="`alpha_hi` is not one of .* upgrade kvcal"):
        CompressionConfig.from_dict({"alpha_hi": 1.0})


def test_value_group_and_ranks_round_up_to_it():
    import torch

    from kvcal.profile.ranks import rank_from_removal_rate, ranks_for

    assert CompressionConfig().value_group == 1
    assert CompressionConfig(high=TierFormat.parse("K8V4g16")).value_group == 16
    spectrum = torch.linspace(10, 0.1, 64).reshape(2, 1, 32)
    plain = rank_from_removal_rate(spectrum, 0.3)
    assert torch.equal(ranks_for(spectrum, 0.3), plain)
    grouped = ranks_for(spectrum, 0.3, 8)
    assert bool((grouped % 8 == 0).all()) and bool(((grouped - plain >= 0) & (grouped - plain < 8)).all())


def test_pages_are_sized_by_the_low_tier_when_page_tokens_is_set():
    from kvcal.runtime.storage.layout import PageLayout

    fp16_window = CompressionConfig(high=TierFormat.parse("K16V16"), low=TierFormat.parse("K4cV2"))
    assert PageLayout.build(fp16_window.high, 64, 64, fp16_window.page_size(64)).tokens == 32   # 32 fp16 tokens
    sized = fp16_window.with_(page_tokens=16)
    assert PageLayout.build(sized.low, 64, 64, sized.page_size(64)).tokens == 16                 # 16 low tokens
    assert sized.page_size(64, page_bytes=4096) == 4096                                          # explicit wins
    for bad in (0, -3, 2.5, "32"):
        with pytest.raises(ValueError, match="page_tokens=.* must be a positive integer"):
            CompressionConfig.from_dict({"page_tokens": bad})


def test_the_residual_family_reads_in_words_without_the_sentinel_alpha():
    from kvcal.profile.report import settings_in_words
    from kvcal.runtime.policies.diffkv import EVERY_TOKEN_LOW

    residual = CompressionConfig(high=TierFormat.parse("K16V16"), low=TierFormat.parse("K4cV2"), page_tokens=32)
    words = settings_in_words(residual.with_tiering(window=32, alpha_high=EVERY_TOKEN_LOW).to_dict())
    assert "for the 32 newest tokens," in words and "1e+09" not in words and "pages of 32 tokens" in words
    tiered = settings_in_words(CompressionConfig().with_tiering(alpha_high=2.0).to_dict())
    assert "mean attention >= 2/N" in tiered


def test_low_tokens_that_never_move_keep_no_score_or_position():
    from kvcal.runtime.policies.diffkv import TieringConfig
    from kvcal.runtime.policies.snapkv import SnapKVConfig
    from kvcal.runtime.storage.layout import PageLayout, default_page_bytes

    residual = CompressionConfig(high=TierFormat.parse("K16V16"), low=TierFormat.parse("K4cV4"), page_tokens=32,
                                 tiering=TieringConfig(window=16, alpha_high=16.0))
    assert not residual.low_tracked                                    # nothing prunes or evicts a low token
    for moving in (residual.with_tiering(alpha_low=0.5), residual.with_(fastgen=FastGenConfig(0.9)),
                   residual.with_(snapkv=SnapKVConfig(0.5)), CompressionConfig()):   # untiered: no low tier at all
        assert moving.low_tracked
    # d = 64, pages of 32 low tokens: 32 B key codes + 32 B value codes + 4 B value scale/zero + 8 B of per-channel
    # key scale/zero over the page = 76 B a token; tracked adds the fp32 score and int32 position (84 B)
    for tracked, per_token in ((False, 76), (True, 84)):
        page = default_page_bytes(64, residual.low, 32, tracked)
        lay = PageLayout.build(residual.low, 64, 64, page, tracked)
        assert (lay.tokens, lay.bytes_per_token, lay.tracked) == (32, per_token, tracked)
        assert (lay.score_off < 0) == (lay.pos_off < 0) == (not tracked)
    assert residual.page_size(64) == default_page_bytes(64, residual.low, 32, tracked=False)


def test_a_kv_heads_low_format_overrides_its_layers_and_is_checked_like_it():
    low, two, eight = (TierFormat.parse(f) for f in ("K4cnV4nm8", "K2cnV2nm8", "K8cV4nm8"))
    config = CompressionConfig(low=low, low_layers=((1, two),), low_heads=((1, 2, eight), (3, 0, two)))
    assert [config.low_of(1, h) for h in range(3)] == [two, two, eight]
    assert config.low_of(1) == two and config.low_of(3, 0) == two and config.low_of(3, 1) == low
    assert eight in config.formats
    with pytest.raises(ValueError, match="once, ascending"):
        CompressionConfig(low=low, low_heads=((1, 2, eight), (1, 2, two)))
    with pytest.raises(ValueError, match="bits only"):
        CompressionConfig(low=low, low_heads=((0, 0, TierFormat.parse("K4V4")),))
