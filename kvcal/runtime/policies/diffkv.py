"""DiffKV's token tiering: which tokens stay high precision, which go low, which are pruned (DiffKV §4, Algorithm 1).

`TieringConfig` holds its settings (window and thresholds, `CompressionConfig.tiering`); `DiffKVTiers` is the token
policy (`cache_policy.CachePolicy`) that applies them to the store.

Significance of a token = the attention probability it received, averaged over the queries that could see it. For
GQA the probability is the max over the query heads of the KV head, per query, accumulated in both phases. The store
keeps the running sum (`score`) per token; the mean is score / (N - i) for a token at cache index i in a cache of N
tokens (every query at or after i saw it).

Thresholds are relative to uniform attention:
    high if mean >= alpha_high / base,  low if alpha_low / base <= mean < alpha_high / base,  pruned otherwise.
`threshold_base="length"` uses base = N, the sequence's real length (DiffKV's calibration text and Algorithm 1);
`"position"` uses base = i + 1, the token's own 1-based position (DiffKV §4 as printed, "1/i"). The most recent
`window` tokens are always high and never victims.

Decode (one new token per step): the token that just left the window, t_c, is placed; then the least significant
token of the section t_c entered is downgraded one level (high -> low re-quantized, low -> pruned) if it falls below
that section's threshold. With per-channel keys in the low tier, low pages are written a whole page at a time, so the
high -> low move is batched: tokens classified low wait at high precision (never worse than Algorithm 1) until a page
of them exists. Everything here is pure tensor logic on scores and positions; the store moves the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.runtime.policies.cache_policy import CachePolicy, Prompt, register
from kvcal.runtime.storage.pages import HIGH, LOW

TIER_HIGH, TIER_LOW, TIER_PRUNED = 0, 1, 2   # a token's tier (page-table sides are pages.HIGH / LOW)
# an alpha_high no token's significance reaches (mean attention >= 1e9 / N): every token that leaves the window goes
# to the low tier, as in KIVI. A finite number, so the settings block stays plain JSON
EVERY_TOKEN_LOW = 1e9


@dataclass(frozen=True)
class TieringConfig:
    """DiffKV's tiering settings; `alpha_high=None` turns tiering off (every token stays high)."""

    window: int = 64                    # most recent tokens always high (DiffKV W)
    alpha_high: float | None = None     # None: no tiering, every token stays high
    alpha_low: float = 0.0              # 0: nothing is pruned
    threshold_base: str = "length"      # "length" (alpha / N) or "position" (alpha / (i + 1))

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"`window={self.window}` must be >= 1")
        if self.threshold_base not in ("length", "position"):
            raise ValueError(f"`threshold_base={self.threshold_base}` must be `length` or `position`")
        if self.alpha_high is not None and not 0 <= self.alpha_low <= self.alpha_high:
            raise ValueError(f"need 0 <= alpha_low <= alpha_high (got {self.alpha_low}, {self.alpha_high})")

    @property
    def tiered(self) -> bool:
        return self.alpha_high is not None

    def thresholds(self, pos: torch.Tensor, n_pad: torch.Tensor, length: torch.Tensor):
        """pos [B, H, S] cache indices, n_pad [B] left-padding, length [B] cache length -> (tau_high, tau_low),
        each broadcastable to [B, H, S]."""
        if self.threshold_base == "length":
            base = (length - n_pad).clamp(min=1).to(torch.float32)[:, None, None]
        else:
            base = (pos - n_pad[:, None, None] + 1).clamp(min=1).to(torch.float32)
        return self.alpha_high / base, self.alpha_low / base


