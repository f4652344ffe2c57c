"""Decode-phase fidelity of a compressed cache against the dense cache, on the same inputs.

Protocol: prefill P prompt tokens through the cache under test, then teacher-force the continuation one token per
step. Step t feeds continuation token t and predicts token t + 1, reading everything before it from the cache. The
prefill's own last prediction is not scored, because compressing the cache cannot change it (prefill attention runs
on the uncompressed K/V). The reference logits come from one dense forward pass over prompt + continuation.

Metrics over every scored prediction: mean KL(dense || compressed) in nats; top-1 agreement with the dense argmax;
continuation perplexity of the true tokens under both, and their ratio exp(mean NLL_c - mean NLL_d). Memory: bytes the
cache actually holds at the end (pages in the arena, metadata and fragmentation included), against an fp16 dense
cache of the same tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class Fidelity:
    kl: float                 # mean KL(dense || compressed), nats
    top1: float               # agreement with the dense argmax
    ppl: float                # continuation perplexity, compressed
    ppl_dense: float
    ppl_ratio: float          # exp(mean NLL compressed - mean NLL dense)
    predictions: int          # scored predictions (sequences x steps)
    prompt_tokens: int
    memory: dict = field(default_factory=dict)   # KvcalCache.memory() at the end (empty for dense)
    tiers: dict = field(default_factory=dict)    # token-head fractions high / low / pruned (compressed layers)
    decode_ms_per_step: float = 0.0
    page_ms_per_step: float = 0.0                # time in page allocation per step (page-management share)
    top1_windows: list = field(default_factory=list)   # top-1 of each window (sequence): variation between documents


@torch.inference_mode()
def dense_logits(model, ids: torch.Tensor, start: int = 0, chunk: int = 64) -> torch.Tensor:
    """Logits [B, S - start, vocab] (float32) at positions start.. of one dense forward over ids [B, S]; the head
    runs a few positions at a time, only where logits are needed (a [S, vocab] tensor costs GBs on big vocabularies)."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, start:]
    return torch.cat([head_logits(model, hidden[:, i:i + chunk]) for i in range(0, hidden.shape[1], chunk)], dim=1)


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's head over hidden [B, c, D] -> float32 logits [B, c, vocab], with the final soft-capping some
    models apply in their forward."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def prefill_precision(model, dtype: torch.dtype | None) -> AbstractContextManager:
    """The context a prompt's prefill runs in: its matrix products in `dtype` (`torch.autocast`, no weight copies
    kept) where that is not the model's own dtype; else nothing. The calibration prefills its 4k prompts in the dtype
    the model was loaded in (bf16 where the hardware computes it) and runs every continuation in float32: the dense
    reference and each coded cache then read the same prefilled K/V, so the prefill's rounding is not charged to
    compression, where a bf16 continuation's is (docs/calibration.md, "Prompts prefilled in bf16"). Cast what the
    prefill leaves back with `in_model_dtype`."""
    own = next(model.parameters())
    if dtype is None or dtype == own.dtype:
        return nullcontext()
    return torch.autocast(own.device.type, dtype=dtype, cache_enabled=False)


def in_model_dtype(model, records: dict) -> dict:
    """`records` (layer -> (key, value, ...), as a recorded prefill or a cache holds them) with key and value in the
    model's parameter dtype: under `prefill_precision` values come out of the projections in the prefill's dtype."""
    dtype = next(model.parameters()).dtype
    return {i: (key.to(dtype), value.to(dtype), *rest) for i, (key, value, *rest) in records.items()}


