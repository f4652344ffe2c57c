"""The compressed KV cache of one batch, independent of any framework: where the bundle, the token policy, the store
and the attention backend meet.

    kv = CompressedKV.from_bundle(bundle, CompressionConfig(), batch=2, sliding=[False] * L)
    out = kv.forward(layer, query, key, value, pad, scale)    # prefill on the first call of a layer, decode after

Per layer, `forward` takes post-RoPE query [B, Hq, n, d], key and value [B, H, n, d] and returns the attention output
[B, Hq, n, d]. The first call of a layer is the prefill: attention on the uncompressed K/V (scores for the token
policy come from it), then the prompt is tiered and written compressed. Later calls attend over the compressed store
plus the new tokens, write the new tokens at high precision, and run one Algorithm 1 step per new token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvcal.runtime import fastgen as fg
from kvcal.runtime.attention import select_backend
from kvcal.runtime.layout import TierFormat
from kvcal.runtime.pages import HIGH, LOW
from kvcal.runtime.policy import HIGH as T_HIGH
from kvcal.runtime.policy import LOW as T_LOW
from kvcal.runtime.policy import PRUNED as T_PRUNED
from kvcal.runtime.policy import TokenPolicy, classify_prompt, decode_actions, mean_score, pending_low
from kvcal.runtime.store import CompressedStore


@dataclass(frozen=True)
class CompressionConfig:
    """Runtime settings. `CompressionConfig.none()` stores everything exactly (for checks against dense)."""

    high: TierFormat = field(default_factory=lambda: TierFormat(8, 4))            # DiffKV's high tier
    low: TierFormat = field(default_factory=lambda: TierFormat(4, 2, "channel"))  # per-channel keys: outlier-safe
    policy: TokenPolicy = field(default_factory=TokenPolicy)
    use_ranks: bool = True        # False: store full rank even if the bundle has lower ranks
    rotate: bool = True           # False: no rotation (identity R and B); only meaningful at full rank
    mix: bool = True              # spread energy evenly over the kept coordinates before quantizing (see _mixing)
    page_bytes: int | None = None  # None: 32 full-rank high-tier tokens per page
    backend: str = "auto"
    fastgen: fg.FastGenConfig | None = None   # per-head FastGen policies on top of the tiers (None: off)

    @classmethod
    def none(cls) -> CompressionConfig:
        return cls(high=TierFormat(32, 32), low=TierFormat(32, 32), policy=TokenPolicy(), use_ranks=False,
                   rotate=False)

    @classmethod
    def from_policy(cls, policy: dict) -> CompressionConfig:
        """Settings a bundle's `policy` metadata records (missing keys keep their defaults)."""
        cfg = cls()
        tp = {k: policy[k] for k in ("window", "alpha_high", "alpha_low", "threshold_base") if k in policy}
        fast = policy.get("fastgen")
        return replace(cfg, high=TierFormat.parse(policy.get("high", cfg.high.name)),
                       low=TierFormat.parse(policy.get("low", cfg.low.name)), policy=TokenPolicy(**tp),
                       fastgen=fg.FastGenConfig(**fast) if fast else None)

    def with_(self, **changes) -> CompressionConfig:
        return replace(self, **changes)


def _mixing(width: int, rank: int) -> torch.Tensor:
    """[width, width] orthogonal on the first `rank` coordinates (identity elsewhere), seeded by `rank` alone.

    R and B sort coordinates by energy, so the first few carry most of it; a per-token quantizer then spends its range
    on them and rounds the rest to nothing. A fixed random rotation inside the kept subspace spreads the energy evenly
    (the incoherence step of QuaRot/QuIP) and changes no dot product: (q R M)(k R M)^T = (q R)(k R)^T for orthogonal
    M, and the value output maps back through (B M)^T. Deterministic, so a bundle always serves the same way.
    """
    g = torch.Generator().manual_seed(rank)
    q, r = torch.linalg.qr(torch.randn(rank, rank, generator=g, dtype=torch.float64))
    m = torch.eye(width, dtype=torch.float64)
    m[:rank, :rank] = q * torch.sign(torch.diagonal(r))        # sign fix: a unique Haar-distributed orthogonal
    return m.float()


