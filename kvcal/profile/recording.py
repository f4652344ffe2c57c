"""The search's one recording: per search window, the dense prefill of its prompt and the continuation's forward and
backward pass through it. The quality model, the allocation and the coded probe all read it.

A window is a prompt of P tokens and a continuation of M + 1 (M scored predictions), as the runtime serves it:

1. the prompt is prefilled densely without gradients, by the runtime's own prefill attention (`select_backend`'s
   `prefill`), which is exact and also gives each prompt token's significance, from which the runtime picks its heavy
   hitters. Only decode queries read coded K/V. Its matrix products may run in the model's loaded dtype
   (`prefill_dtype`, bf16 where the CPU computes it); the K/V it leaves are cast back and everything below runs in
   the model's (float32) dtype over them;
2. the continuation runs through that cache in one forward with gradients, scoring each next token (the head and
   the loss `HEAD_SLICE` positions at a time, so no [M, vocab] block and its gradient exist at once). This gives the
   dense reference (`TopLogits`), the attention each key gets from the continuation's queries (which tokens are heavy
   hitters; summed in the attention's own forward), and g = dL/dK, dL/dV for every cached token at the deployment
   context, where L is the continuation's summed next-token loss. These are the gradients of the K/V that decode
   queries read, which is what coding them perturbs.

The continuation is one graph because a key coded in layer l changes the hidden states of every continuation token
above l, and later queries read those tokens' keys and values. Cutting the graph into chunks drops that path, which
is longest for the lowest layers, so it underprices them (docs/calibration.md, "The recording's graph"). The graph
holds no [n, S] block (`_GroupedAttention`); `chunk` cuts it, for tests and for measuring what cutting costs.

    rec = record_search(model, prompt, continuation, served, base, layer_types, head_dim)   # [B, P], [B, M + 1]
    rec.costs                     # the quality model's table (FormatCosts)
    rec.records, rec.ref, rec.held  # the coded probe's inputs
    rec.levels                    # the calibrated levels the costs of `LEVELED` formats used (bundle `levels.*`)

    held = HeldTokens(model, base, layer_types, B)          # prompts the runtime recorded, for the coded probe:
    probe = DecodeProbe(model, bundle, prompt, continuation, on_reference=held.capture)
    ev = recorded_prompts(probe.prompt, probe.continuation, probe.records, probe.ref, held, rec.levels)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicLayer

from kvcal.eval.fidelity import TopLogits, head_logits, prefill_precision
from kvcal.eval.spilled import SpilledRecords
from kvcal.profile.capture import attending_by
from kvcal.profile.heap import trim_heap
from kvcal.profile.quality_model import (
    ALPHAS,
    BASE_ALPHA,
    BITS,
    HIGH,
    SIDES,
    FormatCosts,
    add_layer_costs,
    continuation_score,
    first_exact,
    fit_layer_levels,
    held_masks,
    layer_format,
    newest_exact,
    side_bytes,
)
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.storage.bases import ServedBases
from kvcal.runtime.storage.layout import TierFormat


@dataclass
class Recording:
    prompt: torch.Tensor          # long [B, P]
    continuation: torch.Tensor    # long [B, M + 1]
    records: SpilledRecords       # per window, layer -> (key, value [1, H, P, d] fp16, None); a sliding layer: its
                                  # kept window (key, value [1, H, w, d] in the model dtype, tokens seen). On disk:
                                  # four 4k windows are hundreds of MB
    ref: TopLogits                # the dense reference [B, M, k]
    held: dict                    # paged layer -> bool [len(ALPHAS), B, H, P + M]: the tokens it holds in its
                                  # allocated format by the end, per heavy-hitter threshold
    costs: FormatCosts | None     # summed over the windows (None: `recorded_prompts`, no backward)
    levels: dict                  # paged layer -> {(side, bits): float32 [H, 2**bits]}: its calibrated levels, fitted
                                  # on the first window (`fit_layer_levels`)


RECORDING_IMPL, PREFILL_IMPL = "kvcal_recording", "kvcal_recording_prefill"
HEAD_SLICE = 32       # positions whose logits (and their gradient) exist at once: [32, vocab] float32
_SEEN: ContextVar[dict | None] = ContextVar("kvcal_recording", default=None)


class _GroupedAttention(torch.autograd.Function):
    """Softmax attention of a KV head's query heads stacked as rows against its keys, whose backward recomputes the
    probabilities from the saved log-sum-exp (as flash attention's does): the graph keeps q, k, v, the output and the
    log-sum-exp of every layer, never a [g·n, S] probability block nor a repeated copy of K/V.

    q [B, H, g, n, d]; k, v [B, H, S, d]; mask [B, 1, 1, n, S] float, added to the logits (or None) -> [B, H, g, n, d].
    score float32 [B, H, >= S] (or None): each key's probability, max over the group, summed over the n queries, is
    added into its first S columns (the significance `quality_model.held_masks` reads, from the forward's own block).
    coded (or None): (reads bool [n, S], sink list): the backward also appends to sink the gradients of k and v
    [B, H, S, d] through the reads marked alone (the queries that read a key coded), beside the full ones it returns.
    """

    @staticmethod
    def _probs(q, k, mask, scale, lse=None):
        B, H, g, n, d = q.shape
        # in place after the product: each [g·n, S] block allocated is one more hole in the heap
        logits = (q.reshape(B, H, g * n, d) @ k.transpose(-1, -2)).view(B, H, g, n, -1).mul_(scale)
        if mask is not None:
            logits.add_(mask)
        if lse is not None:
            return logits.sub_(lse).exp_(), lse
        top = logits.amax(-1, keepdim=True)                 # a query always sees its own key: finite
        p = logits.sub_(top).exp_()
        total = p.sum(-1, keepdim=True)
        return p.div_(total), top + total.log()

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, score, coded=None):
        p, lse = _GroupedAttention._probs(q, k, mask, scale)
        B, H, g, n, S = p.shape
        if score is not None:
            score[..., :S] += p.amax(2).sum(2)
        out = (p.view(B, H, g * n, S) @ v).view(B, H, g, n, -1)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.scale, ctx.coded = scale, coded
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        p, _ = _GroupedAttention._probs(q, k, mask, ctx.scale, lse)
        B, H, g, n, S = p.shape
        d_v = p.view(B, H, g * n, S).transpose(-1, -2) @ d_out.reshape(B, H, g * n, -1)
        reads = None if ctx.coded is None else ctx.coded[0].to(p.dtype).repeat(g, 1)             # [g·n, S]
        if reads is not None:
            d_v_coded = (p.view(B, H, g * n, S) * reads).transpose(-1, -2) @ d_out.reshape(B, H, g * n, -1)
        d_p = (d_out.reshape(B, H, g * n, -1) @ v.transpose(-1, -2)).view(B, H, g, n, S)
        d_s = p.mul_(d_p.sub_((d_out * out).sum(-1, keepdim=True))).mul_(ctx.scale).view(B, H, g * n, S)
        d_q = (d_s @ k).view(q.shape)
        d_k = d_s.transpose(-1, -2) @ q.reshape(B, H, g * n, -1)
        if reads is not None:
            ctx.coded[1].append(((d_s * reads).transpose(-1, -2) @ q.reshape(B, H, g * n, -1), d_v_coded))
        return d_q, d_k, d_v, None, None, None, None


def _recording_attention(module, query, key, value, attention_mask, *args, scaling=None, **kwargs):
    """transformers' attention-function signature (eager masks: a float mask [B, 1, n, S] added to the logits).
    query [B, Hq, n, d]; key, value [B, H, S, d]. Keeps each layer's query, key and value (with their graph) for the
    recording, and attends by `_GroupedAttention`, whose graph holds no [n, S] block, adding each key's attention into
    the layer's continuation score where the chunk keeps one."""
    chunk = _SEEN.get()
    chunk.kv[module.layer_idx] = (query, key, value)
    if getattr(getattr(module, "config", None), "attn_logit_softcapping", None):
        raise ValueError("the search's recording does not model attention logit soft-capping")
    B, Hq, n, d = query.shape
    H, S = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    mask = attention_mask[:, :, None, :, -S:] if attention_mask is not None else None
    coded = None
    if module.layer_idx in chunk.exact_from:        # key j is read coded by query i when j < exact_from[i]
        at = torch.arange(chunk.end - S, chunk.end, device=key.device)                           # positions
        reads = at[None, :] < chunk.exact_from[module.layer_idx][at[S - n:]][:, None]            # [n, S]
        coded = (reads, chunk.coded.setdefault(module.layer_idx, []))
    out = _GroupedAttention.apply(query.reshape(B, H, Hq // H, n, d), key, value, mask, scale,
                                  chunk.scores.get(module.layer_idx), coded)
    return out.reshape(B, Hq, n, -1).transpose(1, 2).contiguous(), None       # [B, n, Hq, d]


@dataclass
class _Chunk:
    """What `_recording_attention` keeps of a continuation chunk's forward."""

    kv: dict                      # layer -> (query, key, value) of this chunk, with their graph
    scores: dict                  # paged layer -> float32 [1, H, S]: each key's attention summed over the queries so
                                  # far (`_GroupedAttention`'s score)
    exact_from: dict = field(default_factory=dict)  # sliding layer -> long [positions]: the first key each query
                                                    # reads exact; its K/V gradients count the coded reads only
    coded: dict = field(default_factory=dict)   # sliding layer -> [(g_key, g_value) [1, H, S, d]], by the backward
    end: int = 0                                # the position after this forward's last query


def _prefill_attention(module, query, key, value, attention_mask, *args, scaling=None, **kwargs):
    """transformers' attention-function signature (sdpa masks). query [B, Hq, n, d]; key, value [B, H, n, d] of an
    unpadded prompt. A layer in the state's `scores` attends by the runtime's prefill, which also gives each key's
    significance [B, H, n] (kept there); any other (sliding-window) layer by SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvcal.runtime.backends.registry import select_backend

    scores = _SEEN.get()
    if module.layer_idx not in scores:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, scaling=scaling, **kwargs)
    B, Hq, n, d = query.shape
    H = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril_()[None].expand(B, n, n)
    out, score = select_backend("auto", str(query.device)).prefill(query.reshape(B, H, Hq // H, n, d), key, value,
                                                                    causal, scale)
    scores[module.layer_idx] = score
    trim_heap()               # the layer's [n, n] blocks, freed: the next layer's would not reuse them all
    return out.reshape(B, Hq, n, -1).transpose(1, 2).contiguous().to(query.dtype), None   # [B, n, Hq, d]


def _prefilling(model, scores: dict):
    """Within the block, `model` attends by `_prefill_attention`, which fills `scores` (layer -> significance)."""
    return attending_by(model, PREFILL_IMPL, _prefill_attention, "sdpa", _SEEN, scores)


def _recording(model, chunk: _Chunk):
    """Within the block, `model` attends by `_recording_attention`, which fills `chunk`."""
    return attending_by(model, RECORDING_IMPL, _recording_attention, "eager", _SEEN, chunk)


def record_search(model, prompt: torch.Tensor, continuation: torch.Tensor, served: ServedBases,
                  base: CompressionConfig, layer_types: list[str], head_dim: int, chunk: int | None = None,
                  on_window: Callable[[int, bool], None] | None = None,
                  prefill_dtype: torch.dtype | None = None) -> Recording:
    """Record every window (module docstring), one at a time so that one window's activations and float32 K/V are
    alive at once; `on_window(b, done)` as window b starts and ends. `base`: the settings the allocation changes bits
    of (window; no pruning, no FastGen: `quality_model`), at every threshold of `ALPHAS`. `prefill_dtype`: the
    prompts' prefill runs its matrix products in it (`fidelity.prefill_precision`), the continuations in the model's
    dtype. The model's parameters get no gradient (their requires_grad is restored)."""
    if base.tiering.alpha_low > 0 or base.fastgen is not None:
        raise ValueError("the quality model predicts tiers and windows, not pruning or FastGen: use base settings "
                         "with alpha_low = 0 and no FastGen")
    B, L, P = len(prompt), len(layer_types), prompt.shape[1]
    sliding = [t == "sliding_attention" for t in layer_types]
    H = served.rotation.shape[1]
    A = len(ALPHAS)
    costs = torch.zeros(L, H, 2, len(BITS), A, dtype=torch.float64)
    high_costs = torch.zeros(L, H, 2, len(HIGH), A, dtype=torch.float64)
    tokens, high_tokens = torch.zeros(L, A, dtype=torch.float64), torch.zeros(L, A, dtype=torch.float64)
    records = SpilledRecords()
    held_by_end: dict = {}
    levels: dict = {}
    ref = None
    window_size = getattr(model.config, "sliding_window", None) or prompt.shape[1] + continuation.shape[1]
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    positions = torch.arange(P + continuation.shape[1] - 1)                   # S of them
    exact_from = {i: first_exact(base, True, positions, P, window_size) for i in range(L) if sliding[i]}
    last_exact = [newest_exact(base, sliding[i], len(positions), P, window_size) for i in range(L)]   # `held_masks`
    try:
        for b in range(B):
            if on_window:
                on_window(b, False)
            window = _record_window(model, prompt[b:b + 1], continuation[b:b + 1], sliding, chunk, exact_from,
                                    prefill_dtype)
            trim_heap()
            S = window["S"]
            for layer in range(L):
                key, value, g_key, g_value = window["kv"][layer]
                held = held_masks(window["prefill_score"][layer], window["continuation_score"][layer],
                                  last_exact[layer], sliding[layer])                              # [A, H, S]
                high = torch.zeros_like(held)           # heavy hitters out of the window (no high tier: sliding)
                read_high = high                        # and what the scored queries read in the high tier's format
                if not sliding[layer]:
                    high[..., :max(S - base.tiering.window, 0)] = True
                    high &= ~held
                if not sliding[layer] and not base.exact_window:
                    # every new token is written to the high tier, so a query reads its window there: the tokens
                    # some scored query (positions P .. S - 1) sees in its window but not as its own
                    read_high = high.clone()
                    read_high[..., max(P - base.tiering.window + 1, 0):S - 1] = True
                # what the layer's format holds at the end: a sliding layer its window but the recent tokens, a
                # paged one its held tokens
                tokens[layer] += (min(S, window_size) - base.sliding_recent if sliding[layer]
                                  else held.double().mean(1).sum(-1)) / B
                high_tokens[layer] += high.double().mean(1).sum(-1) / B
                if b == 0 and not sliding[layer]:
                    levels[layer] = fit_layer_levels((key, value), (g_key, g_value), held[BASE_ALPHA], served, base,
                                                     layer, head_dim)
                add_layer_costs(costs[layer], high_costs[layer], layer, (key, value), (g_key, g_value), held,
                                read_high, served, base, sliding[layer], head_dim, levels.get(layer))
                if not sliding[layer]:
                    held_by_end.setdefault(layer, torch.zeros(len(ALPHAS), B, H, S, dtype=torch.bool))
                    held_by_end[layer][:, b] = held
            records.append(window["prompt"])
            if ref is None:
                ref = TopLogits.empty(B, *window["ref"].logp.shape[1:])
            ref[b:b + 1] = window["ref"]
            del window
            if on_window:
                on_window(b, True)
    finally:
        for p in params:
            p.requires_grad_(True)
    nbytes = torch.tensor([[[H * side_bytes(layer_format(base, sliding[layer], b, b), side, head_dim, base,
                                            sliding[layer]) for b in BITS] for side in SIDES]
                           for layer in range(L)], dtype=torch.float64)
    high_bytes = torch.tensor([[[H * side_bytes(TierFormat.parse(spec), side, head_dim, base, False)
                                 for spec in HIGH] for side in SIDES] for _ in range(L)], dtype=torch.float64)
    return Recording(prompt, continuation, records, ref, held_by_end,
                     FormatCosts(costs, nbytes, tokens, sliding, high_costs, high_bytes, high_tokens), levels)


class _HeldCollector:
    """A capture collector (kvcal.profile.capture) that turns each paged layer's continuation queries and keys into
    its held masks (`held_masks`) against the recorded prefill significance `scores` (layer -> [H, P])."""

    def __init__(self, scores: dict, window: int):
        self.scores, self.window, self.held = scores, window, {}

    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if layer in self.scores:
            self.held[layer] = held_masks(self.scores[layer], continuation_score(query, key), self.window, False)


class HeldTokens:
    """The tokens each paged layer holds in its allocated format, for B recorded prompts, from a capture of one
    forward of each window's continuation over its prompt (`capture`): the dense reference's forward serves
    (`DecodeProbe(on_reference=held.capture)`), so no forward runs for them alone.

        held = HeldTokens(model, base, layer_types, B)
        probe = DecodeProbe(model, bundle, prompt, continuation, on_reference=held.capture)
        held.masks        # paged layer -> bool [len(ALPHAS), B, H, P + M]
    """

    def __init__(self, model, base: CompressionConfig, layer_types: list[str], windows: int):
        self.model, self.window, self.windows = model, base.tiering.window, windows
        self.paged = [i for i, t in enumerate(layer_types) if t != "sliding_attention"]
        self.masks: dict = {}
        self.seen: set = set()

    @contextmanager
    def capture(self, b: int, records: dict):
        """The context window b's continuation runs in over its prompt's `records` (the runtime's recorded prefill:
        per layer key, value, significance [1, H, P], ...)."""
        from kvcal.profile.capture import capturing

        collector = _HeldCollector({i: records[i][2][0] for i in self.paged}, self.window)
        with capturing(self.model, collector):
            yield
        for layer, mask in collector.held.items():                                             # [A, H, S]
            self.masks.setdefault(layer, torch.zeros(mask.shape[0], self.windows, *mask.shape[1:],
                                                     dtype=torch.bool))[:, b] = mask
        self.seen.add(b)


def recorded_prompts(prompt: torch.Tensor, continuation: torch.Tensor, records: SpilledRecords | dict,
                     ref: TopLogits, held: HeldTokens, levels: dict) -> Recording:
    """A Recording of prompts [B, P] that the runtime recorded already (`KvcalCache.record_prompt`'s records, a
    window each in `records`, or the batch in one dict: per paged layer key, value [1, H, P, d], the prefill
    significance [1, H, P], ...), with their dense reference `ref`, continuations [B, M + 1] and the tokens each
    layer holds (`held`, captured while `ref` was made), for the coded probe on other text (no backward, so no
    costs); `levels` are the search recording's, which the allocation's formats decode with."""
    if held.seen != set(range(len(prompt))):
        raise ValueError(f"held tokens were captured for windows {sorted(held.seen)} of {len(prompt)}: pass "
                         "`on_reference=held.capture` to the DecodeProbe that recorded these prompts")
    if not isinstance(records, SpilledRecords):      # the whole batch in memory (a DecodeProbe of one window)
        records, batch = SpilledRecords(), records
        for b in range(len(prompt)):
            records.append({i: tuple(x[b:b + 1] if torch.is_tensor(x) else x for x in record)
                            for i, record in batch.items()})
    return Recording(prompt, continuation, records, ref, held.masks, None, levels)


class _InPlaceLayer(DynamicLayer):
    """A full-attention layer of the recording's cache whose continuation tokens are written in place into buffers
    of the whole window [1, H, S, d], where DynamicLayer's cat allocates every layer's K/V afresh for each chunk (and a
    fragmented heap keeps the old copies resident: hundreds of MB per chunk at 4k). `keys`/`values` are views of the
    tokens written so far; gradients reach the chunk's new tokens through the in-place copy."""

    @classmethod
    def adopt(cls, layer: DynamicLayer, total: int) -> None:
        """Turn a prefilled DynamicLayer into one with room for `total` tokens."""
        n = layer.keys.shape[-2]
        layer.__class__ = cls
        layer.buffers = []
        for x in (layer.keys, layer.values):
            buffer = x.new_empty(*x.shape[:-2], total, x.shape[-1])
            buffer[..., :n, :] = x
            layer.buffers.append(buffer)
        layer.length = n
        layer.keys, layer.values = (b[..., :n, :] for b in layer.buffers)

    def update(self, key_states, value_states, *args, **kwargs):
        lo, hi = self.length, self.length + key_states.shape[-2]
        for buffer, new in zip(self.buffers, (key_states, value_states)):
            buffer[..., lo:hi, :] = new
        self.length = hi
        self.keys, self.values = (b[..., :hi, :] for b in self.buffers)
        return self.keys, self.values

    def detach(self) -> None:
        """Drop the chunk's graph (the buffers keep their storage)."""
        self.buffers = [b.detach() for b in self.buffers]
        self.keys, self.values = (b[..., :self.length, :] for b in self.buffers)


def _add_gradient(total: torch.Tensor, lo: int, hi: int, grad: torch.Tensor) -> None:
    """A K/V tensor's gradient hook: add grad [1, H, hi - lo, d] into total[:, :, lo:hi]."""
    total[:, :, lo:hi] += grad.float()


def _sliced_loss_gradient(model, hidden: torch.Tensor, targets: torch.Tensor, refs: list) -> torch.Tensor:
    """dL/d(hidden) of the summed next-token loss L over final hidden states [1, n, D] with true next tokens targets
    [1, n], the head run `HEAD_SLICE` positions at a time; each slice's reference (TopLogits) is appended to `refs`."""
    d_hidden = torch.zeros_like(hidden)
    for s in range(0, hidden.shape[1], HEAD_SLICE):
        part = hidden[:, s:s + HEAD_SLICE].detach().requires_grad_(True)
        logits = head_logits(model, part)
        loss = torch.nn.functional.cross_entropy(logits[0], targets[0, s:s + HEAD_SLICE], reduction="sum")
        d_hidden[:, s:s + HEAD_SLICE] = torch.autograd.grad(loss, part)[0]
        refs.append(TopLogits.of(logits.detach(), targets[:, s:s + HEAD_SLICE]))
    return d_hidden


def _record_window(model, prompt: torch.Tensor, continuation: torch.Tensor, sliding: list[bool],
                   chunk: int | None = None, exact_from: dict | None = None,
                   prefill_dtype: torch.dtype | None = None) -> dict:
    """One window: prompt [1, P], continuation [1, M + 1], its continuation in one graph (`chunk`: cut into graphs of
    that many tokens, each detached from the ones before: module docstring). Returns S = P + M; per layer the K/V of
    every token it reads and their gradients ("kv": key, value, g_key, g_value float32 [1, H, S, d]; a sliding
    layer's tokens that no continuation query reads are zero in both), a paged layer's prefill significance
    ("prefill_score": [H, P]; a sliding layer's None), a paged layer's attention summed over the continuation's
    queries ("continuation_score": [H, S], as `quality_model.continuation_score` sums it; a sliding layer's zeros),
    the prompt's record ("prompt"); and the reference ("ref", TopLogits [1, M, k]). exact_from: sliding layer ->
    long [>= S], for each query position the first key it reads exact (`quality_model.first_exact`): that layer's
    K/V gradients count only the queries that read them coded."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    L = len(sliding)
    scores: dict = {i: None for i in range(L) if not sliding[i]}      # the layers whose significance counts
    # not inference_mode: the continuation's graph reads these tensors
    with torch.no_grad(), _prefilling(model, scores), prefill_precision(model, prefill_dtype):
        model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    dtype = next(model.parameters()).dtype
    for layer in cache.layers:           # the continuation runs in the model's dtype (`prefill_precision`)
        layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
    kept = {i: (layer.keys.half(), layer.values.half(), None) if not hasattr(layer, "cumulative_length")
            else (layer.keys.clone(), layer.values.clone(), layer.cumulative_length)
            for i, layer in enumerate(cache.layers)}
    P, M = prompt.shape[1], continuation.shape[1] - 1
    S = P + M
    for i, layer in enumerate(cache.layers):
        if kept[i][2] is None:
            _InPlaceLayer.adopt(layer, S)
    trim_heap()                             # the prefill's activations, freed
    grads: dict[int, list[torch.Tensor]] = {}       # per layer (g_key, g_value), and for a sliding layer (key, value)
    refs = []
    chunk_state = _Chunk({}, {i: torch.zeros(1, cache.layers[i].keys.shape[1], S) for i in range(L)
                              if kept[i][2] is None}, dict(exact_from or {}))
    seen = chunk_state.kv
    embed = model.get_input_embeddings()
    chunk = chunk or M
    for t in range(0, M, chunk):
        end = min(t + chunk, M)
        chunk_state.end = P + end
        with torch.enable_grad(), _recording(model, chunk_state):
            embeds = embed(continuation[:, t:end]).detach().requires_grad_(True)
            hidden = model.model(inputs_embeds=embeds, cache=cache, use_cache=True).last_hidden_state
            d_hidden = _sliced_loss_gradient(model, hidden, continuation[:, t + 1:end + 1], refs)
            for i in range(L):
                _, key, value = seen[i]
                n = key.shape[2]                                 # the tokens this chunk's queries read: the last n
                if i not in grads:
                    grads[i] = [key.new_zeros(*key.shape[:2], S, key.shape[3], dtype=torch.float32)
                                for _ in range(4 if kept[i][2] is not None else 2)]
                for side, x in enumerate((key, value)):
                    if i not in chunk_state.exact_from:         # (such a layer: its coded reads', below)
                        x.register_hook(functools.partial(_add_gradient, grads[i][side], P + end - n, P + end))
            # each layer's gradient is added into its sum as the backward reaches it, and freed: never every
            # layer's at once (the input embeddings are a leaf on every path, so the backward visits every K/V)
            torch.autograd.backward(hidden, d_hidden, inputs=[embeds])
        for i in range(L):
            if kept[i][2] is not None:       # a sliding layer's cache keeps a window: the tokens it read are kept here
                _, key, value = (x.detach() for x in seen[i])
                lo, hi = P + end - key.shape[2], P + end
                grads[i][2][:, :, lo:hi], grads[i][3][:, :, lo:hi] = key.float(), value.float()
                for g_key, g_value in chunk_state.coded.pop(i, []):
                    _add_gradient(grads[i][0], lo, hi, g_key)
                    _add_gradient(grads[i][1], lo, hi, g_value)
        seen.clear()
        for layer in cache.layers:           # the next chunk's gradient starts at the tokens it reads
            if isinstance(layer, _InPlaceLayer):
                layer.detach()
            else:
                layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
        del hidden, d_hidden, embeds
        trim_heap()          # each chunk frees hundreds of MB in pieces the heap would keep (kvcal.profile.heap)
    ref = TopLogits.cat(refs)
    kv = {i: (*grads[i][2:], *grads[i][:2]) if kept[i][2] is not None
          else (cache.layers[i].keys.float(), cache.layers[i].values.float(), *grads[i]) for i in range(L)}
    return {"S": S, "kv": kv, "prefill_score": {i: scores[i][0] if i in scores else None for i in range(L)},
            "continuation_score": {i: chunk_state.scores[i][0] if i in chunk_state.scores
                                   else torch.zeros(kv[i][0].shape[1], S) for i in range(L)},
            "prompt": kept, "ref": ref}
