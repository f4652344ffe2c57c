"""FastGen's per-head compression patterns: which pattern each (sequence, KV head) uses, and which stored tokens it
keeps. `FastGenEviction` is the token policy (`cache_policy.CachePolicy`) that applies them to the store.

Based on FastGen (Ge et al., ICLR 2024), Eq. 1–2, Alg. 1–2.

The paper calls these patterns "compression policies"; kvcal says pattern, keeping "policy" for the cache's token
policies. Patterns are nested (Eq. 2; "+" is the union of what the components keep) and indexed 0..4:

    0 special | 1 special+punct | 2 special+punct+frequent | 3 special+punct+frequent+local | 4 full

At prefill each head takes the first pattern whose recovery (retained attention mass on the prompt) reaches T, else
full (Eq. 1; the cost is non-decreasing along the list, so the argmin is the first feasible one). The choice is frozen
for the rest of generation; at each decode step the head's kept set is recomputed with budgets relative to the current
length t (special, punctuation: all of them; frequent: top ⌈r_f·t⌉ by cumulative attention; local: the last ⌈r_l·t⌉)
and everything outside it is evicted for good. Patterns are per (sequence, KV head), not shared over the batch
(§7 item 10), and no "global" first tokens are kept beyond the special ones (§7 item 14: off, for fidelity).

GQA (the paper handles MHA only, §6b / §7 item 15): one KV head serves g query heads and everything is decided per
(sequence, KV head), so a key is kept for the KV head if kept for the group. Two aggregations, used consistently:
  * The cumulative score that ranks "frequent" tokens is the attention probability max over the g query heads, summed
    over queries (the same `score` the attention backends and the DiffKV policy track). A token that any head of the
    group relies on counts as frequent.
  * Recovery is aggregated by the MIN over the g query heads, per query row: rec = mean_i min_q Σ_{j∈S(i)} A_q[i, j].
    The strictest head decides, so rec ≥ T implies every query head of the group retains ≥ T of its mass on average,
    i.e. Eq. 1 holds for each query head as it would in MHA. Taking the min per row (rather than of the per-head
    means) keeps the quantity additive over row chunks (the caller sums chunks), and it reduces exactly to the
    paper's rule when g = 1. It is slightly stricter than min_q mean_i, so it errs towards keeping more.
  Max-aggregated probabilities are not used for recovery: they do not sum to 1 per row, so "retained mass ≥ T" would
  lose its meaning.

Everything here is pure tensor logic on flags, scores and cache indices (like `diffkv.py`); the cache moves bytes.
"""

from __future__ import annotations

import logging
import unicodedata
import weakref
from dataclasses import dataclass

import torch

from kvcal.runtime.backends.base import prefill_rows
from kvcal.runtime.policies.cache_policy import CachePolicy, Prompt, PromptAttention, register
from kvcal.runtime.policies.diffkv import TIER_PRUNED
from kvcal.runtime.storage.pages import HIGH, LOW

logger = logging.getLogger(__name__)

PATTERNS = ("special", "special+punct", "special+punct+frequent", "special+punct+frequent+local", "full")
FULL = 4                  # index of the full-cache fallback in PATTERNS
_COMPRESSED = FULL        # the first 4 patterns are the compressed candidates
# query rows a prompt's recovery averages over: every row of a prompt up to this length, evenly spaced rows (the last
# included) beyond it. Eq. 1 is a mean over rows; all of them would make FastGen's prefill cost grow with n^2 times
# the patterns' masks (minutes per sequence at 4k on a CPU) for a mean that 512 rows already estimate.
PROFILE_ROWS = 512


@dataclass(frozen=True)
class FastGenConfig:
    recovery: float = 0.95      # T: retained attention mass a compressed pattern must reach (paper §4.1; 0.91–0.98)
    r_local: float = 0.3        # local window as a fraction of the current length (paper §5 defaults)
    r_frequent: float = 0.3     # heavy-hitter budget as a fraction of the current length

    def __post_init__(self):
        if not 0.0 <= self.recovery <= 1.0:
            raise ValueError(f"`recovery={self.recovery}` (T) must be in [0, 1]")
        if not 0.0 <= self.r_local <= 1.0:
            raise ValueError(f"`r_local={self.r_local}` must be in [0, 1]")
        if not 0.0 <= self.r_frequent <= 1.0:
            raise ValueError(f"`r_frequent={self.r_frequent}` must be in [0, 1]")


# ---------------------------------------------------------------------------------------------- token classes

