"""The coded probe: the end-to-end quality of an allocation, measured without the runtime's pages and policies.

A bisection probe has one question to answer: does the allocation of the quality model's frontier meet the target?
The runtime's own decode answers it too, but it steps Algorithm 1 and the page writes once per token, layer and
window, which costs minutes per point at 4k on two cores. This probe runs the model instead over the tokens as the
allocation would hold them, the way the quality model itself reasons (kvcal.profile.quality_model):

- the prompt's K/V, the dense reference of the continuation and which prompt tokens each layer holds in its
  allocated format at each heavy-hitter threshold (`held_masks`: out of the window and below the threshold, by the
  runtime's rule) come from the search's recording (kvcal.profile.recording);
- for each allocation, the continuation is teacher-forced in one forward pass (`chunk` tokens at a time) with an
  attention in which query i meets key j coded in layer l's format (the runtime's coding in the served bases:
  `coded_keys`, `coded_values`) when j is held (prompt and continuation tokens alike, by the recorded rule) and left
  the window before i; exactly when j is in i's window and the settings hold the window exact
  (`CompressionConfig.exact_window`), else in the high tier's format (the runtime then writes every new token to its
  high tier: with an 8-bit high tier the window is read at 8 bits too); exactly when it is i's own; a sliding-window
  layer holds every token but the query's own, its `sliding_recent` newest and the block still filling of per-channel
  keys (`quality_model.first_exact`).

What it leaves out is what the runtime decides on the fly: heavy hitters found during decode, the exact page
boundaries of tokens that age during the continuation. The confirmation that follows is the runtime's own stepwise
decode on evaluation text, so the chosen point is always measured as served.

    probe = CodedProbe(model, recording, served, base, layer_types, head_dim)
    fid = probe.measure(costs, allocation)    # a Fidelity, memory["ratio_to_fp16"] modelled (see `modelled_ratio`)
"""

from __future__ import annotations

import time
from contextvars import ContextVar

import torch

from kvcal.eval.fidelity import LogitScores, dense_cache, head_logits
from kvcal.profile.allocate import Allocation
from kvcal.profile.capture import attending_by
from kvcal.profile.quality_model import (
    BITS,
    HIGH,
    FormatCosts,
    coded_keys,
    coded_values,
    first_exact,
    key_block,
    layer_format,
    newest_exact,
)
from kvcal.profile.recording import Recording
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.storage.bases import ServedBases
from kvcal.runtime.storage.layout import RAW_BITS, TierFormat

CODED_IMPL = "kvcal_coded_probe"
_STATE: ContextVar[_Coding | None] = ContextVar("kvcal_coded_probe", default=None)


