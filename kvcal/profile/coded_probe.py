"""The coded probe: the end-to-end quality of an allocation, measured without the runtime's pages and policies.

A bisection probe has one question to answer: does the allocation of the quality model's frontier meet the target?
The runtime's own decode answers it too, but it steps Algorithm 1 and the page writes once per token, layer and
window, which costs minutes per point at 4k on two cores. This probe runs the model instead over the tokens as the
allocation would hold them, the way the quality model itself reasons (kvcal.profile.quality_model):

- the prompt's K/V are recorded once, densely, with the dense reference logits of the continuation, and with them
  which prompt tokens each layer holds in its allocated format (`held_mask`'s rule: out of the window and below
  the heavy-hitter threshold, seen by the continuation's queries);
- for each allocation, the continuation is teacher-forced in one forward pass (`chunk` tokens at a time) with an
  attention in which query i meets key j coded in layer l's format (the runtime's coding in the served bases:
  `coded_keys`, `coded_values`) when j is held and left the window before i, and exactly otherwise; a continuation
  token is held once it leaves the window; a sliding-window layer holds every token but the query's own.

What it leaves out is what the runtime decides on the fly: heavy hitters found during decode, the exact page
boundaries of tokens that age during the continuation. The confirmation that follows is the runtime's own stepwise
decode on evaluation text, so the chosen point is always measured as served.

    probe = CodedProbe(model, prompt, continuation, served, base, layer_types, head_dim)
    fid = probe.measure(costs, bits)          # a Fidelity, memory["ratio_to_fp16"] modelled (see `modelled_ratio`)
"""

from __future__ import annotations

import time
from contextvars import ContextVar

import torch

from kvcal.eval.fidelity import LogitScores, dense_cache
from kvcal.profile.quality_model import BITS, FormatCosts, coded_keys, coded_values, held_mask, layer_format
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.storage.bases import ServedBases
from kvcal.runtime.storage.layout import PageLayout

CODED_IMPL = "kvcal_coded_probe"
_STATE: ContextVar[_Coding | None] = ContextVar("kvcal_coded_probe", default=None)


class _Held:
    """A capture collector that keeps, per layer, which prompt tokens the layer holds coded: bool [B, H, P]."""

    def __init__(self, base: CompressionConfig, sliding: list[bool]):
        self.base, self.sliding = base, sliding
        self.held: dict[int, torch.Tensor] = {}

    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """query [B, Hq, M, d] of the continuation, key [B, H, S, d] (the cache's tokens, then the M new ones)."""
        M, prompt = query.shape[2], key.shape[2] - query.shape[2]
        # every prompt token leaves the window during a continuation longer than it; what stays is the heavy hitters
        # by the continuation's attention (quality_model.held_mask, which reads the scored queries as the last M of
        # a full-length query), one window at a time
        full = torch.cat([query.new_zeros(*query.shape[:2], prompt, query.shape[3]), query], dim=2)
        self.held[layer] = torch.stack([held_mask(full[b:b + 1], key[b:b + 1], self.base, M,
                                                   self.sliding[layer])[:, :prompt] for b in range(key.shape[0])])


class _Coding:
    """One allocation's coding, applied by `_coded_attention` layer by layer."""

    def __init__(self, probe: CodedProbe, bits: torch.Tensor):
        self.probe, self.bits = probe, bits

    def coded_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor, held: torch.Tensor):
        """key, value [B, H, S, d] (what the layer's cache shows this forward) -> the same coded as layer `layer`'s
        format holds them, every token in `held` [B, H, S] (`held_tokens`; the caller masks which query sees which);
        keys per channel over pages of held tokens in position order, as the low tier fills its pages."""
        p, sliding = self.probe, self.probe.sliding[layer]
        fmt = layer_format(p.base, sliding, int(self.bits[layer, 0]), int(self.bits[layer, 1]))
        rot, qrot = p.served.rotation[layer], p.served.query_rotation[layer]           # [H, d, d]
        basis = p.served.basis[layer]
        B, H, S, d = key.shape
        page = PageLayout.build(fmt, d, d, p.base.page_size(d), p.base.low_tracked and not sliding).tokens
        k_out, v_out = key.float().clone(), value.float().clone()
        for b in range(B):
            for h in range(H):
                sel = held[b, h]
                if not bool(sel.any()):
                    continue
                ks = key[b, h, sel].float() @ rot[h]
                vs = value[b, h, sel].float() @ basis[h]
                k_out[b, h, sel] = coded_keys(ks[None], fmt, page)[0] @ qrot[h].T
                v_out[b, h, sel] = coded_values(vs[None], fmt)[0] @ basis[h].T
        return k_out.to(key.dtype), v_out.to(value.dtype)

    def held_tokens(self, layer: int, B: int, H: int, S: int, window: int) -> torch.Tensor:
        """bool [B, H, S]: a sliding layer's every token; a paged layer's held prompt tokens (recorded) and the
        continuation tokens out of the window at the last query."""
        p = self.probe
        if p.sliding[layer]:
            return torch.ones(B, H, S, dtype=torch.bool)
        prompt = p.held[layer]
        rest = torch.zeros(B, H, S - prompt.shape[-1], dtype=torch.bool)
        rest[..., :max(S - prompt.shape[-1] - window, 0)] = True
        return torch.cat([prompt, rest], dim=-1)