_CLASS_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_punct_text(text: str) -> bool:
    # §7 item 7: decoded text stripped of whitespace, non-empty, every character Unicode punctuation (categories P*).
    # Symbols ("$", "+", "=") are not punctuation; newline/space-only tokens strip to "" and are not punctuation;
    # pieces that merge punctuation with letters ("),a", "Ġthe.") are not; undecodable byte fragments decode to
    # U+FFFD (a symbol) and are not.
    s = text.strip()
    return bool(s) and all(unicodedata.category(ch).startswith("P") for ch in s)


def token_classes(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(special_ids, punct_ids), both int64 1-D sorted, for a Hugging Face tokenizer.

    Special (§7 item 6): `all_special_ids` plus every added token marked special (chat markers such as
    `<|im_start|>`, BOS/EOS/PAD). Multi-token specials cannot be expressed as ids and are not handled.
    Punctuation (§7 item 7): tokens whose decoded text, stripped of whitespace, is non-empty and all Unicode
    punctuation, so byte-level "Ġ." / "Ġ," and SentencePiece "▁." count. Special tokens are never punctuation.

    One batched decode over the vocabulary, cached per tokenizer object (recomputed if its length changes).
    """
    n_vocab = len(tokenizer)
    try:
        hit = _CLASS_CACHE.get(tokenizer)
    except TypeError:            # unhashable / not weak-referenceable: no cache
        hit = None
    if hit is not None and hit[0] == n_vocab:
        return hit[1], hit[2]
    special = set(int(i) for i in tokenizer.all_special_ids)
    for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            special.add(int(i))
    texts = tokenizer.batch_decode([[i] for i in range(n_vocab)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    punct = [i for i, t in enumerate(texts) if i not in special and _is_punct_text(t)]
    special_ids = torch.tensor(sorted(special), dtype=torch.int64)
    punct_ids = torch.tensor(punct, dtype=torch.int64)
    try:
        _CLASS_CACHE[tokenizer] = (n_vocab, special_ids, punct_ids)
    except TypeError:
        pass
    logger.debug("fastgen token classes: %s special, %s punctuation of %s", len(special_ids), len(punct_ids), n_vocab)
    return special_ids, punct_ids


def token_flags(token_ids: torch.Tensor, special_ids: torch.Tensor,
                punct_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids [B, n] -> (is_special [B, n] bool, is_punct [B, n] bool)."""
    dev = token_ids.device
    return (torch.isin(token_ids, special_ids.to(dev)), torch.isin(token_ids, punct_ids.to(dev)))


# ---------------------------------------------------------------------------------------------- budgets

def _budget(ratio: float, length: torch.Tensor) -> torch.Tensor:
    """⌈ratio · length⌉ as int64 (§7 item 3: ceil). The epsilon keeps exact products (0.3 · 10) from rounding up."""
    return torch.ceil(length.to(torch.float64) * ratio - 1e-9).clamp(min=0).to(torch.int64)


def _flags_at(flags: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """flags [B, N] by cache index (or [B, H, S] by slot) -> [B, H, S] for the stored tokens at pos [B, H, S]."""
    if flags.dim() == 3:
        return flags
    B, H, S = pos.shape
    idx = pos.clamp(min=0).reshape(B, H * S)
    return flags.gather(1, idx).view(B, H, S)


# ---------------------------------------------------------------------------------------------- kept sets

def kept_sets(is_special: torch.Tensor, is_punct: torch.Tensor, score: torch.Tensor, pos: torch.Tensor,
              length: torch.Tensor, cfg: FastGenConfig, n_pad: torch.Tensor | None = None) -> torch.Tensor:
    """Which stored tokens each compressed pattern keeps at current length t: bool [4, B, H, S], nested along dim 0.

    Args:
        is_special, is_punct: [B, N] bool by cache index (N > every pos), gathered through `pos`; or [B, H, S] bool
            per slot.
        score: [B, H, S] cumulative attention of each stored token (raw sum over the queries that saw it, max over
            the g query heads; §7 item 5: H2O-style raw sum, prompt column sums included).
        pos: [B, H, S] cache index of each slot, -1 = empty slot (never kept).
        length: [B] current cache length t, padding included; the new token, if any, is already counted.
        n_pad: [B] left padding (default 0); budgets use the real length t - n_pad.

    Budgets are relative to the current length (§2, §7 item 3: ⌈r·t⌉, ceil):
        frequent: top ⌈r_f·t⌉ by `score` among ALL valid stored tokens, specials and punctuation and the local
            window included (§7 item 4: union semantics, "+" in Eq. 2 unions independently selected sets; overlap
            wastes some budget, so the cache is smaller than with selection among not-yet-kept tokens). Ties go to
            the lower cache index.
        local: tokens with pos >= t - ⌈r_l·t⌉ (the most recent ⌈r_l·t⌉ positions; the window start only moves
            forward, so an evicted token never re-enters).
    """
    B, H, S = pos.shape
    valid = pos >= 0
    spec = _flags_at(is_special, pos) & valid
    punct = _flags_at(is_punct, pos) & valid
    pad = torch.zeros_like(length) if n_pad is None else n_pad.to(length.device)
    real = (length - pad).clamp(min=0)
    # rank: score descending, ties by lower pos; empty slots last. Two stable sorts: pos first, then score.
    big = torch.iinfo(torch.int64).max
    by_pos = torch.where(valid, pos.to(torch.int64), torch.full_like(pos, big, dtype=torch.int64)).argsort(
        dim=-1, stable=True)                                                         # [B, H, S]
    s = torch.where(valid, score.float(), torch.full_like(score, float("-inf"), dtype=torch.float32))
    s_sorted = s.gather(-1, by_pos)
    order = by_pos.gather(-1, s_sorted.argsort(dim=-1, descending=True, stable=True))  # slot of rank r
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(S, device=pos.device).expand(B, H, S))      # rank of slot s
    frequent = valid & (rank < _budget(cfg.r_frequent, real)[:, None, None])
    local = valid & (pos >= (length - _budget(cfg.r_local, real))[:, None, None])
    kept = torch.empty(_COMPRESSED, B, H, S, dtype=torch.bool, device=pos.device)
    kept[0] = spec
    kept[1] = kept[0] | punct
    kept[2] = kept[1] | frequent
    kept[3] = kept[2] | local
    return kept


# ---------------------------------------------------------------------------------------------- prompt profiling

def prompt_recovery(probs: torch.Tensor, rows: torch.Tensor | slice, is_special: torch.Tensor,
                    is_punct: torch.Tensor, final_score: torch.Tensor, cfg: FastGenConfig,
                    n_pad: torch.Tensor | None = None) -> torch.Tensor:
    """Retained prompt attention mass per compressed pattern, summed over one chunk of query rows: [4, B, H] float32.

    Args:
        probs: [B, H, g, c, n] causal prompt attention probabilities (softmax over keys, scaled, masked) of the
            chunk's query rows over the first n keys (n > every row: later keys get nothing); rows of padding queries
            are all zero.
        rows: [c] cache indices of the chunk's query rows (a slice is accepted).
        is_special, is_punct: [B, >= n] bool per key.
        final_score: [B, H, >= n] final prompt column sums (max over the g query heads), the frequent ranking
            (restricted to the first n keys it orders every row's prefix the same).
        n_pad: [B] left padding (default 0): keys j < n_pad are not tokens; budgets use real row lengths.

    The caller sums the result over all chunks and divides by the number of real query rows per sequence to get the
    recovery of Eq. 1. Decisions:
        §7 item 1: masked retained mass Σ_{j∈S(i)} A[i, j], not renormalised (the L1 distance to A is 1 - mass, so
            the constraint is mass ≥ T, matching Sec. 4.1), averaged over rows.
        §7 item 2: per-row budgets relative to the row length i+1: frequent = top ⌈r_f·(i+1)⌉ among keys j <= i by
            the FINAL column sums (ties: lower j), local = keys j >= i+1 - ⌈r_l·(i+1)⌉.
        §7 item 4: frequent selected among all keys (union), as in `kept_sets`.
        The query's own key counts only when a component keeps it (K_C = f(K, C) in Eq. 1). At decode the new token
            always attends to itself (§7 item 8), so this slightly under-estimates decode-time recovery.
        GQA: min over the g query heads per row (module docstring).
    Memory: a few [B, H, c, n] tensors besides `probs`; no [n, n].
    """
    B, H, g, c, n = probs.shape
    dev = probs.device
    is_special, is_punct, final_score = is_special[:, :n], is_punct[:, :n], final_score[..., :n]
    if isinstance(rows, slice):
        rows = torch.arange(n, device=dev)[rows]
    rows = rows.to(dev, torch.int64)
    pad = torch.zeros(B, dtype=torch.int64, device=dev) if n_pad is None else n_pad.to(dev, torch.int64)
    keys = torch.arange(n, device=dev)
    row_len = (rows[None, :] + 1 - pad[:, None]).clamp(min=0)                       # [B, c] real row lengths
    valid_key = keys[None, :] >= pad[:, None]                                       # [B, n]
    causal = (keys[None, :] <= rows[:, None])[None] & valid_key[:, None, :]         # [B, c, n]

    # frequent: global ranking (score desc, lower j first, padding last); key j is in row i's top-k iff j is in the
    # prefix and fewer than k prefix keys rank at or above it: a cumsum over ranks, no per-row sort.
    s = torch.where(valid_key[:, None, :], final_score.float(), torch.full_like(final_score, float("-inf"),
                                                                                 dtype=torch.float32))
    order = s.argsort(dim=-1, descending=True, stable=True)                         # [B, H, n] key of rank r
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, keys.expand(B, H, n))                                  # [B, H, n] rank of key j
    in_prefix = causal[:, None].expand(B, H, c, n).gather(-1, order[:, :, None, :].expand(B, H, c, n))  # rank space
    k_f = _budget(cfg.r_frequent, row_len)[:, None, :, None]                        # [B, 1, c, 1]
    top = in_prefix & (in_prefix.cumsum(-1, dtype=torch.int32) <= k_f)              # [B, H, c, n] rank space
    frequent = top.gather(-1, rank[:, :, None, :].expand(B, H, c, n))               # -> key space
    del in_prefix, top

    local = causal & (keys[None, None, :] >= (rows[None, :] + 1 - _budget(cfg.r_local, row_len))[:, :, None])
    special = causal & is_special.to(dev)[:, None, :]                               # [B, c, n]
    punct = causal & is_punct.to(dev)[:, None, :]

    # nested masks: each step adds only the newly kept keys, so the mass is exactly non-decreasing along the list
    p = probs.float()
    kept = torch.zeros(B, H, c, n, dtype=torch.bool, device=dev)
    mass = torch.zeros(B, H, g, c, device=dev)
    out = torch.empty(_COMPRESSED, B, H, device=dev)
    for i, component in enumerate((special[:, None], punct[:, None], frequent, local[:, None])):
        add = component & ~kept                                                     # [B, H, c, n]
        kept = kept | add
        mass = mass + torch.einsum("bhgcn,bhcn->bhgc", p, add.to(p.dtype))
        out[i] = mass.amin(dim=2).sum(-1)                                           # min over g, sum over rows
    return out


