"""Baseline KV caches that are not special cases of the kvcal store: dense, token eviction, transformers' own.

Every cache here is a transformers `Cache` and reports memory the way `KvcalCache.memory()` does:

    {"total_bytes": bytes of every tensor the cache holds (K/V and any per-token metadata such as positions or
                    scores), "fp16_bytes": an fp16 dense cache of the same tokens, "ratio_to_fp16": their ratio}

The fp16 reference counts, per full-attention layer, every token seen (B x H x seen x d x 2 tensors x 2 bytes); a
sliding-window layer (Gemma3) counts the tokens it holds, since a dense cache is bounded there too (as KvcalCache).

Eviction baselines (`StreamingLLMCache`, `H2OCache`, `SnapKVCache`) keep, per (sequence, layer, KV head), a fixed
number of tokens decided by a token budget `budget(n)` for a cache that has seen n tokens. "Matched memory": the budget
is set so that the bytes held, metadata included, equal `ratio` x the fp16 bytes of n tokens:

    budget(n) = ceil(ratio * n * fp16_token_bytes / held_token_bytes), clipped to [min_tokens, n]

where held_token_bytes counts K and V in the store dtype plus each kept token's int32 position (and H2O's fp32
score). The store dtype is the model dtype for fp16/bf16 models and fp16 otherwise (as the kvcal store's raw tier).
New tokens attend at full precision on the step that adds them and are stored afterwards, as in kvcal.

Prefill attention is always dense (over the whole prompt), exactly as kvcal's; eviction decides what is *cached*
afterwards. A bench-specific attention function (`BENCH_IMPL`, installed by `install`) runs attention for a pending
eviction layer (computing attention probabilities when the method needs them) and hands them to the layer, which
then evicts down to its budget; every other call (KvcalCache layers, dense layers) goes on to kvcal's attention
function, which falls back to SDPA. Batches must be unpadded (the bench feeds equal-length windows).

Faithfulness, per method:

* StreamingLLM (Xiao et al., ICLR 2024, arXiv 2309.17453): the first `sinks` = 4 tokens plus the most recent
  budget - 4. Cached keys keep their original RoPE positions (the paper re-indexes positions inside the cache; on
  contexts within the model's window the original positions are the usual re-implementation, as in kvpress).
* H2O (Zhang et al., NeurIPS 2023, arXiv 2306.14048): each cached token's score is the attention probability it
  received, summed over the query heads of its KV head and over every query (prefill and decode) since it entered;
  the most recent `recent` tokens (default half the budget, the paper's equal heavy/recent split) are always kept,
  the rest of the budget goes to the highest scores, and eviction is permanent. At prefill the heavy hitters are
  chosen from the scores of all prompt queries at once (the paper's real-drop implementation does the same).
* SnapKV (Li et al., NeurIPS 2024, arXiv 2404.14469): at prefill, the last `window` = 32 prompt queries are the
  observation window; each prefix token's score is the probability those queries give it, summed over the window and
  the KV head's query heads, then average-pooled along the sequence with kernel 7; the top (prompt budget - window)
  prefix tokens plus the window are kept. Decode tokens are appended without further eviction, as in SnapKV. So that
  the memory still matches at the end of a run of `reserve` decode steps, the prompt budget is
  budget(n + reserve) - reserve.
"""

from __future__ import annotations

import math
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicSlidingWindowLayer, QuantizedCache

BENCH_IMPL = "kvcal_bench"
_PENDING: ContextVar[tuple | None] = ContextVar("kvcal_bench_pending", default=None)
_CHUNK = 512   # query rows per block when probabilities are needed: bounds the [B, H, g, rows, S] block


# --------------------------------------------------------------------------------------------- accounting


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in `obj` (a tensor, a tensor subclass with `__tensor_flatten__` such as quanto's
    QTensor, or tuples / lists / dicts of them)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def memory_dict(total: int, fp16: int) -> dict[str, float]:
    return {"total_bytes": total, "fp16_bytes": fp16, "ratio_to_fp16": total / fp16 if fp16 else float("nan")}