def _coded_attention(module, query, key, value, attention_mask, *args, scaling=None, **kwargs):
    """transformers' attention-function signature (eager masks: a float mask [B, 1, n, S] added to the logits).
    query [B, Hq, n, d]; key, value [B, H, S, d], the last n of them the queries' own tokens. Query i meets key j
    coded when j is held and out of the window at i (j <= i - window), in a sliding layer when j is older than i."""
    state = _STATE.get()
    layer = module.layer_idx
    B, Hq, n, d = query.shape
    H, S = key.shape[1], key.shape[2]
    sliding = state.probe.sliding[layer]
    window = 1 if sliding else state.probe.base.tiering.window
    held = state.held_tokens(layer, B, H, S, window)                                      # [B, H, S]
    kc, vc = state.coded_kv(layer, key, value, held)
    g = Hq // H
    q = query.float().view(B, H, g, n, d)
    # keys before `cut` are out of the window for every query: one mixed copy serves them all; only the band after
    # it (window + n keys) needs a choice per query
    cut = min(max(S - n - window + 1, 0), S)
    k_bulk = torch.where(held[..., :cut, None], kc[:, :, :cut], key[:, :, :cut]).float()        # [B, H, cut, d]
    v_bulk = torch.where(held[..., :cut, None], vc[:, :, :cut], value[:, :, :cut]).float()
    qpos = torch.arange(n) + S - n
    aged = torch.arange(cut, S)[None, :] <= qpos[:, None] - window                        # [n, S - cut]
    coded = held[:, :, None, None, cut:] & aged                                           # [B, H, 1, n, S - cut]
    k_band, kc_band = (t[:, :, None, cut:].float() for t in (key, kc))
    v_band, vc_band = (t[:, :, None, cut:].float() for t in (value, vc))
    scale = scaling if scaling is not None else d ** -0.5
    mask = attention_mask[:, :, None, :, -S:].float() if attention_mask is not None else None   # [B, 1, 1, n, S]
    band = torch.where(coded, q @ kc_band.transpose(-1, -2), q @ k_band.transpose(-1, -2)) * scale
    if mask is not None:
        band = band + mask[..., cut:]
    if cut and (mask is None or not bool(mask[..., :cut].any())):
        # every query sees every bulk key: flash attention over the bulk (queries of a group stacked, no mask), then
        # the band merged in by the two parts' log-sum-exp, so no [n, S] probability block is ever made
        out_bulk, lse_bulk = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.reshape(B, H, g * n, d), k_bulk, v_bulk, 0.0, False, scale=scale)[:2]
        out_bulk, lse_bulk = out_bulk.view(B, H, g, n, d), lse_bulk.view(B, H, g, n, 1)
        lse_band = band.logsumexp(-1, keepdim=True)
        p = (band - lse_band).exp()
        out_band = (p * coded) @ vc_band + (p * ~coded) @ v_band
        lse = torch.logaddexp(lse_bulk, lse_band)
        out = out_bulk * (lse_bulk - lse).exp() + out_band * (lse_band - lse).exp()      # [B, H, g, n, d]
    else:
        bulk = q @ k_bulk[:, :, None].transpose(-1, -2) * scale
        if mask is not None:
            bulk = bulk + mask[..., :cut]
        probs = torch.cat([bulk, band], dim=-1).softmax(-1)                                # [B, H, g, n, S]
        p = probs[..., cut:]
        out = probs[..., :cut] @ v_bulk[:, :, None] + (p * coded) @ vc_band + (p * ~coded) @ v_band
    return out.view(B, Hq, n, -1).transpose(1, 2).contiguous().to(query.dtype), None       # [B, n, Hq, d]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(CODED_IMPL, _coded_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CODED_IMPL, eager_mask)


