"""The compressed KV cache of one batch, independent of any framework: where the bundle, the token policies, the
store and the attention backend meet.

    kv = CompressedKV.from_bundle(bundle, CompressionConfig(), batch=2, sliding=[False] * L)
    out = kv.forward(layer, query, key, value, pad, scale)    # prefill on the first call of a layer, decode after

Per layer, `forward` takes post-RoPE query [B, Hq, n, d], key and value [B, H, n, d] and returns the attention output
[B, Hq, n, d]. The first call of a layer is the prefill: attention on the uncompressed K/V (the token policies'
scores come from it), then each policy tiers the prompt in turn (`CachePolicy.prefill`) and it is written compressed.
Later calls attend over the compressed store plus the new tokens, write the new tokens at high precision, and run
each policy's decode step per new token (DiffKV's Algorithm 1, FastGen's frozen per-head pattern). With
`exact_window`, the newest tokens stay exact outside the pages and enter them as they leave (`exact_window.py`).

Raw phase: a sequence of at most `raw_tokens` tokens is held raw, K/V as the model made them (counted at 16 bits, as
an fp16 cache holds them) with each token's significance, and attended exactly; the prompt is not yet written to the
store. When the cache grows past `raw_tokens`, the raw tokens are written as if they were a prompt of that length
(`write_prefill`: the token policies tier them by the significance gathered so far) and decoding goes on compressed.
`auto_raw_tokens` picks the shortest raw phase after which the pages cost no more than fp16 (page layouts, not data):
partly filled pages and the tokens that wait at the high tier make short sequences dearer than fp16 in pages.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvcal.runtime.backends.base import _softmax_attend
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.exact_window import ExactWindows, Tokens
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies import cache_policies
from kvcal.runtime.policies.cache_policy import CachePolicy, Prompt, PromptAttention
from kvcal.runtime.policies.diffkv import TIER_HIGH, TIER_LOW, TIER_PRUNED, mean_score
from kvcal.runtime.storage.bases import served_bases
from kvcal.runtime.storage.pages import HIGH, LOW
from kvcal.runtime.storage.store import CompressedStore


@dataclass
class RawLayer:
    """One layer's tokens in the raw phase: keys, values [B, H, n, d] as the model made them, real bool [B, n]
    (False = padding), score float32 [B, H, >= n] each token's significance so far (a buffer of `raw_tokens` slots,
    allocated once: a fixed amount, `CompressedKV.raw_score_bytes`)."""

    keys: torch.Tensor
    values: torch.Tensor
    real: torch.Tensor
    score: torch.Tensor


def per_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, H, m, d] float32, w [H, d, r] -> x·w per head [B, H, m, r].

    One bmm, not einsum: on decode-sized operands einsum's reshapes and copies cost more than the product, and they
    open OpenMP regions whose threads arrive late on a loaded machine (docs/runtime.md, CPU backend)."""
    B, H, m, d = x.shape
    if B == 1:
        return torch.bmm(x[0], w)[None]
    return torch.bmm(x.transpose(0, 1).reshape(H, B * m, d), w).view(H, B, m, -1).transpose(0, 1)