def profile_rows(n: int, device=None) -> torch.Tensor:
    """The query rows (int64, increasing) whose recovery FastGen averages for a prompt of n tokens: all of them up to
    `PROFILE_ROWS`, else `PROFILE_ROWS` evenly spaced ones ending at the last row."""
    if n <= PROFILE_ROWS:
        return torch.arange(n, device=device)
    return torch.linspace(0, n - 1, PROFILE_ROWS, device=device, dtype=torch.float64).round().to(torch.int64)


def choose_pattern(recovery: torch.Tensor, cfg: FastGenConfig) -> torch.Tensor:
    """recovery [4, B, H] -> pattern int64 [B, H]: the first pattern with recovery >= T (earlier wins ties, Eq. 1 with
    nested costs), else 4 (full). NaN recovery (a head never profiled) never passes, so it falls back to full."""
    ok = recovery >= cfg.recovery                                                   # [4, B, H]
    first = ok.to(torch.int8).argmax(dim=0)                                         # first True (0 if none)
    return torch.where(ok.any(dim=0), first.to(torch.int64), torch.full_like(first, FULL, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------- decode

def decode_evictions(pattern: torch.Tensor, kept: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Stored tokens to drop now: bool [B, H, S].

    pattern [B, H] int64 in 0..4 (frozen at prefill, Alg. 2); kept [4, B, H, S] from `kept_sets` at the current
    length; pos [B, H, S] (-1 = empty). A head drops its valid tokens outside its pattern's kept set; full heads drop
    nothing. Order at each step (the caller's, §7 item 8): append the new token, attend over the kept cache plus the
    new token (so it sees itself), add the probabilities to the scores, then `kept_sets` and these evictions; a
    non-special new token on a special-only head is thus used once and dropped.
    """
    B, H, S = pos.shape
    full = pattern >= FULL
    idx = pattern.clamp(0, _COMPRESSED - 1)[None, :, :, None].expand(1, B, H, S)
    keep = kept.gather(0, idx)[0]                                                   # [B, H, S]
    return (pos >= 0) & ~keep & ~full[..., None]


# ---------------------------------------------------------------------------------------------- the cache policy


@register("fastgen", config=FastGenConfig)
class FastGenEviction(CachePolicy):
    """FastGen as a cache policy. It owns its state: the token ids of the cache by index (`observe_tokens`, fed by
    whoever runs the model: `KvcalCache` through a decoder pre-hook), the tokenizer's special and punctuation ids
    (`kv.token_classes`, fixed at construction) and the pattern each (layer, sequence, KV head) chose at prefill
    (`choice`). At prefill, each head takes the cheapest pattern whose recovery of the prompt's attention
    reaches T and drops what it does not keep (pruned whatever its tier); each decode token re-applies that frozen
    pattern at the new length (Alg. 2)."""

    def __init__(self, kv):
        super().__init__(kv)
        self.token_ids = torch.zeros(kv.batch, 0, dtype=torch.int64, device=kv.device)
        none = torch.zeros(0, dtype=torch.int64)
        special, punct = kv.token_classes if kv.token_classes is not None else (none, none)
        self.special, self.punct = special.to(kv.device), punct.to(kv.device)
        self.choice: dict[int, torch.Tensor] = {}        # layer -> [B, H] index into PATTERNS

    def select_rows(self, index: torch.Tensor) -> None:
        self.token_ids = self.token_ids[index]
        self.choice = {layer: c[index] for layer, c in self.choice.items()}

    def crop(self, length: int) -> None:
        self.token_ids = self.token_ids[:, :length]

    def observe_tokens(self, ids: torch.Tensor) -> None:
        """Token ids [B, n] of the tokens this forward pass adds."""
        self.token_ids = torch.cat([self.token_ids, ids.to(self.kv.device)], dim=1)

    def _flags(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(is_special, is_punct) [B, >= n] by cache index, for a cache of n tokens."""
        if self.token_ids.shape[1] < n:
            raise ValueError("FastGen needs the token ids of every cached token: call the model with `input_ids` (not "
                             "`inputs_embeds`) through a cache made by `KvcalCache.from_bundle(..., tokenizer=...)`")
        return token_flags(self.token_ids, self.special, self.punct)

    def prompt_statistics(self, attention: PromptAttention, real, score) -> torch.Tensor:
        """FastGen Eq. 1 on this prompt: recovery [4, B, H] of each compressed pattern, the mean over `profile_rows`
        of the real query rows. It needs the final column sums (the ranking of frequent tokens) before it can read
        any row, so it recomputes the rows' probabilities after the prefill, a block of rows at a time."""
        B, H, g, n, d = attention.query.shape
        is_special, is_punct = self._flags(n)
        n_pad = (~real).sum(-1)
        rows = profile_rows(n, attention.query.device)
        total = torch.zeros(4, B, H, device=attention.query.device)
        step = prefill_rows(B, H, g, n)
        for start in range(0, len(rows), step):
            block = rows[start:start + step]
            total += prompt_recovery(attention.probs(block), block, is_special, is_punct, score,
                                     self.kv.config.fastgen, n_pad)
        real_rows = (rows[None, :] >= n_pad[:, None]).sum(-1)                              # [B]
        return total / real_rows.clamp(min=1).to(total.dtype)[None, :, None]

    def prefill(self, layer: int, tier: torch.Tensor, prompt: Prompt) -> torch.Tensor:
        recovery = prompt.statistics.get(self.name)
        if recovery is None:
            raise ValueError("FastGen is on but this prefill has no recovery statistics (record with FastGen on)")
        cfg, n = self.kv.config.fastgen, prompt.pos.shape[-1]
        self.choice[layer] = choose_pattern(recovery, cfg)                                 # [B, H]
        is_special, is_punct = self._flags(n)
        kept = kept_sets(is_special[:, :n], is_punct[:, :n], prompt.score, prompt.pos, prompt.length, cfg,
                         self.kv.n_pad)
        drop = decode_evictions(self.choice[layer], kept, prompt.pos)
        return torch.where(drop, torch.full_like(tier, TIER_PRUNED), tier)

    def decode(self, layer: int) -> None:
        kv = self.kv
        B, H = kv.batch, kv.store.num_kv_heads
        b, h = kv.every_entry()
        length = torch.full((B,), kv.length[layer], device=kv.device)
        is_special, is_punct = self._flags(kv.length[layer])
        for side in (HIGH, LOW):
            score, pos = (t.view(B, H, -1) for t in kv.store.section_meta(layer, side, b, h))
            if pos.shape[-1] == 0:
                continue
            kept = kept_sets(is_special, is_punct, score, pos, length, kv.config.fastgen, kv.n_pad)
            drop = decode_evictions(self.choice[layer], kept, pos)
            db, dh, ds = torch.nonzero(drop, as_tuple=True)
            if len(db):
                kv.store.drop(layer, side, db, dh, ds)