class _Coding:
    """One allocation's coding, applied by `_coded_attention` layer by layer."""

    def __init__(self, probe: CodedProbe, allocation: Allocation, rows: slice):
        self.probe, self.bits, self.rows = probe, allocation.bits, rows          # rows: the windows of this forward
        self.high, self.alpha = TierFormat.parse(HIGH[allocation.high]), allocation.alpha

    def coded_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor, low: torch.Tensor, high: torch.Tensor):
        """key, value [B, H, S, d] (what the layer's cache shows this forward) -> the same coded as layer `layer`
        holds them: every token in `low` [B, H, S] in its low-tier (or sliding) format, keys per channel over pages of
        low tokens in position order as the low tier fills its pages (a sliding layer's: over blocks of its tokens);
        every token in `high` [B, H, S] in the high tier's format, per token (`held_tokens`; the caller masks which
        query sees which)."""
        p, sliding = self.probe, self.probe.sliding[layer]
        rot, qrot = p.served.rotation[layer], p.served.query_rotation[layer]           # [H, d, d]
        basis = p.served.basis[layer]
        B, H, S, d = key.shape
        k_out, v_out = key.float().clone(), value.float().clone()
        levels = p.recording.levels.get(layer, {})
        for h in range(H):
            fmt = layer_format(p.base, sliding, int(self.bits[layer, h, 0]), int(self.bits[layer, h, 1]))
            page = key_block(p.base, fmt, d, sliding)
            for b in range(B):
                k_lut, v_lut = (None if t is None else t[h:h + 1] for t in (levels.get(("k", fmt.k_bits)),
                                                                              levels.get(("v", fmt.v_bits))))
                for sel, tier, tokens, luts in ((low[b, h], fmt, page, (k_lut, v_lut)),
                                                (high[b, h], self.high, 1, (None, None))):
                    if not bool(sel.any()):
                        continue
                    ks = key[b, h, sel].float() @ rot[h]
                    vs = value[b, h, sel].float() @ basis[h]
                    k_out[b, h, sel] = coded_keys(ks[None], tier, tokens, luts[0])[0] @ qrot[h].T
                    v_out[b, h, sel] = coded_values(vs[None], tier, luts[1])[0] @ basis[h].T
        return k_out.to(key.dtype), v_out.to(value.dtype)

    def held_tokens(self, layer: int, B: int, H: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(low, high) bool [B, H, S]: a sliding layer's every token in low; a paged layer's held tokens (recorded at
        the allocation's threshold) in low, its others in high when the high tier is coded (not raw; the caller codes
        a token only once it is out of the window)."""
        p = self.probe
        if p.sliding[layer]:
            return torch.ones(B, H, S, dtype=torch.bool), torch.zeros(B, H, S, dtype=torch.bool)
        low = p.held[layer][self.alpha, self.rows, :, :S]
        return low, ~low if self.high.k_bits not in RAW_BITS else torch.zeros_like(low)


def _coded_attention(module, query, key, value, attention_mask, *args, scaling=None, **kwargs):
    """transformers' attention-function signature (eager masks: a float mask [B, 1, n, S] added to the logits).
    query [B, Hq, n, d]; key, value [B, H, S, d], the last n of them the queries' own tokens. As the runtime serves
    them: query i meets key j coded in its held format when j is held and out of the window at i (j <= i - window);
    in a paged layer with a coded high tier whose window is not held exact, every other key older than i in the high
    tier's format (the runtime writes each new token to its high tier, so the window is read there too); in a
    sliding layer, every key before its recent tokens and the block still filling coded (`first_exact`). Its own key,
    and the window's otherwise, exact."""
    state = _STATE.get()
    layer = module.layer_idx
    B, Hq, n, d = query.shape
    H, S = key.shape[1], key.shape[2]
    sliding, prompt = state.probe.sliding[layer], state.probe.prompt.shape[1]
    offset = prompt + n - S                                             # the position of key 0
    qpos = torch.arange(n) + S - n
    exact_from = first_exact(state.probe.base, sliding, qpos + offset, prompt, state.probe.sliding_window) - offset
    low, high = state.held_tokens(layer, B, H, S)                                         # [B, H, S]
    kc, vc = state.coded_kv(layer, key, value, low, high)
    held = low | high                                                                       # coded once aged
    g = Hq // H
    q = query.float().view(B, H, g, n, d)
    # keys before `cut` are out of the window for every query: one mixed copy serves them all; only the band after
    # it (about window + n keys) needs a choice per query
    cut = min(max(int(exact_from.min()), 0), S)
    k_bulk = torch.where(held[..., :cut, None], kc[:, :, :cut], key[:, :, :cut]).float()        # [B, H, cut, d]
    v_bulk = torch.where(held[..., :cut, None], vc[:, :, :cut], value[:, :, :cut]).float()
    kpos = torch.arange(cut, S)[None, :]
    aged = kpos < exact_from[:, None]                                                     # [n, S - cut]
    coded = held[:, :, None, None, cut:] & aged                                           # [B, H, 1, n, S - cut]
    k_band, kc_band = (t[:, :, None, cut:].float() for t in (key, kc))
    v_band, vc_band = (t[:, :, None, cut:].float() for t in (value, vc))
    scale = scaling if scaling is not None else d ** -0.5
    band = torch.where(coded, q @ kc_band.transpose(-1, -2), q @ k_band.transpose(-1, -2))
    exact = ~coded
    in_high = None
    if not sliding and state.high.k_bits not in RAW_BITS and not state.probe.base.exact_window:
        in_high = (kpos < qpos[:, None]) & ~aged                                          # [n, S - cut]
        everyone = torch.ones(B, H, S - cut, dtype=torch.bool)
        kh, vh = (t[:, :, None].float() for t in state.coded_kv(layer, key[:, :, cut:], value[:, :, cut:],
                                                                 ~everyone, everyone))
        band = torch.where(in_high, q @ kh.transpose(-1, -2), band)
        exact = exact & ~in_high
    band = band * scale
    mask = attention_mask[:, :, None, :, -S:].float() if attention_mask is not None else None   # [B, 1, 1, n, S]
    if mask is not None:
        band = band + mask[..., cut:]

    def band_values(p: torch.Tensor) -> torch.Tensor:
        """p [B, H, g, n, S - cut]: the band's probabilities -> their weighted values, each as the query reads it."""
        out = (p * coded) @ vc_band + (p * exact) @ v_band
        return out if in_high is None else out + (p * in_high) @ vh

    if cut and (mask is None or not bool(mask[..., :cut].any())):
        # every query sees every bulk key: flash attention over the bulk (queries of a group stacked, no mask), then
        # the band merged in by the two parts' log-sum-exp, so no [n, S] probability block is ever made
        out_bulk, lse_bulk = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.reshape(B, H, g * n, d), k_bulk, v_bulk, 0.0, False, scale=scale)[:2]
        out_bulk, lse_bulk = out_bulk.view(B, H, g, n, d), lse_bulk.view(B, H, g, n, 1)
        lse_band = band.logsumexp(-1, keepdim=True)
        out_band = band_values((band - lse_band).exp())
        lse = torch.logaddexp(lse_bulk, lse_band)
        out = out_bulk * (lse_bulk - lse).exp() + out_band * (lse_band - lse).exp()      # [B, H, g, n, d]
    else:
        bulk = q @ k_bulk[:, :, None].transpose(-1, -2) * scale
        if mask is not None:
            bulk = bulk + mask[..., :cut]
        probs = torch.cat([bulk, band], dim=-1).softmax(-1)                                # [B, H, g, n, S]
        out = probs[..., :cut] @ v_bulk[:, :, None] + band_values(probs[..., cut:])
    return out.view(B, Hq, n, -1).transpose(1, 2).contiguous().to(query.dtype), None       # [B, n, Hq, d]


