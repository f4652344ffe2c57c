"""The bundle shipped at commit 507de3f (the runtime before it owned its rooms: subpackages, the split store,
`ServeOptions`) still serves what that commit served: the same tiers, the same bytes held, the same logits.

tests/data/smollm2-135m.507de3f.kvcal.safetensors is artifacts/smollm2-135m.kvcal.safetensors as of that commit. The
served file was written by that commit's code: the packaged smollm2-135m in float32, the torch reference backend, two
evaluation windows (`token_windows(tokenizer, load_corpus("default", "eval"), 2, 200, 7)`), a 184-token prefill
then 16 decode steps; it keeps each step's 64 largest logits (values and token ids). The reference backend is the one
compared: the CPU backend's prefill sums significance in another float order (tests/test_cpu_backend.py compares it
to the reference), which can reorder near-tied tokens.

The logits were rewritten once, on purpose, when the prefill's per-channel low pages became pages of position
neighbours instead of pages of equal significance (the tiers and bytes stayed as recorded):
`python tests/test_bundle_shipped.py --rewrite`. The bytes held changed once, on purpose, when the high sections'
holes were closed (`COMPACTED_BYTES`; the tiers and logits stayed as recorded)."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

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


SERVED = DATA / "smollm2-135m.507de3f.served.safetensors"
# the bytes held since d6883d9, which closes the holes a sealed per-channel low page leaves in the high sections
# (`Scores.compact`): the same tokens in 96 fewer pages of 2240 B than the recorded `total_bytes` (4193280)
COMPACTED_BYTES = 3978240


def serve(lm, ids: torch.Tensor):
    """The shipped bundle serving ids [2, 200]: (logits float32 [2, 17, vocab], tier counts [high, low], bytes held)."""
    bundle = load_bundle(DATA / "smollm2-135m.507de3f.kvcal.safetensors")
    with torch.inference_mode():
        cache = KvcalCache.from_bundle(bundle, lm.model, CompressionConfig.from_dict(bundle.settings),
                                       tokenizer=lm.tokenizer, serve=ServeOptions(backend="torch"))
        logits = [lm.model(input_ids=ids[:, :184], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(184, 200):
            logits.append(lm.model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    counts = cache.kv.tier_counts()
    return torch.stack(logits, 1).float(), [counts["high"], counts["low"]], int(cache.memory()["total_bytes"])


def test_shipped_bundle_serves_the_recorded_logits(smollm2):
    want = load_file(SERVED)
    got, counts, held = serve(smollm2, want["input_ids"])
    assert counts == want["tier_counts"].tolist()
    assert held == COMPACTED_BYTES == int(want["total_bytes"]) - 96 * 2240
    # the recorded top 64 must still hold those values, up to float order: the file was written on an AVX-512 CPU, and
    # on another instruction set the matmuls and reductions sum in another order, so K/V that sit on a rounding
    # boundary of their 4- or 2-bit grid may take the next code. One step of a code moves these logits by about 0.02
    # (the largest deviation measured on an AVX-512 Xeon, under ATEN_CPU_CAPABILITY avx512, avx2 and default), far
    # below what a changed format, level table or tier would (the tier counts and bytes above are exact). So the
    # top-1 is the recorded one up to ties within twice that: three of the 34 steps have two tokens 0.0002-0.08 apart
    top, tied = want["top_indices"], want["top_values"] >= want["top_values"][..., :1] - 0.1
    assert bool(((top == got.argmax(-1, keepdim=True)) & tied).any(-1).all())
    torch.testing.assert_close(got.gather(-1, want["top_indices"]), want["top_values"], rtol=0, atol=0.05)


if __name__ == "__main__" and sys.argv[1:] == ["--rewrite"]:     # the recorded logits, served by this checkout
    from kvcal.models import load_model

    want = load_file(SERVED)
    logits, counts, held = serve(load_model("smollm2-135m", dtype="float32"), want["input_ids"])
    if counts != want["tier_counts"].tolist() or held != COMPACTED_BYTES:
        raise SystemExit(f"tiers {counts} or bytes {held} differ from the recorded ones: not a change of logits only")
    top = logits.topk(64, dim=-1)
    save_file({**want, "top_values": top.values.contiguous(), "top_indices": top.indices.contiguous()}, SERVED)
