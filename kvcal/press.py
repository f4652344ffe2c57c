"""NVIDIA kvpress and kvcal, both ways: kvpress presses as `kvcal bench` rows, and a kvcal bundle inside a kvpress
pipeline. Needs the opt-in extra (`pip install -e ".[bench]"`, which pins kvpress 0.5.2; see docs/bench.md).

    from kvcal.press import kvcal_pipeline
    pipe = kvcal_pipeline(lm.model, lm.tokenizer)
    cache = KvcalCache.from_bundle(bundle, lm.model, tokenizer=lm.tokenizer)
    answer = pipe(context, question=question, cache=cache, max_new_tokens=16)["answer"]

Why a shim: kvpress's hook (`BasePress.forward_hook`) tells prefill from decode by `kwargs["cache_position"]`, an
argument transformers 5.3+ no longer passes to attention layers (kvpress 0.5.5 pins `transformers<5.3` for that; 0.5.2
has no upper bound and breaks with `KeyError: 'cache_position'`). `install_press_hook` registers one forward hook per
attention layer that adds `cache_position` from the cache length, then runs the press of the `PressedCache` the layer
was called with, so the press code itself runs unchanged. kvpress's pipeline removes each answer from the cache by
slicing `layer.keys`, which a paged cache does not have; `kvcal_pipeline` crops it instead (`KvcalCache.crop`).
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from kvcal.bench.caches import memory_dict, tensor_bytes
from kvcal.runtime.hf import cache_argument, dense_bytes

# bench key -> (display name, how the press is built from a compression ratio), kvpress's own classes
PRESSES = {
    "kvpress-snapkv": ("kvpress SnapKV", lambda kp, r: kp.SnapKVPress(compression_ratio=r)),
    "kvpress-streamingllm": ("kvpress StreamingLLM", lambda kp, r: kp.StreamingLLMPress(compression_ratio=r)),
    "kvpress-expected-attention": ("kvpress ExpectedAttention",
                                   lambda kp, r: kp.ExpectedAttentionPress(compression_ratio=r)),
    "kvpress-tova": ("kvpress TOVA", lambda kp, r: kp.TOVAPress(compression_ratio=r)),
    "kvpress-knorm": ("kvpress Knorm", lambda kp, r: kp.KnormPress(compression_ratio=r)),
    "kvpress-adakv": ("kvpress AdaKV (SnapKV scores)",
                      lambda kp, r: kp.AdaKVPress(kp.SnapKVPress(compression_ratio=r))),
}
# presses built on SnapKV, which refuses a prompt no longer than its observation window (`SnapKVPress.window_size`)
SNAPKV_BASED = ("kvpress-snapkv", "kvpress-adakv")


def unavailable(key: str, shortest_prompt: int) -> str | None:
    """Why press `key` cannot run here, on prompts of at least `shortest_prompt` tokens (one line), or None."""
    try:
        import kvpress
    except ImportError as e:
        return f"kvpress is not installed ({e}); install the opt-in extra: pip install -e \".[bench]\""
    window = kvpress.SnapKVPress.window_size                        # the dataclass default the presses are built with
    if key in SNAPKV_BASED and shortest_prompt <= window:
        return (f"{PRESSES[key][0]} needs prompts of at least {window + 1} tokens (its {window}-token window); this "
                f"run has one of {shortest_prompt}")
    return None


class PressedCache(DynamicCache):
    """A DynamicCache that a kvpress press compresses once, at prefill, to match `ratio` of fp16 bytes at the end of
    `reserve` decode steps (decode tokens are appended uncompressed, as kvpress does). `memory()` counts the bytes
    held: K/V in the model dtype, plus the head-wise mask AdaKV leaves on each attention module (kvpress's AdaKV
    masks keys instead of removing them, so it saves no memory; its row shows that)."""

    def __init__(self, press, *, ratio: float, reserve: int = 0, config=None):
        super().__init__(config=config)
        self.press, self.ratio, self.reserve = press, ratio, reserve
        self.mask_bytes: dict[int, int] = {}      # layer -> bytes of AdaKV's masked key indices
        self.seen: dict[int, int] = {}            # layer -> tokens seen (prompt + decode), for the fp16 reference

    def compression_ratio(self, n: int) -> float:
        """kvpress's fraction of the n prompt tokens to drop so that (kept + reserve) tokens hold `ratio` of the
        fp16 bytes of n + reserve tokens (dense tokens count at 16 bits, `dense_bytes`)."""
        kept = self.ratio * (n + self.reserve) - self.reserve
        return min(max(1.0 - math.floor(kept) / n, 0.0), 1.0 - 1.0 / n)

    def memory(self) -> dict[str, float]:
        total = fp16 = 0
        for i, layer in enumerate(self.layers):
            if layer.is_initialized and layer.keys is not None and layer.keys.numel():
                total += dense_bytes(layer.keys, layer.values)
                B, H, _, d = layer.keys.shape
                fp16 += B * H * self.seen.get(i, 0) * d * 2 * 2
        return memory_dict(total + sum(self.mask_bytes.values()), fp16)


def _attention_layers(model):
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return inner, [layer.self_attn for layer in inner.layers]


def _press_hook(module, args, kwargs, output):
    """After an attention layer: run the `PressedCache`'s press (kvpress code, unchanged) with `cache_position`
    restored and the cache under the name kvpress reads (`past_key_values`, which transformers 5.24 renamed
    `cache`); other caches pass through untouched."""
    cache = cache_argument(kwargs)
    if not isinstance(cache, PressedCache):
        return output
    q_len = kwargs["hidden_states"].shape[1]
    past = cache.seen.get(module.layer_idx, 0)
    cache.seen[module.layer_idx] = past + q_len
    if past > 0:                                                         # decode: kvpress leaves it alone
        return output
    cache.press.compression_ratio = cache.compression_ratio(q_len)
    kw = dict(kwargs, cache_position=torch.arange(q_len, device=kwargs["hidden_states"].device),
              past_key_values=cache)
    module.masked_key_indices = None
    output = cache.press.forward_hook(module, args, kw, output)
    masked = getattr(module, "masked_key_indices", None)
    cache.mask_bytes[module.layer_idx] = tensor_bytes(masked)
    return output


def install_press_hook(model, press=None) -> None:
    """Register `_press_hook` on every attention layer of `model` (once), give the layers the rotary embedding
    kvpress expects (as `BasePress.__call__` does), and let `press` derive its settings from the model."""
    inner, attn = _attention_layers(model)
    for module in attn:
        module.rotary_emb = inner.rotary_emb
        if not getattr(module, "_kvcal_press_hook", False):
            module.register_forward_hook(_press_hook, with_kwargs=True)
            module._kvcal_press_hook = True
    if press is not None:
        press.post_init_from_model(model)


def masked_attention(func):
    """`func` (a transformers attention function) with kvpress's head-wise key masking (AdaKV) applied first. kvpress
    patches the functions registered when it is imported; the bench registers its own afresh for every cache."""
    from kvpress.attention_patch import attention_patch

    return attention_patch(func)


def make_press(key: str, ratio: float = 0.5):
    import kvpress

    return PRESSES[key][1](kvpress, ratio)


# --------------------------------------------------------------------------------------------- kvcal in kvpress


def kvcal_pipeline(model, tokenizer, **kwargs):
    """kvpress's text-generation pipeline, serving a `KvcalCache` passed as `cache=` (real paged bytes): the answer
    of each question is removed from the cache by `crop`. A kvpress press cannot be combined with a kvcal cache."""
    from kvpress.pipeline import KVPressTextGenerationPipeline

    from kvcal.runtime.hf import KvcalCache

    class KvcalPressPipeline(KVPressTextGenerationPipeline):
        def _forward(self, input_tensors, max_new_tokens=50, press=None, cache=None):
            if isinstance(cache, KvcalCache) and press is not None:
                raise ValueError("a kvpress press cannot compress a KvcalCache (the bundle is its compression): pass "
                                 "press=None with a kvcal cache, or no kvcal cache with a press")
            return super()._forward(input_tensors, max_new_tokens=max_new_tokens, press=press, cache=cache)

        def _remove_answer_from_cache(self, cache, cache_seq_lengths):
            if isinstance(cache, KvcalCache):
                cache.crop(min(cache_seq_lengths) - cache.get_seq_length())
            else:
                super()._remove_answer_from_cache(cache, cache_seq_lengths)

    return KvcalPressPipeline(model=model, tokenizer=tokenizer, **kwargs)