def store_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype a baseline stores K/V in: the model's if it is 16-bit, else fp16 (as the kvcal store's raw tier)."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


def _sliding_bytes(layer) -> tuple[int, int]:
    """(held bytes, fp16 bytes) of a transformers sliding-window layer."""
    if not layer.is_initialized or layer.keys is None:
        return 0, 0
    return tensor_bytes(layer.keys) + tensor_bytes(layer.values), layer.keys.numel() * 2 * 2


class DenseCache(DynamicCache):
    """transformers' DynamicCache (model dtype) with `memory()`: the dense baseline, bit-identical to the model."""

    def memory(self) -> dict[str, float]:
        total = fp16 = 0
        for layer in self.layers:
            if layer.is_initialized and layer.keys is not None:
                total += tensor_bytes(layer.keys) + tensor_bytes(layer.values)
                fp16 += layer.keys.numel() * 2 * 2
        return memory_dict(total, fp16)


class MeasuredQuantizedCache(QuantizedCache):
    """transformers' own `QuantizedCache` with `memory()`: quanto / hqq (KIVI-like, per-channel groups and a residual
    window of `residual_length` tokens in the model dtype) or fp8 (one per-tensor scale frozen at prefill). Building
    one for a backend whose package is missing raises transformers' ImportError."""

    def memory(self) -> dict[str, float]:
        total = fp16 = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            total += tensor_bytes(getattr(layer, "_quantized_keys", None))
            total += tensor_bytes(getattr(layer, "_quantized_values", None))
            total += tensor_bytes(layer.keys) + tensor_bytes(layer.values)        # residual window (quanto / hqq)
            B, H, d = _dims(layer)
            fp16 += B * H * layer.get_seq_length() * d * 2 * 2
        return memory_dict(total, fp16)


def _dims(layer) -> tuple[int, int, int]:
    """(batch, KV heads, head dim) of a quantized layer, from whichever of its tensors is still 4-D."""
    for t in (layer.keys, getattr(layer, "_quantized_keys", None)):
        # HQQ keeps its codes 2-D and the original shape in its metadata (empty residual right after prefill)
        if isinstance(t, tuple):
            t = t[1].get("shape", ()) if isinstance(t[1], dict) else t[0]                # hqq: (codes, meta)
        shape = tuple(getattr(t, "shape", t) if t is not None else ())
        if len(shape) == 4:
            return shape[0], shape[1], shape[3]
    return 0, 0, 0


# --------------------------------------------------------------------------------------------- attention


def install(model) -> None:
    """Register the bench attention function (and its mask) and make `model` use it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(BENCH_IMPL, bench_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(BENCH_IMPL, sdpa_mask)
    if model.config._attn_implementation != BENCH_IMPL:
        model.set_attn_implementation(BENCH_IMPL)


def bench_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: a pending eviction layer's attention (then its eviction step); anything
    else goes to kvcal's attention function (compressed path for a KvcalCache layer, SDPA otherwise)."""
    pending = _PENDING.get()
    if pending is None or pending[0].layer_idx != module.layer_idx or pending[1] is not key:
        from kvcal.runtime.hf import kvcal_attention

        return kvcal_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    _PENDING.set(None)
    layer = pending[0]
    q = query.shape[2]
    if attention_mask is not None and key.shape[2] == q:      # prefill: the mask tells padding apart
        from kvcal.runtime.hf import real_tokens

        real = real_tokens(attention_mask, q)
        if real is not None and not bool(real.all()):
            raise ValueError("the eviction baselines take unpadded batches (equal-length prompts)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, score = attend(query, key, value, scale, layer.score_rows(q))
    layer.after_attention(score)
    return out.transpose(1, 2).contiguous(), None


def attend(query, key, value, scale: float, score_from: int | None):
    """Attention where the last q keys are the queries' own tokens (causal among themselves) and every key before
    them is visible to every query.

    query [B, Hq, q, d]; key, value [B, H, S, d]. Returns out [B, Hq, q, d] (query's dtype) and, unless `score_from`
    is None, score [B, H, S] float32: the probability each key received from query rows >= score_from, summed over
    those rows and over the query heads of its KV head (float32 softmax, like eager attention).
    """
    B, Hq, q, d = query.shape
    S = key.shape[2]
    old = S - q
    if score_from is None or score_from > 0:
        # output from SDPA; probabilities (if any) only for the rows that score
        mask = None if q == 1 or old == 0 else _allowed(torch.arange(q, device=query.device), old, S)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=(old == 0 and q > 1),
                                             scale=scale, enable_gqa=True)
        if score_from is None:
            return out, None
        _, score = _eager(query[:, :, score_from:], key, value, scale, old + score_from, want_out=False)
        return out, score
    return _eager(query, key, value, scale, old, want_out=True)