class CodedProbe:
    """Quality of allocations (module docstring) on fixed windows: prompt [B, P], continuation [B, M + 1]."""

    @torch.inference_mode()
    def __init__(self, model, prompt: torch.Tensor, continuation: torch.Tensor, served: ServedBases,
                 base: CompressionConfig, layer_types: list[str], head_dim: int, chunk: int = 64):
        from transformers import DynamicCache

        from kvcal.profile.capture import capturing

        self.model, self.prompt, self.continuation = model, prompt, continuation
        self.served, self.base, self.head_dim, self.chunk = served, base, head_dim, chunk
        self.sliding = [t == "sliding_attention" for t in layer_types]
        M, B = continuation.shape[1] - 1, len(prompt)
        self.ref, self.held, self.records = None, {}, {}
        for b in range(B):          # a window at a time, into tensors of the whole batch: one window's activations
            cache = DynamicCache(config=model.config)
            model(input_ids=prompt[b:b + 1], cache=cache, use_cache=True, logits_to_keep=1)
            for i, layer in enumerate(cache.layers):
                if b == 0:
                    self.records[i] = (layer.keys.new_empty(B, *layer.keys.shape[1:]),
                                       layer.values.new_empty(B, *layer.values.shape[1:]),
                                       getattr(layer, "cumulative_length", None))
                self.records[i][0][b], self.records[i][1][b] = layer.keys[0], layer.values[0]
            keep = _Held(base, self.sliding)
            with capturing(model, keep):                 # the dense reference and the held tokens, in one pass
                ref = model(input_ids=continuation[b:b + 1, :M], cache=cache, use_cache=True).logits.float()
            if b == 0:
                self.ref = ref.new_empty(B, *ref.shape[1:])
                self.held = {i: h.new_empty(B, *h.shape[1:]) for i, h in keep.held.items()}
            self.ref[b] = ref[0]
            for i, h in keep.held.items():
                self.held[i][b] = h[0]
            del cache, ref

    def modelled_ratio(self, costs: FormatCosts, bits: torch.Tensor) -> float:
        """Bytes the allocation holds after the continuation, against fp16: each layer's held tokens at its format's
        bytes per token (codes and their scale/zero pairs, `FormatCosts.bytes`, summed over KV heads), every other
        token at 16 bits. Pages' slack and the runtime's fixed allowance are not in it: the confirmation measures
        those."""
        S = self.prompt.shape[1] + self.continuation.shape[1] - 1
        H, d = self.served.rotation.shape[1], self.head_dim
        per_token = costs.bytes.gather(-1, FormatCosts.index(bits)[..., None])[..., 0]          # [L, 2]
        held = torch.tensor([self._held_at_end(layer, S) for layer in range(len(self.sliding))],
                            dtype=torch.float64)                                               # [L] per KV head
        dense_token = 2 * 2 * H * d                                                            # K and V, fp16
        total = (per_token.sum(-1) * held + (S - held) * dense_token).sum()
        return float(total / (len(self.sliding) * S * dense_token))

    def _held_at_end(self, layer: int, S: int) -> float:
        """Tokens per KV head (mean over heads and windows) a layer holds coded after the continuation."""
        if self.sliding[layer]:
            return float(S)
        M = self.continuation.shape[1] - 1
        return float(self.held[layer].double().sum(-1).mean()) + max(M - self.base.tiering.window, 0)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's head over hidden [B, c, D] -> float32 logits (with the final soft-capping some models have)."""
        logits = self.model.get_output_embeddings()(hidden).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.inference_mode()
    def measure(self, costs: FormatCosts, bits: torch.Tensor):
        """bits long [L, 2] (K, V bits per layer, entries of BITS) -> a Fidelity of the continuation through the
        coded K/V; memory["ratio_to_fp16"] from `modelled_ratio`."""
        if not set(bits.unique().tolist()) <= set(BITS):
            raise ValueError(f"bits must be entries of {BITS}")
        _register()
        previous = self.model.config._attn_implementation
        cache, target = dense_cache(self.model, self.records, keep=False), self.continuation[:, 1:]
        M = target.shape[1]
        t0 = time.perf_counter()
        token = _STATE.set(_Coding(self, bits))
        self.model.set_attn_implementation(CODED_IMPL)
        try:
            # the whole continuation in one forward: a query sees each key coded or exact by its age, so splitting
            # it would change nothing but the work (each forward would code the layer again)
            hidden = self.model.model(input_ids=self.continuation[:, :M], cache=cache,
                                      use_cache=True).last_hidden_state
        finally:
            self.model.set_attn_implementation(previous)
            _STATE.reset(token)
        scores = LogitScores(target.shape[0])
        for t in range(0, M, self.chunk):          # the head a few positions at a time: no [B, M, vocab] copy
            scores.add(self.ref[:, t:t + self.chunk], self._logits(hidden[:, t:t + self.chunk]),
                       target[:, t:t + self.chunk])
        fid = scores.fidelity(self.prompt.shape[1], time.perf_counter() - t0)
        fid.memory = {"ratio_to_fp16": self.modelled_ratio(costs, bits), "modelled": True}
        return fid
