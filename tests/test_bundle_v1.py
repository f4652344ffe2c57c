"""A bundle written before the settings codec and the token-policy components (kvcal at commit 78e4e84) still loads
and serves identically: same logits, same tiers, same bytes held. The files in tests/data were written by that
commit for the tiny Llama of conftest (`make_model("llama", seed=0)`, `random_bundle(seed=3)` with reduced ranks, a
value-group high tier, per-token low tier, tiers and FastGen on) serving 32 prompt + 16 decode tokens, batch 2."""

from pathlib import Path

import torch
from conftest import make_model
from safetensors import safe_open
from safetensors.torch import load_file

from kvcal.runtime.bundle import load_bundle, save_bundle
from kvcal.runtime.hf import KvcalCache

DATA = Path(__file__).parent / "data"
BUNDLE = DATA / "v1-tiny-llama.kvcal.safetensors"


def test_v1_bundle_serves_the_recorded_logits():
    model, tok = make_model("llama", seed=0)
    bundle = load_bundle(BUNDLE)
    want = load_file(DATA / "v1-tiny-llama.served.safetensors")
    ids = want["input_ids"]
    with torch.inference_mode():
        cache = KvcalCache.from_bundle(bundle, model, tokenizer=tok)
        logits = [model(input_ids=ids[:, :32], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(32, 48):
            logits.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    counts = cache.kv.tier_counts()
    assert [counts["high"], counts["low"]] == want["tier_counts"].tolist()
    assert int(cache.memory()["total_bytes"]) == int(want["total_bytes"])
    torch.testing.assert_close(torch.stack(logits, 1).float(), want["logits"], rtol=0, atol=1e-5)


def test_v1_bundle_rewrites_to_the_same_content(tmp_path):
    """Loading and saving again keeps every tensor and every metadata value (the policy block included); a new
    write only stamps its own time (`created`) and adds the hash over the metadata."""
    out = save_bundle(load_bundle(BUNDLE), tmp_path / "again.kvcal.safetensors")
    with safe_open(BUNDLE, "pt") as old, safe_open(out, "pt") as new:
        added = {"created", "metadata.sha256"}
        assert {k: v for k, v in new.metadata().items() if k not in added} == \
            {k: v for k, v in old.metadata().items() if k not in added}
        assert "metadata.sha256" in new.metadata() and "metadata.sha256" not in old.metadata()
        assert sorted(new.keys()) == sorted(old.keys())
        for name in old.keys():
            assert torch.equal(new.get_tensor(name), old.get_tensor(name)), name