def _allowed(rows: torch.Tensor, old: int, S: int) -> torch.Tensor:
    """bool [rows, S]: query row i (the (old + i)-th token) sees keys 0 .. old + i."""
    return torch.arange(S, device=rows.device)[None, :] <= (old + rows)[:, None]


def _eager(query, key, value, scale, old, want_out):
    """Chunked float32 attention of query rows at token indices old, old + 1, ... over key [B, H, S, d]."""
    B, Hq, q, d = query.shape
    H, S = key.shape[1], key.shape[2]
    g = Hq // H
    qf = query.float().view(B, H, g, q, d)
    kf, vf = key.float(), value.float()
    out = torch.empty(B, H, g, q, d, device=query.device) if want_out else None
    score = torch.zeros(B, H, S, device=query.device)
    for start in range(0, q, _CHUNK):
        rows = torch.arange(start, min(start + _CHUNK, q), device=query.device)
        logits = torch.einsum("bhgnd,bhsd->bhgns", qf[:, :, :, rows], kf) * scale        # [B, H, g, c, S]
        probs = torch.softmax(logits.masked_fill(~_allowed(rows, old, S), float("-inf")), dim=-1)
        if want_out:
            out[:, :, :, rows] = torch.einsum("bhgns,bhsd->bhgnd", probs, vf)
        score += probs.sum(dim=(2, 3))
    if want_out:
        out = out.reshape(B, Hq, q, d).to(query.dtype)
    return out, score


# --------------------------------------------------------------------------------------------- eviction