def dense_cache(model, records: dict, keep: bool = True):
    """A transformers `DynamicCache` holding a recorded prompt: `records` maps each layer to its K/V [B, H, n, d]
    (and more, ignored) or, for a sliding layer, (its kept window's keys, values, the number of tokens it has seen).
    `keep=False`: a cache for one forward pass only, whose full-attention layers hand each forward the prompt and the
    new tokens without keeping the new ones (no second copy of every layer's K/V while the pass runs)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    dtype = next(model.parameters()).dtype
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            keys, values, seen = records[i]
            layer.update(keys, values)
            layer.cumulative_length = seen
        else:
            # the recorded tensors themselves, not a copy by update's cat: a DynamicLayer never writes into its
            # tensors (each update makes new ones), so the records stay as they were
            key, value = records[i][0].to(dtype), records[i][1].to(dtype)
            layer.lazy_initialization(key, value)
            layer.keys, layer.values = key, value
            if not keep:
                layer.update = _PassThrough(layer)
    return cache


class _PassThrough:
    """A full-attention cache layer's `update` that returns prompt + new K/V [B, H, n + m, d] and keeps only the
    prompt (`dense_cache(keep=False)`)."""

    def __init__(self, layer):
        # the prompt's tensors, not the layer: the layer holds this as its `update`, and a reference back would make
        # a cycle that keeps every layer's K/V alive until the garbage collector happens to run
        self.keys, self.values = layer.keys, layer.values

    def __call__(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


@torch.inference_mode()
def reference_top(model, records: dict, continuation: torch.Tensor, chunk: int = 64) -> TopLogits:
    """The dense reference of continuation[:, :M] (continuation [B, M + 1]) after a recorded prompt, as TopLogits
    [B, M, k] for the true next tokens continuation[:, 1:]: one forward of the whole continuation through a
    transformers `DynamicCache` of the prompt's exact K/V from `records` (`DecodeProbe`'s, taken from the recording
    prefill) that keeps no new tokens, then the head `chunk` positions at a time. Equal to one dense forward over
    prompt + continuation up to float rounding, at the cost of the continuation alone, and with no K/V copied per
    chunk: the prompt is not run a second time."""
    M = continuation.shape[1] - 1
    hidden = model.model(input_ids=continuation[:, :M], cache=dense_cache(model, records, keep=False),
                         use_cache=True).last_hidden_state
    return TopLogits.cat([TopLogits.of(head_logits(model, hidden[:, t:t + chunk]), continuation[:, t + 1:t + chunk + 1])
                          for t in range(0, M, chunk)])


def teacher_force(model, cache, continuation: torch.Tensor,
                  on_logits: Callable[[int, torch.Tensor], None] | None = None) -> tuple[torch.Tensor | None, float]:
    """Feed continuation[:, :-1] [B, M] through `cache` one token per forward pass, the stepwise decode users run:
    logits [B, M, vocab] float32, seconds. `on_logits(t, logits [B, 1, vocab])`: hand each step's logits over instead
    of keeping them (returns None for logits): [B, M, vocab] float32 is hundreds of MB at a 256-token continuation on
    a 50k vocabulary."""
    steps = []
    M = continuation.shape[1] - 1
    t0 = time.perf_counter()
    for t in range(M):
        logits = model(input_ids=continuation[:, t:t + 1], cache=cache, use_cache=True).logits
        if on_logits is None:
            steps.append(logits.float())
        else:
            on_logits(t, logits.float())
    return (torch.cat(steps, dim=1) if on_logits is None else None), time.perf_counter() - t0


TOP_K = 256    # reference tokens a probe keeps per scored position (TopLogits)


@dataclass
class TopLogits:
    """What scoring reads of reference logits [B, c, vocab], kept instead of them: the `k` most likely tokens'
    log-probabilities and ids, and the true next token's log-probability. A probe over 4 x 256 positions keeps 4 MB
    this way instead of 0.2 GB (1 GB on a 262k vocabulary).

    KL against it is the KL of the two distributions coarsened to those k tokens plus one bucket for the rest of the
    vocabulary: a lower bound of the full KL (data-processing inequality), equal to it when the rest holds no mass in
    either. Top-1 agreement and perplexities are exact."""

    logp: torch.Tensor          # float32 [B, c, k], descending
    ids: torch.Tensor           # long [B, c, k]
    target_logp: torch.Tensor   # float32 [B, c]

    @classmethod
    def of(cls, logits: torch.Tensor, target: torch.Tensor, k: int = TOP_K) -> TopLogits:
        """logits [B, c, vocab], target [B, c] -> the top `k` (all when the vocabulary is smaller)."""
        logp = F.log_softmax(logits.float(), -1)
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return cls(top.values, top.indices, logp.gather(-1, target[..., None])[..., 0])

    @classmethod
    def empty(cls, batch: int, positions: int, k: int) -> TopLogits:
        return cls(torch.empty(batch, positions, k), torch.empty(batch, positions, k, dtype=torch.long),
                   torch.empty(batch, positions))

    @classmethod
    def cat(cls, parts: list[TopLogits]) -> TopLogits:
        """Consecutive positions' parts [B, c_i, k] -> one [B, sum c_i, k]."""
        return cls(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in ("logp", "ids", "target_logp")))

    def __getitem__(self, index) -> TopLogits:
        """Rows and positions, e.g. top[:, t:t + c] or top[b:b + 1]."""
        index = index if isinstance(index, tuple) else (index,)
        return TopLogits(self.logp[index], self.ids[index], self.target_logp[index])

    def __setitem__(self, index, other: TopLogits) -> None:
        self.logp[index], self.ids[index], self.target_logp[index] = other.logp, other.ids, other.target_logp

    def kl(self, logp: torch.Tensor) -> torch.Tensor:
        """KL(reference || q) per position [B, c] for q's log-probabilities logp [B, c, vocab] (class docstring)."""
        p, lq = self.logp.exp(), logp.gather(-1, self.ids)
        kept = (p * (self.logp - lq)).sum(-1)
        if self.ids.shape[-1] == logp.shape[-1]:        # the whole vocabulary: no rest (1 - sum p is rounding)
            return kept
        # the rest's masses from 1 - the kept ones: float32 resolves them to about 1e-7, so below that they count 0
        rest_p, rest_q = 1 - p.sum(-1), 1 - lq.exp().sum(-1)
        rest = rest_p * (rest_p.clamp(min=1e-7).log() - rest_q.clamp(min=1e-7).log())
        return kept + torch.where(rest_p > 1e-7, rest, 0.0)


