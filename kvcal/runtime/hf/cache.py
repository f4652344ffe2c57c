"""transformers integration: a `Cache` subclass and an attention function registered as `kvcal`.

    from kvcal.runtime.hf import KvcalCache
    cache = KvcalCache.from_bundle(bundle, model)          # checks the bundle against the model, installs `kvcal`
    out = model.generate(**inputs, cache=cache)            # batch > 1 and left-padded prompts work

How the two halves meet: transformers calls `cache.update(k, v, layer_idx)` right before the attention function, and
passes the layer's attention module to that function. `KvcalLayer.update` records the new post-RoPE K/V as pending
for its layer; the `kvcal` attention function picks them up and runs the compressed path (`CompressedKV.forward`).
Any call without a pending kvcal layer (another cache, a sliding layer) runs transformers' SDPA attention unchanged,
so a model with `kvcal` attention installed still works with `DynamicCache`. Token ids, which attention functions
never see, reach the cache through a pre-hook on the model's decoder that hands each call's `input_ids` to the
`KvcalCache` of that call (FastGen keeps them). The same hook checks each call before any layer runs: the model is the
one the cache was made for, the batch size is the cache's, no other thread is inside a call with it.

Sliding-window layers (Gemma3) hold at most `sliding_window` tokens by design. They keep transformers' own
`DynamicSlidingWindowLayer`, uncompressed, with SDPA, unless the settings name a `sliding` format: then
`QuantizedSlidingLayer` stores the same window in that format and its decode steps read the codes in place
(kvcal.runtime.hf.sliding). The paged, tiered layers are the global ones, where the cache grows with the context.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from kvcal.runtime.adapters import adapter_for, fingerprint, weights_hash
from kvcal.runtime.bundle import BundleMismatchError
from kvcal.runtime.cache import CompressedKV, CompressionConfig
from kvcal.runtime.hf import pending
from kvcal.runtime.hf.sliding import QuantizedSlidingLayer
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.storage.bases import served_bases
from kvcal.runtime.storage.levels import served_levels

KVCAL_IMPL = "kvcal"
logger = logging.getLogger(__package__)    # "kvcal.runtime.hf": the public module path


def dense_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of dense K/V tensors as served: 16 bits per element (fp16, or the model's own 16-bit dtype). The bench
    and the search run the model in float32 only to measure; counting its dense tensors (sliding layers, residual
    windows, the dense baseline) at 4 bytes would charge that precision to the method."""
    return sum(t.numel() * 2 for t in tensors if t is not None)


def cache_argument(kwargs: dict):
    """The cache a transformers module was called with: `cache` from transformers 5.24 on, `past_key_values`
    before."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _hand_token_ids(module, args, kwargs) -> None:
    """Forward pre-hook on the decoder: a KvcalCache in this call checks the call (`KvcalCache._begin_call`) and gets
    the ids of the tokens the call adds (FastGen classifies tokens by id; attention functions see only K/V). The ids
    go to the cache of this very call, so any number of caches can take turns on one model."""
    pending.clear()             # one left by a call that failed between a layer's update and its attention
    cache = cache_argument(kwargs)
    if isinstance(cache, KvcalCache):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache._begin_call(module, ids if ids is not None else kwargs.get("inputs_embeds"))
        cache.observe_tokens(ids)


def _end_call(module, args, kwargs, output) -> None:
    """Forward hook on the decoder, run even when the call raised: the call's thread lets go of its KvcalCache."""
    cache = cache_argument(kwargs)
    if isinstance(cache, KvcalCache) and cache._thread == threading.get_ident():
        cache._thread = None