class EvictionLayer(CacheLayerMixin):
    """One layer's kept tokens: keys, values [B, H, kept, d] in the store dtype, pos int32 [B, H, kept] (cache index
    of each kept token, ascending). Subclasses decide what to keep (`after_attention`)."""

    is_sliding = False
    is_compileable = False
    extra_bytes = 0          # per-token metadata besides K, V and position (H2O: its fp32 score)

    def __init__(self, owner: EvictionCache, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.seen = 0
        self.pos = None

    def lazy_initialization(self, key_states, value_states) -> None:
        B, H, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        sd = store_dtype(key_states.dtype)
        self.keys = key_states.new_zeros(B, H, 0, d, dtype=sd)
        self.values = value_states.new_zeros(B, H, 0, value_states.shape[-1], dtype=sd)
        self.pos = torch.zeros(B, H, 0, dtype=torch.int32, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, n, _ = key_states.shape
        full_k = torch.cat([self.keys.to(key_states.dtype), key_states], dim=2)   # new tokens at full precision
        full_v = torch.cat([self.values.to(value_states.dtype), value_states], dim=2)
        self.keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=2)
        self.values = torch.cat([self.values, value_states.to(self.values.dtype)], dim=2)
        new = torch.arange(self.seen, self.seen + n, dtype=torch.int32, device=key_states.device)
        self.pos = torch.cat([self.pos, new.expand(B, H, n)], dim=2)
        self.seen += n
        self._appended(n)
        _PENDING.set((self, full_k))
        return full_k, full_v

    def _appended(self, n: int) -> None:
        """Hook: n tokens were appended (H2O grows its score tensor)."""

    def score_rows(self, q: int) -> int | None:
        """First query row whose attention probabilities this method needs (None: none)."""
        return None

    def after_attention(self, score: torch.Tensor | None) -> None:
        raise NotImplementedError

    @property
    def kept(self) -> int:
        return self.keys.shape[2] if self.is_initialized else 0

    def keep(self, idx: torch.Tensor) -> None:
        """Keep the tokens at indices idx [B, H, k] (ascending) of the kept dimension."""
        d_k, d_v = self.keys.shape[-1], self.values.shape[-1]
        self.keys = self.keys.gather(2, idx[..., None].expand(-1, -1, -1, d_k))
        self.values = self.values.gather(2, idx[..., None].expand(-1, -1, -1, d_v))
        self.pos = self.pos.gather(2, idx)

    def nbytes(self) -> int:
        return tensor_bytes(self.keys) + tensor_bytes(self.values) + tensor_bytes(self.pos)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kept + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen          # positions of new tokens follow every token seen, kept or not

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = self.pos = None
        self.seen = 0

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("the bench's eviction caches do not support beam search")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("the bench's eviction caches cannot be cropped")


class StreamingLLMLayer(EvictionLayer):
    def after_attention(self, score) -> None:
        budget, sinks = self.owner.budget(self.seen), self.owner.sinks
        if self.kept <= budget:
            return
        B, H, kept = self.pos.shape
        idx = torch.cat([torch.arange(sinks), torch.arange(kept - (budget - sinks), kept)]).to(self.pos.device)
        self.keep(idx.expand(B, H, -1))


class H2OLayer(EvictionLayer):
    extra_bytes = 4          # the fp32 accumulated score of each kept token

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.score = torch.zeros(*key_states.shape[:2], 0, device=key_states.device)

    def _appended(self, n: int) -> None:
        self.score = torch.cat([self.score, self.score.new_zeros(*self.score.shape[:2], n)], dim=2)

    def score_rows(self, q: int) -> int:
        return 0

    def after_attention(self, score) -> None:
        self.score = self.score + score
        budget = self.owner.budget(self.seen)
        if self.kept <= budget:
            return
        recent = self.owner.recent_for(budget)
        B, H, kept = self.pos.shape
        old = kept - recent
        heavy = self.score[:, :, :old].topk(budget - recent, dim=-1).indices.sort(dim=-1).values
        tail = torch.arange(old, kept, device=heavy.device).expand(B, H, recent)
        self.keep(torch.cat([heavy, tail], dim=-1))

    def keep(self, idx) -> None:
        super().keep(idx)
        self.score = self.score.gather(2, idx)

    def nbytes(self) -> int:
        return super().nbytes() + tensor_bytes(self.score)

    def reset(self) -> None:
        super().reset()
        self.score = None


class SnapKVLayer(EvictionLayer):
    def score_rows(self, q: int) -> int | None:
        if self.seen != q:       # decode: no scores needed, nothing is evicted
            return None
        return max(q - self.owner.window, 0)

    def after_attention(self, score) -> None:
        if score is None:
            return
        n, w = self.seen, self.owner.window
        budget = self.owner.prompt_budget(n)
        if n <= budget or n <= w:
            return
        B, H, _ = score.shape
        prefix = score[:, :, :n - w]                                                     # [B, H, n - w]
        k = self.owner.kernel
        pooled = F.avg_pool1d(prefix.reshape(B * H, 1, -1), kernel_size=k, padding=k // 2, stride=1)
        pooled = pooled.reshape(B, H, -1)[..., :n - w]
        top = pooled.topk(budget - w, dim=-1).indices.sort(dim=-1).values
        window = torch.arange(n - w, n, device=top.device).expand(B, H, w)
        self.keep(torch.cat([top, window], dim=-1))


class EvictionCache(Cache):
    """A transformers Cache whose full-attention layers evict tokens to a budget (see the module docstring)."""

    layer_class: type[EvictionLayer] = EvictionLayer
    min_tokens = 1

    def __init__(self, *, ratio: float, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 layer_types: list[str], sliding_window: int | None = None):
        if not 0 < ratio:
            raise ValueError(f"`ratio={ratio}` must be > 0")
        self.ratio, self.num_kv_heads, self.head_dim = ratio, num_kv_heads, head_dim
        self.sliding = [t == "sliding_attention" for t in layer_types]
        elem = torch.finfo(store_dtype(dtype)).bits // 8
        self.token_bytes = 2 * head_dim * elem + 4 + self.layer_class.extra_bytes   # K, V, int32 position (+ score)
        layers = [DynamicSlidingWindowLayer(sliding_window) if s else self.layer_class(self, i)
                  for i, s in enumerate(self.sliding)]
        super().__init__(layers=layers)

    def budget(self, n: int) -> int:
        """Tokens kept per (sequence, KV head) once n tokens have been seen."""
        want = math.ceil(self.ratio * n * (2 * self.head_dim * 2) / self.token_bytes - 1e-9)
        return min(n, max(want, self.min_tokens))

    def memory(self) -> dict[str, float]:
        total = fp16 = 0
        for layer, sliding in zip(self.layers, self.sliding):
            if sliding:
                held, ref = _sliding_bytes(layer)
                total, fp16 = total + held, fp16 + ref
            elif layer.is_initialized:
                B, H, _, d = layer.keys.shape
                total += layer.nbytes()
                fp16 += B * H * layer.seen * d * 2 * 2
        return memory_dict(total, fp16)

    def kept_tokens(self) -> list[int]:
        """Tokens kept per (sequence, KV head) in each compressed layer (the same for every head by construction)."""
        return [layer.kept for layer, s in zip(self.layers, self.sliding) if not s]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the bench's eviction caches do not support expanding the batch")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("the bench's eviction caches do not support selecting batch rows")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("the bench's eviction caches cannot be cropped")


class StreamingLLMCache(EvictionCache):
    """Attention sinks + recent window (StreamingLLM). Based on Xiao et al., arXiv 2309.17453, §3.2."""

    layer_class = StreamingLLMLayer
    sinks = 4

    @property
    def min_tokens(self) -> int:
        return self.sinks + 1


class H2OCache(EvictionCache):
    """Heavy hitters + recent window (H2O). Based on Zhang et al., arXiv 2306.14048, §3.2 and Algorithm 1."""

    layer_class = H2OLayer
    min_tokens = 2

    def __init__(self, *, recent: int | None = None, **kwargs):
        self.recent = recent           # None: half of the budget (the paper's equal heavy / recent split)
        super().__init__(**kwargs)

    def recent_for(self, budget: int) -> int:
        r = budget // 2 if self.recent is None else self.recent
        return max(1, min(r, budget - 1))


class SnapKVCache(EvictionCache):
    """Observation-window voting at prefill (SnapKV). Based on Li et al., arXiv 2404.14469, §4.2 and Listing 1."""

    layer_class = SnapKVLayer

    def __init__(self, *, reserve: int = 0, window: int = 32, kernel: int = 7, **kwargs):
        self.reserve, self.window, self.kernel = reserve, window, kernel
        super().__init__(**kwargs)

    @property
    def min_tokens(self) -> int:
        return self.window + 1

    def prompt_budget(self, n: int) -> int:
        """Prompt tokens kept after a prefill of n, so that n + reserve tokens later the budget is met exactly."""
        return min(n, max(self.budget(n + self.reserve) - self.reserve, self.min_tokens))