class LogitScores:
    """`compare_logits`'s sums, added a few positions at a time (`add`), so no [B, M, vocab] tensor is needed."""

    def __init__(self, batch: int):
        self.kl, self.agree, self.nll, self.nll_ref, self.count = (torch.zeros(batch, dtype=torch.float64)
                                                                    for _ in range(5))   # count: positions per window

    def add(self, ref: torch.Tensor | TopLogits, got: torch.Tensor, target: torch.Tensor,
            rows: slice = slice(None)) -> None:
        """ref [b, c, vocab] logits or their TopLogits, got [b, c, vocab] logits; target [b, c] the true next tokens
        of windows `rows` (default: all)."""
        logp = F.log_softmax(got.float(), -1)
        if isinstance(ref, TopLogits):
            kl, agree, nll_ref = ref.kl(logp), ref.ids[..., 0] == got.argmax(-1), -ref.target_logp
        else:
            logp_ref = F.log_softmax(ref.float(), -1)
            kl, agree = (logp_ref.exp() * (logp_ref - logp)).sum(-1), ref.argmax(-1) == got.argmax(-1)
            nll_ref = -logp_ref.gather(-1, target[..., None])[..., 0]
        self.kl[rows] += kl.sum(-1).double()
        self.agree[rows] += agree.sum(-1).double()
        self.nll[rows] -= logp.gather(-1, target[..., None]).sum((-1, -2)).double()
        self.nll_ref[rows] += nll_ref.sum(-1).double()
        self.count[rows] += target.shape[1]

    def fidelity(self, prompt_tokens: int, seconds: float, cache=None) -> Fidelity:
        n, M = max(int(self.count.sum()), 1), int(self.count.max())
        nll, nll_ref = self.nll.sum().item() / n, self.nll_ref.sum().item() / n
        result = Fidelity(kl=self.kl.sum().item() / n, top1=self.agree.sum().item() / n, ppl=math.exp(nll),
                          ppl_dense=math.exp(nll_ref), ppl_ratio=math.exp(nll - nll_ref),
                          predictions=int(self.count.sum()),
                          prompt_tokens=prompt_tokens, decode_ms_per_step=1000 * seconds / max(M, 1),
                          top1_windows=(self.agree / self.count.clamp(min=1)).tolist())
        if getattr(cache, "kv", None) is not None:
            result.memory = cache.memory()
            result.tiers = tier_fractions(cache)
        return result


def compare_logits(ref: torch.Tensor, got: torch.Tensor, target: torch.Tensor, prompt_tokens: int, seconds: float,
                   cache=None, chunk: int = 32) -> Fidelity:
    """Metrics of logits `got` against `ref` (both [B, M, vocab]) for true next tokens `target` [B, M], `chunk`
    positions at a time (`LogitScores`)."""
    scores = LogitScores(target.shape[0])
    for t in range(0, target.shape[1], chunk):
        scores.add(ref[:, t:t + chunk], got[:, t:t + chunk], target[:, t:t + chunk])
    return scores.fidelity(prompt_tokens, seconds, cache)


@torch.inference_mode()
def decode_fidelity(model, prompt: torch.Tensor, continuation: torch.Tensor,
                    make_cache: Callable[[], object]) -> Fidelity:
    """prompt [B, P], continuation [B, M + 1] token ids; `make_cache()` returns a fresh cache (KvcalCache or
    DynamicCache). Scores M predictions per sequence."""
    P, M = prompt.shape[1], continuation.shape[1] - 1
    ref = dense_logits(model, torch.cat([prompt, continuation], dim=1)[:, :P + M], start=P)
    cache = make_cache()
    model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    kv = getattr(cache, "kv", None)
    page_s0 = kv.store.page_seconds if kv is not None else 0.0
    got, seconds = teacher_force(model, cache, continuation)
    result = compare_logits(ref, got, continuation[:, 1:], P, seconds, cache)
    if kv is not None:
        result.page_ms_per_step = 1000 * (kv.store.page_seconds - page_s0) / max(M, 1)
        cache.release()
    return result


def tier_fractions(cache) -> dict[str, float]:
    """Fractions of token-heads (compressed layers) held high, held low, or pruned."""
    kv = cache.kv
    counts = kv.tier_counts()
    layer = kv.layers[0]
    seen = (kv.length[layer] * kv.batch - int(kv.n_pad.sum())) * kv.store.num_kv_heads * len(kv.layers)
    return {"high": counts["high"] / seen, "low": counts["low"] / seen,
            "pruned": 1 - (counts["high"] + counts["low"]) / seen}