def kvcal_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: the compressed path of the kvcal layer handed over (a paged layer's
    `CompressedKV.forward`; a quantized sliding layer's decode step over its codes, `QuantizedSlidingLayer.attend`),
    SDPA otherwise. Parameters in
    transformers' order (dropout before scaling): wrappers such as kvpress's attention patch pass dropout by
    position."""
    due = pending.take(module, key)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if due is not None and isinstance(due[0], QuantizedSlidingLayer):
        visible = None if attention_mask is None else real_tokens(attention_mask, attention_mask.shape[-1])
        visible = None if visible is None or bool(visible.all()) else visible
        return due[0].attend(query, scale, visible).transpose(1, 2).contiguous(), None
    if due is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer = due[0]
    pad = None
    if layer.owner.kv is None or layer.owner.kv.length[layer.layer_idx] == 0:
        pad = real_tokens(attention_mask, query.shape[2])
    out = layer.owner.kv.forward(layer.layer_idx, query, key, value, pad, scale)   # [B, Hq, n, d]
    return out.transpose(1, 2).contiguous(), None


def real_tokens(attention_mask, n: int) -> torch.Tensor | None:
    """bool [B, n] real (non-padding) prompt tokens, from the 4D mask the model built (the last query row of a
    causal mask sees every real key), or None when there is no mask (no padding)."""
    if attention_mask is None:
        return None
    m = attention_mask[:, 0, -1, -n:]
    return m if m.dtype == torch.bool else m == 0


def install(model) -> None:
    """Register the `kvcal` attention function (and its mask) and make `model` use it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(KVCAL_IMPL, kvcal_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(KVCAL_IMPL, sdpa_mask)
    decoder = model.get_decoder()
    if not getattr(decoder, "_kvcal_ids_hook", False):
        decoder.register_forward_pre_hook(_hand_token_ids, with_kwargs=True)
        decoder.register_forward_hook(_end_call, with_kwargs=True, always_call=True)
        decoder._kvcal_ids_hook = True
    if model.config._attn_implementation != KVCAL_IMPL:
        model.set_attn_implementation(KVCAL_IMPL)


class SeenLayer(CacheLayerMixin):
    """A full-attention layer that holds its tokens in a form of its own and counts them in `seen`: the attention
    mask covers all of them. The base of `KvcalLayer` and of the bench's own compressed layers."""

    is_sliding = False
    is_compileable = False

    def __init__(self):
        super().__init__()
        self.seen = 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


class KvcalLayer(SeenLayer):
    """One compressed layer; its data lives in the owner's `CompressedKV` (one page arena for all layers)."""

    def __init__(self, owner: KvcalCache, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        info = self.owner.bundle.model
        _, H, _, d = key_states.shape
        if (H, d) != (info.num_kv_heads, info.head_dim):
            raise BundleMismatchError(
                f"this KvcalCache serves `{info.name}` ({info.num_kv_heads} KV heads of dimension {info.head_dim}) "
                f"and a model with {H} of dimension {d} called it: make a cache for that model with "
                f"`KvcalCache.from_bundle(bundle, model)`")
        self.owner._ensure_kv(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        pending.claim_pending()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        pending.hand_over(self, key_states, value_states)
        return key_states, value_states

    def reset(self) -> None:
        self.seen = 0

    # batch re-indexing and crop act on the owner's CompressedKV once for all layers (KvcalCache overrides them)


class KvcalCache(Cache):
    """A transformers `Cache` whose full-attention layers are compressed by kvcal.

    A cache belongs to one model and one thread. It serves the model given to `from_bundle` (another model raises
    `BundleMismatchError`) and holds one batch of sequences until `release()` (or `reset()`): a call with another
    batch size raises, as does a call from a second thread while one is running. Threads that serve requests at the
    same time need a cache each; a cache's whole batch goes through one `generate` call at a time."""

    def __init__(self, bundle, config, *, layer_types: list[str], sliding_window: int | None, tokenizer=None,
                 raw_tokens: int | None = None, serve: ServeOptions = ServeOptions()):
        self.bundle, self.config, self.serve = bundle, config, serve
        self.raw_tokens = raw_tokens      # the raw phase (CompressedKV): None = auto, 0 = none
        self.token_classes = None
        self._new_ids: list[torch.Tensor] = []     # token ids seen before the compressed state exists (FastGen)
        if config.fastgen is not None:
            if tokenizer is None:
                raise ValueError("FastGen needs the tokenizer (special and punctuation tokens): pass "
                                 "`tokenizer=` to KvcalCache.from_bundle")
            from kvcal.runtime.policies.fastgen import token_classes

            self.token_classes = token_classes(tokenizer)
        self.kv: CompressedKV | None = None
        self.record = False      # True: keep each layer's prefill inputs in kv.recorder (see CompressedKV), and
        #                          store nothing: a recording cache is released after its prefill, never decoded
        self._decoder: weakref.ref | None = None    # the decoder it serves (from_bundle); None: not checked
        self.max_positions: int | None = None       # the model's max_position_embeddings: past it, warn once
        self._warned_positions = False
        self._thread: int | None = None             # the thread inside a forward call with this cache
        self._shared = False                        # two threads' calls overlapped: refused until release()
        self.sliding = [t == "sliding_attention" for t in layer_types]
        layers = [self._sliding_layer(i, sliding_window) if s else KvcalLayer(self, i)
                  for i, s in enumerate(self.sliding)]
        super().__init__(layers=layers)

    def _sliding_layer(self, layer: int, window: int) -> DynamicSlidingWindowLayer:
        """transformers' own layer, or a quantized one in the bundle's full-rank rotated basis (`config.sliding_of`)."""
        fmt = self.config.sliding_of(layer)
        if fmt is None:
            return DynamicSlidingWindowLayer(window)
        L, H, d, _ = self.bundle.qk_rotation.shape
        full = torch.full((L, H), d, dtype=torch.int32)
        smoothing = self.bundle.extras.get("qk.smoothing")
        _, _, rotation, basis, query_rotation = served_bases(
            self.bundle.qk_rotation[layer:layer + 1], self.bundle.v_basis[layer:layer + 1], full[:1], full[:1],
            self.config.with_(use_ranks=False), None if smoothing is None else smoothing[layer:layer + 1])
        levels = served_levels(self.bundle.extras, {layer: [fmt]}, L, H, "cpu")        # reads the levels only
        quantized = QuantizedSlidingLayer(window, fmt, rotation[0], basis[0], query_rotation[0],
                                          self.config.sliding_recent, self.config.sliding_block, serve=self.serve,
                                          levels=tuple(levels.get((layer, side, bits)) for side, bits
                                                       in (("k", fmt.k_bits), ("v", fmt.v_bits))))
        quantized.layer_idx = layer
        return quantized

    @classmethod
    def from_bundle(cls, bundle, model, config: CompressionConfig | None = None, tokenizer=None,
                    raw_tokens: int | None = None, serve: ServeOptions = ServeOptions()) -> KvcalCache:
        """Check `bundle` against `model` (BundleMismatchError on another architecture), install the `kvcal`
        attention function on the model, and return an empty cache. `config` defaults to the bundle's settings.
        raw_tokens: how many tokens a sequence is held raw before its pages pay (`CompressedKV`, raw phase); None
        picks it from the page layouts (`CompressedKV.auto_raw_tokens`), 0 writes every token to the pages.
        serve: how this process serves the cache (attention backend, page size, threads; `ServeOptions`), resolved
        when the first call makes the compressed state on the K/V's device."""
        adapter = adapter_for(model.config)
        bundle.check_model(fingerprint(model.config), weights_hash(model, adapter),
                           shape=(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim))
        if config is None:
            config = CompressionConfig.from_dict(bundle.settings)
        install(model)
        cache = cls(bundle, config, layer_types=list(adapter.layer_types), sliding_window=adapter.sliding_window,
                    tokenizer=tokenizer, raw_tokens=raw_tokens, serve=serve)
        # weak: a cache must not keep a model alive; a model that is gone is another model
        cache._decoder = weakref.ref(model.get_decoder())
        cache.max_positions = adapter.max_positions
        return cache

    def _begin_call(self, decoder, inputs: torch.Tensor | None) -> None:
        """Checks a forward call before any layer changes (the decoder pre-hook; O(1), no device sync): the model is
        the one this cache serves, no other thread is inside a call with it, the batch size is the cache's. Warns
        once when the cache grows past the model's positions. inputs: input_ids [B, n] or inputs_embeds [B, n, D]."""
        if self._decoder is not None and self._decoder() is not decoder:
            raise BundleMismatchError(
                f"this KvcalCache serves the model object given to `from_bundle` (`{self.bundle.model.name}`) and "
                f"another model called it: make a cache for that model with `KvcalCache.from_bundle(bundle, model)`")
        me = threading.get_ident()
        if self._shared or self._thread not in (None, me):
            self._shared = True         # the other thread's next call fails too: both hold mixed sequences
            raise RuntimeError("two threads used this KvcalCache at once, which mixes their sequences: give each "
                               "thread its own cache (`cache.release()` makes this one usable again)")
        self._thread = me               # until the call ends (`_end_call`, which runs even when it raises)
        if inputs is None:
            return
        rows = inputs.shape[0]
        if self.kv is not None and rows != self.kv.batch:
            raise ValueError(f"this KvcalCache holds a batch of {self.kv.batch} sequences and the call brings "
                             f"{rows}: call `cache.release()` before a new batch, or make a new cache")
        if self.max_positions is not None and not self._warned_positions:
            n = self.get_seq_length() + inputs.shape[1]
            if n > self.max_positions:
                self._warned_positions = True
                logger.warning("the KvcalCache now holds %d positions, past the model's %d "
                               "(`max_position_embeddings`): its output beyond them is unreliable", n,
                               self.max_positions)

    @classmethod
    def record_prompt(cls, bundle, model, prompt: torch.Tensor, config: CompressionConfig | None = None,
                      tokenizer=None, serve: ServeOptions = ServeOptions()) -> tuple[dict, torch.Tensor]:
        """Run the prefill of `prompt` [B, n] once. Returns the records `prime` replays into any number of caches
        (for each compressed layer: key, value [B, H, n, d] float32, score [B, H, n], real [B, n], each policy's
        statistics; for each sliding layer: its kept keys, values, the tokens seen) and the prefill's last logits
        [B, vocab]. `config` (default `CompressionConfig.none()`) decides which policies record statistics
        (FastGen's); the recording cache stores nothing and is released."""
        recording = cls.from_bundle(bundle, model, config or CompressionConfig.none(), tokenizer=tokenizer,
                                    serve=serve)
        recording.record = True
        with torch.inference_mode():
            logits = model(input_ids=prompt, cache=recording, use_cache=True, logits_to_keep=1).logits[:, -1]
        # taken out of the compressed state, whose policies and store refer to each other: a reference cycle that
        # only the garbage collector frees, with every layer's float32 K/V inside
        records, recording.kv.recorder = recording.kv.recorder, None
        for i, layer in enumerate(recording.layers):
            if recording.sliding[i]:
                records[i] = (layer.keys, layer.values, layer.cumulative_length)
        recording.release()
        return records, logits

    def prime(self, records: dict, token_ids: torch.Tensor | None = None) -> None:
        """Fill an empty cache with a recorded prefill instead of running it: `records` maps each layer to
        (key, value, score, real, statistics) for compressed layers (CompressedKV.recorder) or, for sliding layers,
        the kept window (key, value) and the number of tokens seen. `token_ids` [B, n]: the prompt (FastGen)."""
        first = True
        for i, layer in enumerate(self.layers):
            if self.sliding[i]:
                keys, values, seen = records[i]
                layer.update(keys, values)
                pending.clear()                         # a replayed window has no attention call to hand over to
                layer.cumulative_length = seen
            else:
                key, value, score, real, statistics = records[i]
                key, value = key.float(), value.float()         # as recorded (a probe keeps them in fp16)
                if first and token_ids is not None:
                    self.observe_tokens(token_ids)
                first = False
                layer.lazy_initialization(key, value)
                layer.seen = key.shape[-2]
                self.kv.write_prompt(i, key, value, score, real, statistics)

    def _ensure_kv(self, key_states: torch.Tensor) -> None:
        if self.kv is None:
            raw16 = key_states.dtype if key_states.dtype in (torch.float16, torch.bfloat16) else torch.float16
            self.kv = CompressedKV.from_bundle(self.bundle, self.config, batch=key_states.shape[0],
                                               sliding=self.sliding, device=key_states.device, raw16=raw16,
                                               token_classes=self.token_classes,
                                               raw_tokens=0 if self.record else self.raw_tokens,
                                               serve=self.serve)
            if self.record:
                self.kv.recorder = {}
            for ids in self._new_ids:
                self.kv.policy("fastgen").observe_tokens(ids)
            self._new_ids = []

    def observe_tokens(self, ids: torch.Tensor | None) -> None:
        """ids [B, n]: the tokens the next forward call adds. Only FastGen reads them (its own state); they wait
        here until the first layer of the first call has made the compressed state."""
        if self.config.fastgen is None:
            return
        if ids is None:
            raise ValueError("FastGen needs token ids: run the model with `input_ids`, not `inputs_embeds`")
        if self.kv is None:
            self._new_ids.append(ids)
        else:
            self.kv.policy("fastgen").observe_tokens(ids)

    # --------------------------------------------------------------------------------------------- accounting

    def memory(self) -> dict[str, float]:
        """The KV bytes this cache holds now, against an fp16 dense cache of the same tokens (`fp16_bytes`), and the
        ratio a long sequence converges to.

        total_bytes: the tokens' storage: pages in use (`paged_bytes`, metadata and fragmentation included), the raw
        phase's K/V (`raw_bytes`, 16 bits per element, CompressedKV) and the sliding layers (`sliding_bytes`: their
        codes and scales when quantized, else their K/V at 16 bits as served, `dense_bytes`, as kvcal's own raw tiers
        do). ratio_to_fp16 = total_bytes / fp16_bytes: what is held now.
        held_bytes: every byte the cache holds now: total_bytes, plus the arena's free pages, the page tables and
        counters, the raw phase's significance buffers and the bundle's constants (`fixed_bytes`: static key scales
        and calibrated levels, per-model, not in total_bytes or the ratio). held_bytes <= fp16_bytes + allowance_bytes
        at every length (docs/runtime.md).
        steady_state_ratio: page bytes per token once tokens settle at their tier, against fp16 per token
        (`CompressedKV.steady_state_ratio`): what ratio_to_fp16 approaches on a long sequence."""
        kv = self.kv
        paged = kv.store.bytes_in_use() if kv else 0
        raw = kv.raw_bytes() if kv else 0
        window = dense_fp16 = extra = 0
        sliding_levels = self._sliding_level_bytes()
        for layer, sliding in zip(self.layers, self.sliding):
            if sliding and isinstance(layer, QuantizedSlidingLayer):
                window += layer.held_bytes()
                dense_fp16 += layer.tokens_held() * layer.head_dim * 2 * 2
            elif sliding and layer.is_initialized:
                window += dense_bytes(layer.keys, layer.values)
                dense_fp16 += layer.keys.numel() * 2 * 2
        if kv is not None:
            L = kv.layers
            H, d = self.bundle.model.num_kv_heads, self.bundle.model.head_dim
            tokens = kv.length[L[0]] * kv.batch - int(kv.n_pad.sum()) if L else 0
            dense_fp16 += tokens * len(L) * H * d * 2 * 2
            extra = kv.store.held_bytes() - paged + kv.raw_score_bytes()
        extra += sliding_levels
        fixed = (kv.store.fixed_bytes() if kv else 0) + sliding_levels
        total = paged + raw + window
        return {"paged_bytes": paged, "raw_bytes": raw, "sliding_bytes": window, "total_bytes": total,
                "fp16_bytes": dense_fp16, "ratio_to_fp16": total / dense_fp16 if dense_fp16 else float("nan"),
                "fixed_bytes": fixed, "held_bytes": total + extra,
                "held_ratio_to_fp16": (total + extra) / dense_fp16 if dense_fp16 else float("nan"),
                "allowance_bytes": self.allowance_bytes(),
                "steady_state_ratio": kv.steady_state_ratio() if kv else float("nan"),
                "raw_tokens": kv.raw_tokens if kv else 0}

    def allowance_bytes(self) -> int:
        """The fixed amount by which `memory()["held_bytes"]` may exceed an fp16 cache of the same tokens
        (`CompressedKV.allowance_bytes`, docs/runtime.md), and the sliding layers' calibrated levels, a bundle
        constant as the store's are; 0 before the first call."""
        return (self.kv.allowance_bytes() + self._sliding_level_bytes()) if self.kv is not None else 0

    def _sliding_level_bytes(self) -> int:
        """Bytes of the quantized sliding layers' calibrated levels: a bundle constant, as the store's levels."""
        return sum(layer.level_bytes() for layer in self.layers if isinstance(layer, QuantizedSlidingLayer))

    def release(self) -> int:
        """Return every page to the arena's free list (the sequences are finished) and empty the cache, so it can
        serve a new batch as if it were new. Returns the number of pages freed."""
        self._shared, self._thread = False, None
        if self.kv is None:
            return 0
        # tensors made under torch.inference_mode() (a common way to call generate) may only be updated in place
        # inside it; entering it is harmless for tensors made under no_grad
        with torch.inference_mode():
            freed = self.kv.release()
        self.kv, self._new_ids = None, []
        for i, layer in enumerate(self.layers):
            self.layers[i] = (self._sliding_layer(i, layer.sliding_window) if self.sliding[i]
                              else KvcalLayer(self, i))
        return freed

    def reset(self) -> None:
        """transformers' way to empty a cache: `release()` (the layers' own reset would keep the pages)."""
        self.release()

    # --------------------------------------------------------------------------------------------- generate's edits
    # Beam search, batch selection and repetition re-index the page tables (pages become shared, copied on write);
    # crop removes the newest tokens if they are all still at the high tier. Costs: docs/runtime.md.

    def _select(self, index: torch.Tensor) -> None:
        for i, layer in enumerate(self.layers):
            if self.sliding[i] and layer.is_initialized:
                layer.batch_select_indices(index)
        if self.kv is not None:
            self.kv.select(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence i continues old sequence beam_idx[i]."""
        self._select(beam_idx.long())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the sequences `indices` (int rows or a bool mask [B])."""
        indices = torch.as_tensor(indices)
        self._select(indices.nonzero().flatten() if indices.dtype == torch.bool else indices.long())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each sequence `repeats` times in place (num_beams / num_return_sequences on a filled cache)."""
        if self.kv is not None or any(layer.is_initialized for layer in self.layers):
            B = self.kv.batch if self.kv is not None else next(l.keys.shape[0] for l in self.layers
                                                              if l.is_initialized)
            self._select(torch.arange(B).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest `-tokens_to_remove` tokens (transformers 5: a negative count; 0 does nothing). Exact
        for tokens still at the high tier; ValueError (nothing changed) if one was moved low or pruned."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number, the count of newest tokens to "
                             f"remove (transformers 5 semantics), e.g. crop(-{tokens_to_remove})")
        if tokens_to_remove == 0 or self.kv is None:
            return
        seen = max(layer.seen for layer, s in zip(self.layers, self.sliding) if not s)
        keep = seen + tokens_to_remove
        if keep < 0:
            raise ValueError(f"crop({tokens_to_remove}): the cache holds {seen} tokens; remove at most {seen}")
        self.kv.crop(keep)          # checks every compressed layer first; raises before any change
        for i, layer in enumerate(self.layers):
            if self.sliding[i]:
                layer.crop(tokens_to_remove)
            else:
                layer.seen = keep