@contextmanager
def torch_threads(n: int | None):
    """torch runs on `n` intra-op threads inside the block (the fused cpu decode sizes its OpenMP region from
    `torch.get_num_threads()`), and on the host's setting again after it; None: the host's setting throughout."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class CompressedKV:
    """Compressed KV state of one batch of sequences across all layers (see module docstring)."""

    def __init__(self, rotation: torch.Tensor, basis: torch.Tensor, rank_k: torch.Tensor, rank_v: torch.Tensor,
                 config: CompressionConfig, *, batch: int, sliding: list[bool], device="cpu",
                 raw16: torch.dtype = torch.float16, token_classes: tuple | None = None,
                 key_ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
                 smoothing: torch.Tensor | None = None, raw_tokens: int | None = 0,
                 serve: ServeOptions = ServeOptions(), levels: dict[str, torch.Tensor] | None = None):
        """rotation, basis: [L, H, d, d]; rank_k, rank_v: [L, H] int. token_classes: (special_ids, punct_ids) of the
        tokenizer (fastgen.token_classes), for FastGen; None: no token is special or punctuation. key_ranges: (low,
        high) [L, H, d] float32, per-channel clip ranges of K @ rotation (bundle `k.range_low/high`), for static
        keys. smoothing: [L, H, d] float32 (bundle `qk.smoothing`), for `config.smooth`. raw_tokens: the raw phase
        (module docstring): 0 = none, None = `auto_raw_tokens()`. serve: how this process serves the cache (attention
        backend, page size, threads), resolved here once. levels: bundle tensors by name (its extras),
        of which formats with calibrated sides read `levels.k.{bits}`, `levels.v.{bits}` (float32 [L, H, 2**bits])."""
        L, H, d, _ = rotation.shape
        if beyond := [(layer, h) for layer, h, _ in config.low_heads if layer >= L or h >= H]:
            raise ValueError(f"the settings give KV head {beyond[0][1]} of layer {beyond[0][0]} a low-tier format, but "
                             f"the model has {L} layers of {H} KV heads: the bundle belongs to another model")
        if config.static_keys and not config.rotate:
            raise ValueError("static key ranges are calibrated in the bundle's rotated basis; serve static keys "
                             "(K…s tiers) with `rotate=True`")
        self.config, self.batch, self.device = config, batch, torch.device(device)
        self.layers = [i for i in range(L) if not sliding[i]]
        rank_k, rank_v, rotation, basis, query_rotation = served_bases(rotation, basis, rank_k, rank_v, config,
                                                                       smoothing)
        self.rank_k, self.rank_v = rank_k.clone(), rank_v.clone()
        # cut to the layer's largest rank: columns beyond a head's own rank are 0, so padded coordinates are 0.
        # Contiguous [H, d, r] (and the basis transposed, [H, r_v, d]) so that each projection is one bmm
        self.rotation = {layer: rotation[layer, :, :, :int(rank_k[layer].max())].to(self.device).contiguous()
                         for layer in self.layers}
        self.query_rotation = self.rotation if not config.smooth else {
            layer: query_rotation[layer, :, :, :int(rank_k[layer].max())].to(self.device).contiguous()
            for layer in self.layers}
        self.basis = {layer: basis[layer, :, :, :int(rank_v[layer].max())].to(self.device).contiguous()
                      for layer in self.layers}
        self.basis_t = {layer: b.transpose(1, 2).contiguous() for layer, b in self.basis.items()}
        self.serve = serve
        self.backend = serve.resolve(self.device, config.formats, d)
        self.store = CompressedStore(rank_k, rank_v, self.layers, high=config.high, low=config.low, head_dim=d,
                                     low_of=config.low_of, batch=batch, device=self.device,
                                     page_bytes=config.page_size(d, serve.page_bytes), raw16=raw16,
                                     writer=self.backend if self.backend.writes_cache else None,
                                     key_ranges=key_ranges, low_tracked=config.low_tracked, levels=levels)
        # each layer's newest tokens at 16 bits outside the pages (kvcal.runtime.exact_window); None: in the pages
        self.windows = ExactWindows(config.tiering.window, raw16) if config.exact_window else None
        self.length = {layer: 0 for layer in self.layers}          # cache length (padding included)
        self.n_pad = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.recorder: dict | None = None   # set to {} to keep each layer's prefill inputs instead of storing them
        self.token_classes = token_classes
        self.policies: list[CachePolicy] = cache_policies(self)   # token policies, run in this order
        self.raw: dict[int, RawLayer] = {}                        # layers in the raw phase
        self.raw_tokens = self.auto_raw_tokens() if raw_tokens is None else int(raw_tokens)
        others = [p.name for p in self.policies if p.name != "diffkv"]
        if config.exact_window and others:
            raise ValueError(f"an exact window serves DiffKV's tiers only, and {', '.join(others)} evict or place "
                             "tokens the window would hold; serve them with exact_window=False")
        if self.raw_tokens < 0 or (self.raw_tokens and others):
            # the hand-over tiers the raw tokens without the prompt's own attention, which these policies need
            raise ValueError(f"raw_tokens={raw_tokens}: " + ("give 0 (no raw phase), a positive count, or None (auto)"
                             if self.raw_tokens < 0 else f"a raw phase serves DiffKV's tiers only, and "
                             f"{', '.join(others)} decide from the prompt's own attention; pass raw_tokens=0 or None"))

    @classmethod
    def from_bundle(cls, bundle, config: CompressionConfig, *, batch: int, sliding: list[bool], device="cpu",
                    raw16: torch.dtype = torch.float16, token_classes: tuple | None = None,
                    raw_tokens: int | None = 0, serve: ServeOptions = ServeOptions()) -> CompressedKV:
        ranges = None
        if "k.range_low" in bundle.extras:
            ranges = (bundle.extras["k.range_low"], bundle.extras["k.range_high"])
        return cls(bundle.qk_rotation, bundle.v_basis, bundle.qk_rank, bundle.v_rank, config, batch=batch,
                   sliding=sliding, device=device, raw16=raw16, token_classes=token_classes, key_ranges=ranges,
                   smoothing=bundle.extras.get("qk.smoothing"), raw_tokens=raw_tokens,
                   serve=serve, levels=bundle.extras)

    def policy(self, name: str) -> CachePolicy | None:
        """The token policy called `name` (cache_policy.CACHE_POLICIES), or None when the config leaves it off."""
        return next((p for p in self.policies if p.name == name), None)

    def every_entry(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, KV head) of every entry, sequence-major: b, h int64 [B * H]. Made once per batch (every layer
        of every step asks); callers must not change them in place."""
        return self.store.every_entry()

    # --------------------------------------------------------------------------------------------- forward

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                pad: torch.Tensor | None, scale: float) -> torch.Tensor:
        """query [B, Hq, n, d]; key, value [B, H, n, d]; pad bool [B, n] (True = real token; prefill only, None =
        no padding) -> output [B, Hq, n, d] in query's dtype. Runs on `serve.threads` torch threads when set."""
        with torch_threads(self.serve.threads):
            return self._forward(layer, query, key, value, pad, scale)

    def _forward(self, layer, query, key, value, pad, scale):
        B, Hq, n, d = query.shape
        H = key.shape[1]
        q = query.view(B, H, Hq // H, n, d)
        if self.length[layer] == 0:
            self.raw.pop(layer, None)                  # cropped to nothing: a new prompt
            out = self._prefill(layer, q, key, value, pad, scale)
        elif layer in self.raw:
            out = self._raw_step(layer, q, key, value, scale)
        else:
            out = self._decode_step(layer, q, key, value, scale)
        return out.reshape(B, Hq, n, d).to(query.dtype)

    # --------------------------------------------------------------------------------------------- raw phase

    def auto_raw_tokens(self) -> int:
        """The raw phase that keeps a sequence's pages within fp16 at every length after it, by the page layouts
        (`CompressedStore.pages_estimate`: every token past the window and the pending low page settles low; heavy
        hitters kept high are not in it). 0 (no raw phase) when a token policy other than DiffKV's tiers is on (they
        need the prompt's own attention, `prompt_statistics`) or when the pages never cost less than fp16 (tiers
        of 16 bits or more, e.g. `CompressionConfig.none()`)."""
        if any(p.name != "diffkv" for p in self.policies) or not self.layers:
            return 0
        store = self.store
        fp16 = self._fp16_per_token()
        rate, high = self._settled_bytes_per_token(), self._high_tokens()
        if rate >= fp16:
            return 0
        entries = [(g, len(g.heads)) for gs in store.groups.values() for g in gs]
        # pages_estimate(m) <= rate * m + const: past `limit` the pages stay below fp16 whatever m
        const = sum(n * (-(-(high or 0) // g.layouts[0].tokens) + 1) * store.page_bytes for g, n in entries)
        limit = min(int(const // (fp16 - rate)) + 2, 1 << 16)
        n = limit
        while n > 1 and store.pages_estimate(self._paged_tokens(n - 1), high) <= fp16 * self._paged_tokens(n - 1):
            n -= 1
        return n - 1

    def _paged_tokens(self, tokens: int) -> int:
        """Tokens of a sequence of `tokens` that its pages hold: all but the exact window's (which holds each at 16
        bits, no more than fp16)."""
        return max(0, tokens - self.config.tiering.window) if self.windows is not None else tokens

    def _fp16_per_token(self) -> int:
        """Bytes per token of one sequence's compressed layers in an fp16 dense cache."""
        d = next(iter(self.rotation.values())).shape[1] if self.rotation else 0
        return len(self.layers) * self.store.num_kv_heads * d * 2 * 2

    def _high_tokens(self) -> int | None:
        """Most tokens an entry's high section holds by the layouts' model (`pages_estimate`): the window (unless it
        is held exact, outside the pages) and, with per-channel low keys, a page of low tokens less one waiting;
        None: every token (no tiers)."""
        t = self.config.tiering
        if not t.tiered:
            return None
        wait = max(g.layouts[LOW].tokens for gs in self.store.groups.values() for g in gs) - 1 \
            if self.config.low.k_mode == "channel" else 0
        return (0 if self.windows is not None else t.window) + wait

    def _settled_bytes_per_token(self) -> float:
        """Page bytes per token of one sequence once its tokens settle: the low tier's layouts with tiers, else the
        high tier's (every compressed layer and KV head, page metadata and padding included)."""
        side = LOW if self.config.tiering.tiered else HIGH
        return sum(len(g.heads) * g.layouts[side].bytes_per_token for gs in self.store.groups.values() for g in gs)

    def steady_state_ratio(self) -> float:
        """Bytes per token a long sequence converges to, against fp16 (`_settled_bytes_per_token`): heavy hitters
        kept high raise it a little, pruned and evicted tokens lower it."""
        fp16 = self._fp16_per_token()
        return self._settled_bytes_per_token() / fp16 if fp16 else float("nan")

    def allowance_bytes(self) -> int:
        """The fixed amount by which the bytes this cache holds may exceed an fp16 cache of the same tokens
        (docs/runtime.md): per (sequence, compressed layer, KV head) one page (partly filled pages and heavy hitters
        beyond `pages_estimate`), the raw phase's and the exact window's significance (4 bytes per raw or window
        token), plus the page tables and counters as made (`CompressedStore.bookkeeping_bytes`) and the bundle's
        constants (static key scales, calibrated levels: `CompressedStore.fixed_bytes`)."""
        entries = self.batch * len(self.layers) * self.store.num_kv_heads
        window = self.windows.size if self.windows is not None else 0
        return (entries * (self.store.page_bytes + 4 * (self.raw_tokens + window)) + self.store.bookkeeping_bytes()
                + self.store.fixed_bytes())

    def raw_bytes(self) -> int:
        """K/V bytes held at 16 bits outside the pages: the raw phase's (as an fp16 cache holds them, whatever the
        model's dtype: the bench and the search run models in float32 only to measure) and the exact windows'."""
        window = self.windows.kv_bytes() if self.windows is not None else 0
        return sum((r.keys.numel() + r.values.numel()) * 2 for r in self.raw.values()) + window

    def raw_score_bytes(self) -> int:
        """Bytes of the significance held outside the pages: the raw phase's buffers (`RawLayer.score`, fixed,
        `raw_tokens` float32 per (sequence, layer, KV head)) and the exact windows' (at most `window` float32)."""
        window = self.windows.score_bytes() if self.windows is not None else 0
        return sum(r.score.numel() * r.score.element_size() for r in self.raw.values()) + window

    def write_prompt(self, layer: int, key: torch.Tensor, value: torch.Tensor, score: torch.Tensor,
                     real: torch.Tensor, statistics: dict | None = None) -> None:
        """`write_prefill`, or for a prompt the raw phase takes (at most `raw_tokens` tokens, nothing recorded), hold
        it raw: key, value [B, H, n, d] kept as given, score [B, H, n] its significance from the prefill."""
        B, H, n, _ = key.shape
        if not (0 < n <= self.raw_tokens and self.recorder is None):
            self.write_prefill(layer, key, value, score, real, statistics)
            return
        buffer = torch.zeros(B, H, self.raw_tokens, device=key.device)
        buffer[..., :n] = score
        self.n_pad = (~real).sum(-1).to(self.device)
        self.length[layer] = n
        self.raw[layer] = RawLayer(key, value, real.to(torch.bool), buffer)

    def _raw_step(self, layer, q, key, value, scale):
        """New tokens of a layer in the raw phase: exact attention over the raw tokens and themselves, significance
        added as the backends add it; past `raw_tokens` the layer's tokens are written to the store."""
        B, H, g, n, d = q.shape
        raw = self.raw[layer]
        S = raw.keys.shape[2]
        keys = torch.cat([raw.keys, key.to(raw.keys.dtype)], dim=2)
        values = torch.cat([raw.values, value.to(raw.values.dtype)], dim=2)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        allowed = torch.cat([raw.real[:, None, None, None, :].expand(B, H, 1, n, S),
                             causal.expand(B, H, 1, n, n)], dim=-1)
        out, probs = _softmax_attend(q.float(), keys, values, allowed, scale)          # probs [B, H, n, S + n]
        score = raw.score if S + n <= raw.score.shape[-1] else torch.cat(
            [raw.score[..., :S], torch.zeros(B, H, n, device=q.device)], dim=-1)
        score[..., :S] += probs[..., :S].sum(dim=2)
        score[..., S:S + n] = probs[..., S:].sum(dim=2)
        real = torch.cat([raw.real, torch.ones(B, n, dtype=torch.bool, device=raw.real.device)], dim=1)
        self.length[layer] = S + n
        if S + n > self.raw_tokens:
            del self.raw[layer]
            self.write_prefill(layer, keys, values, score[..., :S + n], real)
        else:
            self.raw[layer] = RawLayer(keys, values, real, score)
        return out

    def _project(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        """key, value [B, H, n, d] -> K·R [B, H, n, r_k], V·B [B, H, n, r_v] (float32)."""
        return per_head_matmul(key.float(), self.rotation[layer]), per_head_matmul(value.float(), self.basis[layer])

    def _prefill(self, layer, q, key, value, pad, scale):
        B, H, g, n, d = q.shape
        real = pad if pad is not None else torch.ones(B, n, dtype=torch.bool, device=q.device)
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None] & real[:, None, :]   # [B, n, n]
        attention = PromptAttention(q.float(), key.float(), mask, scale)
        out, score = self.backend.prefill(attention.query, attention.keys, value.float(), mask, scale)
        statistics = {p.name: p.prompt_statistics(attention, real, score) for p in self.policies}
        if self.recorder is not None:
            # a recording cache exists to hand its prefill to the caches primed from it (`write_prefill`); writing
            # the prompt into its own pages as well would hold every layer's K/V twice, for nothing
            self.recorder[layer] = (key.float(), value.float(), score, real, statistics)
            return out
        self.write_prompt(layer, key, value, score, real, statistics)
        return out

    def write_prefill(self, layer: int, key: torch.Tensor, value: torch.Tensor, score: torch.Tensor,
                      real: torch.Tensor, statistics: dict | None = None) -> None:
        """Tier and write a prompt whose dense prefill attention already ran: key, value [B, H, n, d] post-RoPE;
        score [B, H, n] significance from that attention; real bool [B, n] non-padding tokens; statistics: each
        policy's `prompt_statistics` of this prompt.

        Split from `_prefill` because the prefill attention does not depend on the compression settings: a search
        over settings runs it once, records (key, value, score, real, statistics) through `recorder`, and replays
        the writes.
        """
        B, H, n, _ = key.shape
        self.n_pad = (~real).sum(-1).to(self.device)
        self.length[layer] = n
        pos = torch.where(real, torch.arange(n, device=key.device), -1)[:, None, :].expand(B, H, n)   # [B, H, n]
        prompt = Prompt(score, pos, torch.full((B,), n, device=self.device), statistics or {})
        tier = torch.full((B, H, n), TIER_HIGH, dtype=torch.int8, device=key.device)
        for policy in self.policies:
            tier = policy.prefill(layer, tier, prompt)
        k_rot, v_proj = self._project(layer, key, value)
        if self.windows is not None:              # the newest tokens stay exact; TIER_PRUNED: not written to pages
            tier = tier.clone()
            tier[..., n - self.windows.hold(layer, k_rot, v_proj, score):] = TIER_PRUNED
        self._write_prompt(layer, tier, k_rot, v_proj, pos, score, prompt.length)

    def _write_prompt(self, layer, tier, k_rot, v_proj, pos, score, length):
        store = self.store
        if self.config.low.k_mode == "channel" and self.config.tiering.tiered:
            tier = self._seal_low_pages(layer, tier, k_rot, v_proj, pos, score, length)
        for t, side in ((TIER_HIGH, HIGH), (TIER_LOW, LOW)):
            b, h, i = torch.nonzero(tier == t, as_tuple=True)
            store.append(layer, side, b, h, k_rot[b, h, i], v_proj[b, h, i], pos[b, h, i], score[b, h, i])

    def _seal_low_pages(self, layer, tier, k_rot, v_proj, pos, score, length):
        """Per-channel low tier at prefill: the least significant low tokens as whole pages of position neighbours
        (whose keys share per-channel ranges best); the others (under a page per entry) stay high. Returns the tiers."""
        tier = tier.clone()
        m = mean_score(score, pos, length)
        for g in self.store.groups[layer]:
            T = g.layouts[LOW].tokens
            hs = g.heads
            is_low = tier[:, hs] == TIER_LOW                                               # [B, Hg, n]
            n_pages = is_low.sum(-1) // T                                               # [B, Hg]
            if not bool((n_pages > 0).any()):                 # no full page yet: every low token waits high
                tier[:, hs] = torch.where(is_low, torch.full_like(tier[:, hs], TIER_HIGH), tier[:, hs])
                continue
            # rank low tokens by significance, least first
            key = torch.where(is_low, m[:, hs], torch.full_like(m[:, hs], float("inf")))
            order = key.argsort(dim=-1)                                                 # [B, Hg, n]
            rank = torch.empty_like(order)
            rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
            sealed = is_low & (rank < (n_pages * T)[..., None])
            order = (~sealed).to(torch.uint8).argsort(dim=-1, stable=True)   # sealed first, in position order
            tier[:, hs] = torch.where(is_low & ~sealed, torch.full_like(tier[:, hs], TIER_HIGH), tier[:, hs])
            # written here, every page in one call; TIER_PRUNED keeps _write_prompt from appending them again
            tier[:, hs] = torch.where(sealed, torch.full_like(tier[:, hs], TIER_PRUNED), tier[:, hs])
            eb, eh, p = torch.nonzero(n_pages[..., None] > torch.arange(int(n_pages.max()), device=tier.device),
                                      as_tuple=True)           # [pages]: entry and page number, pages in order
            idx = order[eb[:, None], eh[:, None], p[:, None] * T + torch.arange(T, device=tier.device)]  # [pages, T]
            gh = hs[eh]
            self.store.write_pages(layer, eb, gh, k_rot[eb[:, None], gh[:, None], idx],
                                   v_proj[eb[:, None], gh[:, None], idx], pos[eb[:, None], gh[:, None], idx],
                                   score[eb[:, None], gh[:, None], idx])
        return tier

    def _decode_step(self, layer, q, key, value, scale):
        B, H, g, n, d = q.shape
        q_rot = per_head_matmul(q.float().reshape(B, H, g * n, d), self.query_rotation[layer]).view(B, H, g, n, -1)
        k_rot, v_proj = self._project(layer, key, value)
        if self.config.tiering.tiered:
            self.store.own_layer(layer)    # the backend adds this step's attention to every stored token's score
        track, start, windows = any(p.reads_scores for p in self.policies), self.length[layer], self.windows
        if windows is None:                # every new token enters the high tier at once
            out_r, new_score = self.backend.attend(self.store, layer, q_rot, k_rot, v_proj, scale, track_scores=track)
            entering, first, padding = Tokens(k_rot, v_proj, new_score), start, None
        else:                              # the tokens the new ones push out of the window enter it
            (keys, values), padding = windows.block(layer, k_rot, v_proj), windows.exact_from(layer, self.n_pad, start)
            out_r, score = self.backend.attend(self.store, layer, q_rot, keys, values, scale, track_scores=track,
                                               exact_from=padding)
            entering = windows.advance(layer, keys, values, windows.score(layer, n) + score)
            first = start - windows.size
        for i in range(n):
            if (t := i - (n - entering.count)) >= 0:
                self._enter_high(layer, entering, t, first + i, padding)
            self.length[layer] = start + i + 1
            for policy in self.policies:
                policy.decode(layer)
        return per_head_matmul(out_r.reshape(B, H, g * n, -1), self.basis_t[layer])

    def _enter_high(self, layer: int, tokens: Tokens, t: int, pos: int, padding: torch.Tensor | None) -> None:
        """Token t of `tokens` (position `pos`) enters every entry's high tier, but where it is left padding by the
        step's `ExactWindows.exact_from` (padding; None: none is)."""
        B, H = self.batch, self.store.num_kv_heads
        b, h = self.every_entry()
        k, v = tokens.keys[:, :, t].reshape(B * H, -1), tokens.values[:, :, t].reshape(B * H, -1)
        s = tokens.score[:, :, t].reshape(-1)
        if padding is None:
            self.store.insert(layer, HIGH, b, h, k, v, pos, s, every_entry=True)
            return
        real = (padding <= t)[b]
        if bool(real.any()):
            self.store.insert(layer, HIGH, b[real], h[real], k[real], v[real], pos, s[real])

    # --------------------------------------------------------------------------------------------- beams, crop

    def select(self, index: torch.Tensor) -> int:
        """Sequence i becomes old sequence index[i] (int [k], repeats allowed; k may differ from the batch): page
        tables are re-indexed and pages shared, not copied (CompressedStore.select). Returns pages freed."""
        index = torch.as_tensor(index, device=self.device).long()
        if index.dim() != 1 or index.numel() == 0 or bool(((index < 0) | (index >= self.batch)).any()):
            raise ValueError(f"batch index must be a non-empty 1-D tensor of rows in [0, {self.batch}), got "
                             f"{index.tolist() if index.numel() <= 16 else tuple(index.shape)}")
        freed = self.store.select(index)
        if self.windows is not None:
            self.windows.select(index)
        for layer, r in self.raw.items():
            self.raw[layer] = RawLayer(r.keys[index], r.values[index], r.real[index], r.score[index])
        self.batch = len(index)
        self.n_pad = self.n_pad[index]
        for policy in self.policies:
            policy.select_rows(index)
        return freed

    def crop(self, keep: int) -> int:
        """Cut every compressed layer back to its first `keep` cache positions (padding included), exactly: the
        removed tokens must all still be at the high tier, else ValueError and nothing changes. Significance scores
        that the removed tokens added to older ones stay (tiered policies only). Returns the pages freed."""
        length = self.length[self.layers[0]] if self.layers else 0
        if not 0 <= keep <= length:
            raise ValueError(f"crop to {keep} tokens: the cache holds {length}; give a length in [0, {length}]")
        if keep == length:
            return 0
        for layer in self.layers:
            if layer in self.raw:
                continue
            held = self.windows.layers[layer].count if self.windows is not None else 0   # the pages end before it
            why = self.store.crop_check(layer, keep, self.n_pad, self.length[layer] - held)
            if why is not None:
                raise ValueError(f"cannot crop the cache to {keep} tokens: {why}; crop fewer tokens, or serve "
                                 "without tiers and eviction (e.g. CompressionConfig.none())")
        freed = 0
        for layer in self.layers:
            if layer in self.raw:
                r = self.raw[layer]
                r.score[..., keep:] = 0
                self.raw[layer] = RawLayer(r.keys[:, :, :keep], r.values[:, :, :keep], r.real[:, :keep], r.score)
            else:
                freed += self.store.crop(layer, keep)
                if self.windows is not None:
                    self.windows.crop(layer, self.length[layer] - keep)
            self.length[layer] = keep
        for policy in self.policies:
            policy.crop(keep)
        return freed

    # --------------------------------------------------------------------------------------------- accounting

    def tier_counts(self) -> dict[str, int]:
        """Tokens held per tier, summed over compressed layers, sequences and KV heads."""
        b, h = self.every_entry()
        counts = {"high": 0, "low": 0}
        for layer in self.layers:
            if layer in self.raw:                      # the raw phase holds its tokens exactly: counted high
                counts["high"] += int(self.raw[layer].real.sum()) * self.store.num_kv_heads
                continue
            for side, name in ((HIGH, "high"), (LOW, "low")):
                counts[name] += int((self.store.section_meta(layer, side, b, h)[1] >= 0).sum())
            if self.windows is not None and layer in self.windows.layers:     # the exact window: counted high
                first = self.length[layer] - self.windows.layers[layer].count
                real = (torch.arange(first, self.length[layer], device=self.device) >= self.n_pad[:, None]).sum()
                counts["high"] += int(real) * self.store.num_kv_heads
        return counts

    def release(self) -> int:
        self.raw.clear()
        if self.windows is not None:
            self.windows.clear()
        return self.store.release()