class CodedProbe:
    """Quality of allocations (module docstring) on the windows of a search recording (prompt [B, P], continuation
    [B, M + 1])."""

    def __init__(self, model, recording: Recording, served: ServedBases, base: CompressionConfig,
                 layer_types: list[str], head_dim: int, chunk: int = 64):
        self.model, self.recording = model, recording
        self.prompt, self.continuation = recording.prompt, recording.continuation
        self.records, self.ref, self.held = recording.records, recording.ref, recording.held
        self.served, self.base, self.head_dim, self.chunk = served, base, head_dim, chunk
        self.sliding = [t == "sliding_attention" for t in layer_types]
        self.sliding_window = getattr(model.config, "sliding_window", None)

    def modelled_ratio(self, costs: FormatCosts, allocation: Allocation) -> float:
        """Bytes the allocation holds after the continuation, against an fp16 cache of the same tokens (as the
        runtime's `memory()` counts them): each layer's held tokens at its format's bytes per token (codes and their
        scale/zero pairs, `FormatCosts.bytes`, summed over KV heads), a paged layer's other tokens out of the window
        at the high tier's (`FormatCosts.high_bytes`), every other token at 16 bits. A sliding layer keeps only its
        window, so its fp16 share is the window's; its newest tokens (the block still filling, the recent ones) wait
        unquantized, as many as the last query reads exact, and its per-channel keys are held in whole blocks.
        Pages' slack and the runtime's fixed allowance are not in it: the confirmation measures those."""
        S, P = self.prompt.shape[1] + self.continuation.shape[1] - 1, self.prompt.shape[1]
        H, d = self.served.rotation.shape[1], self.head_dim
        bits, alpha = allocation.bits, allocation.alpha
        per_side = costs.head_bytes().gather(-1, FormatCosts.index(bits)[..., None])[..., 0].sum(1)   # [L, 2]
        per_high = costs.high_bytes[..., allocation.high].sum(-1)                                  # [L]
        window = min(S, self.sliding_window or S)
        waiting = newest_exact(self.base, True, S, P, self.sliding_window) if any(self.sliding) else 0
        held = torch.zeros(len(self.sliding), 2, dtype=torch.float64)              # [L, K|V] tokens per KV head
        for i, s in enumerate(self.sliding):
            if not s:
                held[i] = float(self.held[i][alpha].double().sum(-1).mean())
                continue
            coded = window - waiting
            fmt = layer_format(self.base, True, int(bits[i, 0, 0]), int(bits[i, 0, 1]))
            block = key_block(self.base, fmt, d, True) if fmt.k_mode == "channel" else 1
            held[i] = torch.tensor([-(-coded // block) * block, coded], dtype=torch.float64)
        kept = torch.tensor([float(window if s else S) for s in self.sliding], dtype=torch.float64)   # [L]
        aged = max(S - self.base.tiering.window, 0)
        in_high = torch.tensor([0.0 if s else aged - float(held[i, 1]) for i, s in enumerate(self.sliding)],
                               dtype=torch.float64)
        dense_token = 2 * 2 * H * d                                                            # K and V, fp16
        total = ((per_side * held).sum(1) + per_high * in_high + (kept - held[:, 1] - in_high) * dense_token).sum()
        return float(total / (kept.sum() * dense_token))

    @torch.inference_mode()
    def measure(self, costs: FormatCosts, allocation: Allocation):
        """An allocation (bits per layer and KV head, entries of BITS; high tier; heavy-hitter threshold) -> a
        Fidelity of the continuation through the coded K/V; memory["ratio_to_fp16"] from `modelled_ratio`. A window
        at a time: one window's float32 K/V and coded copies are alive at once."""
        if not set(allocation.bits.unique().tolist()) <= set(BITS):
            raise ValueError(f"bits must be entries of {BITS}")
        target = self.continuation[:, 1:]
        M = target.shape[1]
        scores = LogitScores(target.shape[0])
        t0 = time.perf_counter()
        for b in range(len(self.prompt)):
            rows = slice(b, b + 1)
            cache = dense_cache(self.model, self.records.window(b), keep=False)
            # the whole continuation in one forward: a query sees each key coded or exact by its age, so splitting
            # it would change nothing but the work (each forward would code the layer again)
            with attending_by(self.model, CODED_IMPL, _coded_attention, "eager", _STATE,
                              _Coding(self, allocation, rows)):
                hidden = self.model.model(input_ids=self.continuation[rows, :M], cache=cache,
                                          use_cache=True).last_hidden_state
            for t in range(0, M, self.chunk):          # the head a few positions at a time: no [M, vocab] copy
                scores.add(self.ref[rows, t:t + self.chunk], head_logits(self.model, hidden[:, t:t + self.chunk]),
                           target[rows, t:t + self.chunk], rows)
            del cache, hidden
        fid = scores.fidelity(self.prompt.shape[1], time.perf_counter() - t0)
        fid.memory = {"ratio_to_fp16": self.modelled_ratio(costs, allocation), "modelled": True}
        return fid