def mean_score(score: torch.Tensor, pos: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """score, pos [B, H, S]; length [B] -> mean probability per query that saw the token (inf for empty slots, so
    they are never chosen as the least significant)."""
    seen = (length[:, None, None] - pos).clamp(min=1).to(torch.float32)
    return torch.where(pos >= 0, score / seen, torch.full_like(score, float("inf")))


def classify_prompt(tiering: TieringConfig, score: torch.Tensor, pos: torch.Tensor, n_pad: torch.Tensor,
                    length: torch.Tensor) -> torch.Tensor:
    """Prompt-phase tiers: score, pos [B, H, S] (pos -1 = not a token) -> tier int8 [B, H, S], TIER_* labels."""
    tier = torch.full(pos.shape, TIER_HIGH, dtype=torch.int8, device=pos.device)
    if not tiering.tiered:
        return tier
    m = mean_score(score, pos, length)
    tau_h, tau_l = tiering.thresholds(pos, n_pad, length)
    in_window = pos >= (length[:, None, None] - tiering.window)
    tier[(m < tau_h) & ~in_window] = TIER_LOW
    tier[(m < tau_l) & ~in_window] = TIER_PRUNED
    tier[pos < 0] = TIER_PRUNED
    return tier


@dataclass
class DecodeActions:
    """Per (sequence, KV head) slot indices into the high / low sections; -1 = no action. All [B, H] int64."""

    high_to_low: torch.Tensor      # re-quantize this high token into the low section
    prune_high: torch.Tensor       # drop this high token
    prune_low: torch.Tensor        # drop this low token


def _argmin(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin over the last dim among `mask`; returns (index [..], value [..]) with value inf where mask is empty."""
    if values.shape[-1] == 0:
        return (torch.zeros(values.shape[:-1], dtype=torch.long, device=values.device),
                torch.full(values.shape[:-1], float("inf"), device=values.device))
    masked = torch.where(mask, values, torch.full_like(values, float("inf")))
    val, idx = masked.min(dim=-1)
    return idx, val


def decode_actions(tiering: TieringConfig, hi_score, hi_pos, lo_score, lo_pos, n_pad, length,
                   per_channel_low: bool) -> DecodeActions:
    """Algorithm 1 for one decode step, vectorized over [B, H].

    hi_*, lo_* [B, H, S_*]: scores and cache indices of the high and low sections (pos -1 = empty slot), after the
    new token was appended and scores were updated; length [B] = cache length including the new token. The
    candidate t_c is the token at index length - window - 1.
    """
    B, H, _ = hi_pos.shape
    none = torch.full((B, H), -1, dtype=torch.long, device=hi_pos.device)
    actions = DecodeActions(none.clone(), none.clone(), none.clone())
    if not tiering.tiered or hi_pos.shape[-1] == 0:
        return actions
    L = length[:, None, None]
    hi_mean, lo_mean = mean_score(hi_score, hi_pos, length), mean_score(lo_score, lo_pos, length)
    hi_tau_h, hi_tau_l = (t.expand_as(hi_mean) for t in tiering.thresholds(hi_pos, n_pad, length))
    lo_tau_h, lo_tau_l = (t.expand_as(lo_mean) for t in tiering.thresholds(lo_pos, n_pad, length))
    eligible = (hi_pos >= 0) & (hi_pos < L - tiering.window)
    is_c = hi_pos == (L - tiering.window - 1)
    has_c = is_c.any(-1)                                                   # [B, H]; False while N <= window
    c_slot = is_c.to(torch.int8).argmax(-1)
    pick = lambda t: t.gather(-1, c_slot[..., None]).squeeze(-1)           # noqa: E731
    c_mean, c_tau_h, c_tau_l = pick(hi_mean), pick(hi_tau_h), pick(hi_tau_l)
    c_high, c_low = has_c & (c_mean >= c_tau_h), has_c & (c_mean >= c_tau_l) & (c_mean < c_tau_h)
    c_prune = has_c & (c_mean < c_tau_l)
    actions.prune_high = torch.where(c_prune, c_slot, none)

    # a low candidate waits at high precision until a whole per-channel page of them exists (the store decides)
    v_slot, v_mean = _argmin(hi_mean, eligible & ~(is_c & c_prune[..., None]))
    pick_v = lambda t: t.gather(-1, v_slot[..., None]).squeeze(-1)         # noqa: E731
    v_tau_h, v_tau_l = pick_v(hi_tau_h), pick_v(hi_tau_l)
    if per_channel_low:
        # the least significant eligible high token is pruned if it falls below the low threshold
        actions.prune_high = torch.where(~c_prune & (v_mean < v_tau_l), v_slot, actions.prune_high)
    else:
        # t_c high: downgrade the high victim one level; t_c low: t_c itself moves down
        victim = c_high & torch.isfinite(v_mean)
        actions.high_to_low = torch.where(victim & (v_mean >= v_tau_l) & (v_mean < v_tau_h), v_slot, none)
        actions.prune_high = torch.where(victim & (v_mean < v_tau_l), v_slot, actions.prune_high)
        actions.high_to_low = torch.where(c_low, c_slot, actions.high_to_low)
    # t_c entered the low section: its least significant token is pruned if below the low threshold. t_c itself is
    # at or above that threshold, so it is never this victim.
    if lo_pos.shape[-1]:
        lo_slot, lo_val = _argmin(lo_mean, lo_pos >= 0)
        lo_tau_l_v = lo_tau_l.gather(-1, lo_slot[..., None]).squeeze(-1)
        actions.prune_low = torch.where(c_low & (lo_val < lo_tau_l_v), lo_slot, none)
    return actions


def pending_low(tiering: TieringConfig, hi_score, hi_pos, n_pad, length, mean=None, taus=None) -> torch.Tensor:
    """Per-channel low tier: bool [B, H, S_high], eligible high tokens that belong in the low tier. mean: their
    `mean_score` and taus: `tiering.thresholds` of them, when the caller has them already."""
    if not tiering.tiered:
        return torch.zeros_like(hi_pos, dtype=torch.bool)
    m = mean_score(hi_score, hi_pos, length) if mean is None else mean
    tau_h, tau_l = tiering.thresholds(hi_pos, n_pad, length) if taus is None else taus
    eligible = (hi_pos >= 0) & (hi_pos < length[:, None, None] - tiering.window)
    return eligible & (m < tau_h) & (m >= tau_l)


# ---------------------------------------------------------------------------------------------- the cache policy


@register("diffkv")
class DiffKVTiers(CachePolicy):
    """DiffKV's tiers as a cache policy: the prompt is tiered by `classify_prompt`; each decode token runs one step
    of Algorithm 1 (`decode_actions`), and with per-channel low keys, seals a whole low page once one is pending."""

    _step: tuple | None = None    # (cache length, n_pad, length [B], thresholds): the same for every layer of a step

    @property
    def reads_scores(self) -> bool:
        return self.kv.config.tiering.tiered

    def _step_constants(self, n: int) -> tuple[torch.Tensor, tuple | None]:
        """(length [B] filled with the cache length n, the "length"-based thresholds or None): made once per decode
        step, not once per layer (every layer has the same length and padding)."""
        kv, tiering = self.kv, self.kv.config.tiering
        if self._step is None or self._step[0] != n or self._step[1] is not kv.n_pad:
            length = torch.full((kv.batch,), n, device=kv.device)
            taus = tiering.thresholds(None, kv.n_pad, length) if tiering.threshold_base == "length" else None
            self._step = (n, kv.n_pad, length, taus)
        return self._step[2], self._step[3]

    def prefill(self, layer: int, tier: torch.Tensor, prompt: Prompt) -> torch.Tensor:
        return classify_prompt(self.kv.config.tiering, prompt.score, prompt.pos, self.kv.n_pad, prompt.length)

    def decode(self, layer: int) -> None:
        kv, tiering = self.kv, self.kv.config.tiering
        if not tiering.tiered or kv.length[layer] <= tiering.window:
            return
        B, H = kv.batch, kv.store.num_kv_heads
        store = kv.store
        b, h = kv.every_entry()
        length, taus = self._step_constants(kv.length[layer])
        channel = kv.config.low.k_mode == "channel"
        if channel and tiering.alpha_low == 0:
            # nothing is ever pruned and per-channel low pages are written whole: Algorithm 1's actions are all
            # empty (`decode_actions`), only the pending low page matters, and most steps none is due
            if kv.backend.low_pages_due(store, layer, kv.n_pad, kv.length[layer], tiering):
                hi_s, hi_p = (t.view(B, H, -1) for t in store.section_meta(layer, HIGH, b, h))
                self._seal_pending(layer, b, h, length, hi_s, hi_p, taus)
            return
        hi_s, hi_p = (t.view(B, H, -1) for t in store.section_meta(layer, HIGH, b, h))
        if kv.config.low_tracked:
            lo_s, lo_p = (t.view(B, H, -1) for t in store.section_meta(layer, LOW, b, h))
        else:                                   # nothing is pruned: no low token is ever a victim
            lo_s, lo_p = hi_s[..., :0], hi_p[..., :0]
        acts = decode_actions(tiering, hi_s, hi_p, lo_s, lo_p, kv.n_pad, length, channel)
        moving = acts.high_to_low.view(-1) >= 0
        changed = bool(moving.any()) or bool((acts.prune_high >= 0).any()) or bool((acts.prune_low >= 0).any())
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
            if changed:
                hi_s, hi_p = (t.view(B, H, -1) for t in store.section_meta(layer, HIGH, b, h))
            self._seal_pending(layer, b, h, length, hi_s, hi_p, taus)

    def _seal_pending(self, layer, b, h, length, hi_s, hi_p, taus=None) -> None:
        """Per-channel low tier in decode: once an entry has a page worth of high tokens that belong low, move the
        least significant page of them into one new low page and close the holes they leave (`Scores.compact`).
        hi_s, hi_p [B, H, S]: the high section's scores and positions as they are now; taus: their thresholds when
        the caller has them (`_step_constants`)."""
        kv, store = self.kv, self.kv.store
        mean = mean_score(hi_s, hi_p, length)
        pending = pending_low(kv.config.tiering, hi_s, hi_p, kv.n_pad, length, mean, taus)
        m = None
        for g in store.groups[layer]:
            T = g.layouts[LOW].tokens
            mine = pending if len(g.heads) == pending.shape[1] else pending[:, g.heads]  # one group: all the heads
            ready = mine.sum(-1) >= T                                                    # [B, Hg]
            if not bool(ready.any()):
                continue
            if m is None:           # most steps seal nothing: the ranking key is made only when a page is due
                m = torch.where(pending, mean, torch.full_like(hi_s, float("inf")))
            eb, eh = torch.nonzero(ready, as_tuple=True)
            gh = g.heads[eh]
            slots = m[eb, gh].argsort(-1)[:, :T]                                        # [e, T] least significant
            store.seal_low_pages(layer, eb, gh, slots)  # a page of holes at once: closed, the emptied pages freed