def served_bases(rotation: torch.Tensor, basis: torch.Tensor, rank_k: torch.Tensor, rank_v: torch.Tensor,
                 config: CompressionConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranks and bases the runtime actually applies under `config`: rotation, basis [L, H, d, d] float32 with
    every column beyond the head's rank zeroed and, with mixing, the first rank columns multiplied by `_mixing`;
    rank_k, rank_v [L, H] (full when `use_ranks` is off). K is stored as K @ rotation[l, h][:, :rank_k[l, h]]. The
    manifest export writes exactly these, so another runtime reads and writes the same bytes."""
    L, H, d, _ = rotation.shape
    if not config.use_ranks:
        rank_k = rank_v = torch.full((L, H), d, dtype=torch.int32)
    if not config.rotate:
        rotation = basis = torch.eye(d).expand(L, H, d, d)
    cols = torch.arange(d)
    out_r, out_b = torch.zeros(L, H, d, d), torch.zeros(L, H, d, d)
    for layer in range(L):
        rk, rv = int(rank_k[layer].max()), int(rank_v[layer].max())
        keep_k = (cols[None, :] < rank_k[layer, :, None]).float()[:, None, :]             # [H, 1, d]
        keep_v = (cols[None, :] < rank_v[layer, :, None]).float()[:, None, :]
        R = (rotation[layer].float() * keep_k)[..., :rk]                                   # [H, d, rk]
        Bv = (basis[layer].float() * keep_v)[..., :rv]                                     # [H, d, rv]
        if config.mix and config.rotate:
            R = torch.stack([R[h] @ _mixing(rk, int(rank_k[layer, h])) for h in range(H)])
            Bv = torch.stack([Bv[h] @ _mixing(rv, int(rank_v[layer, h])) for h in range(H)])
        out_r[layer, :, :, :rk], out_b[layer, :, :, :rv] = R, Bv
    return rank_k, rank_v, out_r, out_b


class CompressedKV:
    """Compressed KV state of one batch of sequences across all layers (see module docstring)."""

    def __init__(self, rotation: torch.Tensor, basis: torch.Tensor, rank_k: torch.Tensor, rank_v: torch.Tensor,
                 config: CompressionConfig, *, batch: int, sliding: list[bool], device="cpu",
                 raw16: torch.dtype = torch.float16):
        """rotation, basis: [L, H, d, d]; rank_k, rank_v: [L, H] int."""
        L, H, d, _ = rotation.shape
        self.config, self.batch, self.device = config, batch, torch.device(device)
        self.layers = [i for i in range(L) if not sliding[i]]
        rank_k, rank_v, rotation, basis = served_bases(rotation, basis, rank_k, rank_v, config)
        self.rank_k, self.rank_v = rank_k.clone(), rank_v.clone()
        # cut to the layer's largest rank: columns beyond a head's own rank are 0, so padded coordinates are 0
        self.rotation = {layer: rotation[layer, :, :, :int(rank_k[layer].max())].to(self.device)
                         for layer in self.layers}
        self.basis = {layer: basis[layer, :, :, :int(rank_v[layer].max())].to(self.device) for layer in self.layers}
        self.store = CompressedStore(rank_k, rank_v, self.layers, high=config.high, low=config.low, head_dim=d,
                                     batch=batch, device=self.device, page_bytes=config.page_bytes, raw16=raw16)
        self.backend = select_backend(config.backend, str(self.device))
        if hasattr(self.backend, "bind"):  # a backend with its own cache-write kernels takes the writes
            self.backend.bind(self.store)
        self.length = {layer: 0 for layer in self.layers}          # cache length (padding included)
        self.n_pad = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.recorder: dict | None = None   # set to {} to keep each layer's prefill inputs (see write_prefill)
        # FastGen state: token ids by cache index (the classes of special / punctuation tokens need them), and the
        # policy each (layer, sequence, KV head) chose at prefill
        self.token_ids = torch.zeros(batch, 0, dtype=torch.int64, device=self.device)
        self.special_ids = self.punct_ids = torch.zeros(0, dtype=torch.int64)
        self.fastgen_policy: dict[int, torch.Tensor] = {}

    @classmethod
    def from_bundle(cls, bundle, config: CompressionConfig, *, batch: int, sliding: list[bool], device="cpu",
                    raw16: torch.dtype = torch.float16) -> CompressedKV:
        return cls(bundle.qk_rotation, bundle.v_basis, bundle.qk_rank, bundle.v_rank, config, batch=batch,
                   sliding=sliding, device=device, raw16=raw16)

    # --------------------------------------------------------------------------------------------- forward

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                pad: torch.Tensor | None, scale: float) -> torch.Tensor:
        """query [B, Hq, n, d]; key, value [B, H, n, d]; pad bool [B, n] (True = real token; prefill only, None =
        no padding) -> output [B, Hq, n, d] in query's dtype."""
        B, Hq, n, d = query.shape
        H = key.shape[1]
        q = query.view(B, H, Hq // H, n, d)
        if self.length[layer] == 0:
            out = self._prefill(layer, q, key, value, pad, scale)
        else:
            out = self._decode(layer, q, key, value, scale)
        return out.reshape(B, Hq, n, d).to(query.dtype)

    def _project(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        R, Bv = self.rotation[layer], self.basis[layer]
        return (torch.einsum("bhnd,hdr->bhnr", key.float(), R), torch.einsum("bhnd,hdr->bhnr", value.float(), Bv))

    def _prefill(self, layer, q, key, value, pad, scale):
        B, H, g, n, d = q.shape
        real = pad if pad is not None else torch.ones(B, n, dtype=torch.bool, device=q.device)
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None] & real[:, None, :]   # [B, n, n]
        out, score = self.backend.prefill(q.float(), key.float(), value.float(), mask, scale)
        recovery = self._prompt_recovery(q, key, real, score, scale) if self.config.fastgen else None
        if self.recorder is not None:
            self.recorder[layer] = (key.float(), value.float(), score, real, recovery)
        self.write_prefill(layer, key, value, score, real, recovery)
        return out

    def observe_tokens(self, ids: torch.Tensor) -> None:
        """Token ids [B, n] of the tokens this forward pass adds (FastGen classifies special / punctuation tokens)."""
        self.token_ids = torch.cat([self.token_ids, ids.to(self.device)], dim=1)

    def _flags(self) -> tuple[torch.Tensor, torch.Tensor]:
        return fg.token_flags(self.token_ids, self.special_ids.to(self.device), self.punct_ids.to(self.device))

    def _prompt_recovery(self, q, key, real, score, scale) -> torch.Tensor:
        """FastGen Eq. 1 on this prompt: recovery [4, B, H] of each compressed policy (prompt attention recomputed in
        query blocks, because the ranking of frequent tokens needs the final column sums first)."""
        from kvcal.runtime.attention import prefill_rows

        B, H, g, n, d = q.shape
        if self.token_ids.shape[1] < n:
            raise ValueError("FastGen needs the prompt's token ids: call the model with `input_ids` (not "
                             "`inputs_embeds`) through a cache made by `KvcalCache.from_bundle(..., tokenizer=...)`")
        is_special, is_punct = self._flags()
        n_pad = (~real).sum(-1)
        total = torch.zeros(4, B, H, device=q.device)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None] & real[:, None, :]
        step = prefill_rows(B, H, g, n)
        for start in range(0, n, step):
            rows = torch.arange(start, min(start + step, n), device=q.device)
            probs = torch.softmax(torch.einsum("bhgnd,bhsd->bhgns", q[:, :, :, rows].float(), key.float()) * scale
                                  + torch.where(causal[:, None, None, rows], 0.0, float("-inf")), dim=-1)
            probs = torch.nan_to_num(probs, nan=0.0)
            total += fg.prompt_recovery(probs, rows, is_special[:, :n], is_punct[:, :n], score, self.config.fastgen,
                                        n_pad)
        return total / (n - n_pad).clamp(min=1).to(total.dtype)[None, :, None]


    def write_prefill(self, layer: int, key: torch.Tensor, value: torch.Tensor, score: torch.Tensor,
                      real: torch.Tensor, recovery: torch.Tensor | None = None) -> None:
        """Tier and write a prompt whose dense prefill attention already ran: key, value [B, H, n, d] post-RoPE;
        score [B, H, n] significance from that attention; real bool [B, n] non-padding tokens.

        Split from `_prefill` because the prefill attention does not depend on the compression settings: a search
        over settings runs it once, records (key, value, score, real) through `recorder`, and replays the writes.
        """
        B, H, n, _ = key.shape
        self.n_pad = (~real).sum(-1).to(self.device)
        self.length[layer] = n
        pos = torch.where(real, torch.arange(n, device=key.device), -1)[:, None, :].expand(B, H, n)   # [B, H, n]
        length = torch.full((B,), n, device=self.device)
        tier = classify_prompt(self.config.policy, score, pos, self.n_pad, length)
        if self.config.fastgen is not None:
            # a token FastGen drops is pruned whatever its tier; the tokens it keeps are tiered by significance
            if recovery is None:
                raise ValueError("FastGen is on but this prefill has no recovery statistics (record with FastGen on)")
            policy = fg.choose_policy(recovery, self.config.fastgen)                      # [B, H]
            self.fastgen_policy[layer] = policy
            is_special, is_punct = self._flags()
            kept = fg.kept_sets(is_special[:, :n], is_punct[:, :n], score, pos, length, self.config.fastgen,
                                self.n_pad)
            drop = fg.decode_evictions(policy, kept, pos)
            tier = torch.where(drop, torch.full_like(tier, T_PRUNED), tier)
        k_rot, v_proj = self._project(layer, key, value)
        self._write_prompt(layer, tier, k_rot, v_proj, pos, score, length)

    def _write_prompt(self, layer, tier, k_rot, v_proj, pos, score, length):
        store = self.store
        if self.config.low.k_mode == "channel" and self.config.policy.tiered:
            tier = self._seal_low_pages(layer, tier, k_rot, v_proj, pos, score, length)
        for t, side in ((T_HIGH, HIGH), (T_LOW, LOW)):
            b, h, i = torch.nonzero(tier == t, as_tuple=True)
            store.append(layer, side, b, h, k_rot[b, h, i], v_proj[b, h, i], pos[b, h, i], score[b, h, i])

    def _seal_low_pages(self, layer, tier, k_rot, v_proj, pos, score, length):
        """Per-channel low tier at prefill: write the least significant low tokens as whole pages; the rest of them
        (fewer than a page per entry) stay high until enough low tokens exist. Returns the updated tiers."""
        tier = tier.clone()
        m = mean_score(score, pos, length)
        for g in self.store.groups[layer]:
            T = g.layouts[LOW].tokens
            hs = g.heads
            is_low = tier[:, hs] == T_LOW                                               # [B, Hg, n]
            n_pages = is_low.sum(-1) // T                                               # [B, Hg]
            if not bool((n_pages > 0).any()):                 # no full page yet: every low token waits high
                tier[:, hs] = torch.where(is_low, torch.full_like(tier[:, hs], T_HIGH), tier[:, hs])
                continue
            # rank low tokens by significance, least first
            key = torch.where(is_low, m[:, hs], torch.full_like(m[:, hs], float("inf")))
            order = key.argsort(dim=-1)                                                 # [B, Hg, n]
            rank = torch.empty_like(order)
            rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
            sealed = is_low & (rank < (n_pages * T)[..., None])
            tier[:, hs] = torch.where(is_low & ~sealed, torch.full_like(tier[:, hs], T_HIGH), tier[:, hs])
            # sealed tokens are written here, page by page; PRUNED keeps _write_prompt from appending them again
            tier[:, hs] = torch.where(sealed, torch.full_like(tier[:, hs], T_PRUNED), tier[:, hs])
            for p in range(int(n_pages.max())):
                sel = sealed & (rank >= p * T) & (rank < (p + 1) * T)                   # page p of each entry
                eb, eh = torch.nonzero(n_pages > p, as_tuple=True)
                if len(eb) == 0:
                    continue
                idx = order[eb, eh, p * T:(p + 1) * T]                                 # [e, T] token indices
                assert bool(sel[eb, eh].gather(-1, idx).all())
                gh = hs[eh]
                self.store.write_pages(layer, eb, gh, k_rot[eb[:, None], gh[:, None], idx],
                                       v_proj[eb[:, None], gh[:, None], idx], pos[eb[:, None], gh[:, None], idx],
                                       score[eb[:, None], gh[:, None], idx])
        return tier

    def _decode(self, layer, q, key, value, scale):
        B, H, g, n, d = q.shape
        R = self.rotation[layer]
        q_rot = torch.einsum("bhgnd,hdr->bhgnr", q.float(), R)
        k_rot, v_proj = self._project(layer, key, value)
        out_r, new_score = self.backend.attend(self.store, layer, q_rot, k_rot, v_proj, scale,
                                               track_scores=self.config.policy.tiered)
        start = self.length[layer]
        b = torch.arange(B, device=self.device).repeat_interleave(H)
        h = torch.arange(H, device=self.device).repeat(B)
        for i in range(n):
            pos = torch.full((B * H,), start + i, device=self.device)
            self.store.insert(layer, HIGH, b, h, k_rot[:, :, i].reshape(B * H, -1), v_proj[:, :, i].reshape(B * H, -1),
                                   pos, new_score[:, :, i].reshape(-1))
            self.length[layer] = start + i + 1
            self._policy_step(layer)
            if self.config.fastgen is not None:
                self._fastgen_step(layer)
        return torch.einsum("bhgnr,hdr->bhgnd", out_r, self.basis[layer])

    # --------------------------------------------------------------------------------------------- policy

    def _policy_step(self, layer: int) -> None:
        policy = self.config.policy
        if not policy.tiered or self.length[layer] <= policy.window:
            return
        B, H = self.batch, self.store.num_kv_heads
        store = self.store
        b = torch.arange(B, device=self.device).repeat_interleave(H)
        h = torch.arange(H, device=self.device).repeat(B)
        length = torch.full((B,), self.length[layer], device=self.device)
        hi_s, hi_p = (t.view(B, H, -1) for t in store.section_meta(layer, HIGH, b, h))
        lo_s, lo_p = (t.view(B, H, -1) for t in store.section_meta(layer, LOW, b, h))
        channel = self.config.low.k_mode == "channel"
        acts = decode_actions(policy, hi_s, hi_p, lo_s, lo_p, self.n_pad, length, channel)
        moving = acts.high_to_low.view(-1) >= 0
        if bool(moving.any()):
            mb, mh, ms = b[moving], h[moving], acts.high_to_low.view(-1)[moving]
            k, v, sc, ps = store.read(layer, HIGH, mb, mh, ms)
            store.drop(layer, HIGH, mb, mh, ms)
            store.insert(layer, LOW, mb, mh, k, v, ps, sc)
        for side, slots in ((HIGH, acts.prune_high), (LOW, acts.prune_low)):
            sel = slots.view(-1) >= 0
            if bool(sel.any()):
                store.drop(layer, side, b[sel], h[sel], slots.view(-1)[sel])
        if channel:
            self._seal_pending(layer, b, h, length)

    def _fastgen_step(self, layer: int) -> None:
        """Re-apply each head's frozen FastGen policy at the new length (Alg. 2): drop what it no longer keeps."""
        B, H = self.batch, self.store.num_kv_heads
        b = torch.arange(B, device=self.device).repeat_interleave(H)
        h = torch.arange(H, device=self.device).repeat(B)
        length = torch.full((B,), self.length[layer], device=self.device)
        is_special, is_punct = self._flags()
        for side in (HIGH, LOW):
            score, pos = (t.view(B, H, -1) for t in self.store.section_meta(layer, side, b, h))
            if pos.shape[-1] == 0:
                continue
            kept = fg.kept_sets(is_special, is_punct, score, pos, length, self.config.fastgen, self.n_pad)
            drop = fg.decode_evictions(self.fastgen_policy[layer], kept, pos)
            db, dh, ds = torch.nonzero(drop, as_tuple=True)
            if len(db):
                self.store.drop(layer, side, db, dh, ds)

    def _seal_pending(self, layer, b, h, length) -> None:
        """Per-channel low tier in decode: once an entry has a page worth of high tokens that belong low, move the
        least significant page of them into one new low page."""
        B, H = self.batch, self.store.num_kv_heads
        hi_s, hi_p = (t.view(B, H, -1) for t in self.store.section_meta(layer, HIGH, b, h))
        pending = pending_low(self.config.policy, hi_s, hi_p, self.n_pad, length)
        m = torch.where(pending, mean_score(hi_s, hi_p, length), torch.full_like(hi_s, float("inf")))
        for g in self.store.groups[layer]:
            T = g.layouts[LOW].tokens
            ready = pending[:, g.heads].sum(-1) >= T                                     # [B, Hg]
            if not bool(ready.any()):
                continue
            eb, eh = torch.nonzero(ready, as_tuple=True)
            gh = g.heads[eh]
            slots = m[eb, gh].argsort(-1)[:, :T]                                        # [e, T] least significant
            rb, rh = eb.repeat_interleave(T), gh.repeat_interleave(T)
            k, v, sc, ps = self.store.read(layer, HIGH, rb, rh, slots.reshape(-1))
            self.store.write_pages(layer, eb, gh, k.view(len(eb), T, -1), v.view(len(eb), T, -1),
                                   ps.view(len(eb), T), sc.view(len(eb), T))
            self.store.drop(layer, HIGH, rb, rh, slots.reshape(-1))

    # --------------------------------------------------------------------------------------------- accounting

    def tier_counts(self) -> dict[str, int]:
        """Tokens held per tier, summed over compressed layers, sequences and KV heads."""
        B, H = self.batch, self.store.num_kv_heads
        b = torch.arange(B, device=self.device).repeat_interleave(H)
        h = torch.arange(H, device=self.device).repeat(B)
        counts = {"high": 0, "low": 0}
        for layer in self.layers:
            for side, name in ((HIGH, "high"), (LOW, "low")):
                counts[name] += int((self.store.section_meta(layer, side, b, h)[1] >= 0).sum())
        return counts

    def release(self) -> int:
        return self.store.release()
