"""The bundle shipped at commit 507de3f (the runtime before it owned its rooms: subpackages, the split store,
`ServeOptions`) still serves what that commit served: the same tiers, the same bytes held, the same logits.

tests/data/smollm2-135m.507de3f.kvcal.safetensors is artifacts/smollm2-135m.kvcal.safetensors as of that commit. The
served file was written by that commit's code: the packaged smollm2-135m in float32, the torch reference backend, two
evaluation windows (`token_windows(tokenizer, load_corpus("default", "eval"), 2, 200, 7)`), a 184-token prefill
then 16 decode steps; it keeps each step's 64 largest logits (values and token ids). The reference backend is the one
compared: the CPU backend's prefill sums significance in another float order (tests/test_cpu_backend.py compares it
to the reference), which can reorder near-tied tokens."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def smollm2():
    from kvcal.models import load_model

    try:
        return load_model("smollm2-135m", dtype="float32")
    except Exception as e:  # noqa: BLE001 - the packaged model is an optional install
        pytest.skip(f"smollm2-135m unavailable: {e}")


def test_shipped_bundle_serves_the_recorded_logits(smollm2):
    bundle = load_bundle(DATA / "smollm2-135m.507de3f.kvcal.safetensors")
    want = load_file(DATA / "smollm2-135m.507de3f.served.safetensors")
    ids = want["input_ids"]
    with torch.inference_mode():
        cache = KvcalCache.from_bundle(bundle, smollm2.model, CompressionConfig.from_dict(bundle.settings),
                                       tokenizer=smollm2.tokenizer, serve=ServeOptions(backend="torch"))
        logits = [smollm2.model(input_ids=ids[:, :184], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(184, 200):
            logits.append(smollm2.model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    counts = cache.kv.tier_counts()
    assert [counts["high"], counts["low"]] == want["tier_counts"].tolist()
    assert int(cache.memory()["total_bytes"]) == int(want["total_bytes"])
    got = torch.stack(logits, 1).float()
    # the recorded top 64 must still hold those values, up to float order: the file was written on an AVX2 CPU, and
    # on another instruction set the matmuls and reductions sum in another order, so K/V that sit on a rounding
    # boundary of their 4- or 2-bit grid may take the next code. One step of a code moves these logits by about 0.02
    # (the largest deviation measured on an AVX-512 Xeon, under ATEN_CPU_CAPABILITY avx512, avx2 and default), far
    # below what a changed format, level table or tier would (the tier counts and bytes above are exact)
    assert torch.equal(got.argmax(-1), want["top_indices"][..., 0])
    torch.testing.assert_close(got.gather(-1, want["top_indices"]), want["top_values"], rtol=0, atol=0.05)
