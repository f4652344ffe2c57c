"""Predicted quality: the loss any choice of formats adds, per (layer, KV head, K or V), from one recording.

The search's recording (kvcal.profile.recording) gives, for every layer, the post-RoPE keys and values the cache
holds at the deployment context and their gradients g = dL/dK, dL/dV, where L is the next-token loss summed over the
scored continuation, read through the dense prompt as the runtime's decode reads it. Coding x as x + δ adds about
½ Σ g² δ² to L (second order, diagonal empirical Fisher, as KVQuant weights its codebooks). For every format of the
catalogue, δ is the runtime's own coding error in the served bases (g and x rotate with them), applied to the tokens
that format would hold under the base settings:

- a paged layer holds in its low tier every token that leaves the window before the last scored query and is not a
  heavy hitter; the others stay in the high tier. Heavy hitters follow the runtime's rule (kvcal.runtime.policies.
  diffkv, threshold base "length"): a token is one while its mean attention (summed over the queries that saw it,
  max over a KV head's query heads, divided by their number) reaches alpha / N in a cache of N tokens. A prompt token
  out of the window at prefill is placed by its prefill mean against alpha / P, and a heavy hitter then is demoted
  (the policy's pending low tokens, sealed a page at a time) when its mean over every query, continuation included,
  falls below alpha / S; a token that leaves the window during the continuation is placed by that end mean too. The
  end state is modelled, not the steps: a token the runtime demoted while its mean dipped is high here if it
  recovered. The threshold alpha is a choice of the allocation
  (`ALPHAS`), one for every layer, like the high tier's format (`HIGH`). A token's gradient sums only the queries
  after it, so a token that ages into the low tier during the scored continuation is weighted by the queries that read
  it there, plus its first `window` ones (a small overcount);
- unless the settings hold the window exact (`exact_window`, the search's frame), the runtime writes every new
  token to the high tier, so the scored queries read the tokens of their window in the high tier's format: those
  tokens are charged its coding error too (weighted by their whole gradient, most of which their window's queries
  give), which is 0 for a 16-bit high tier;
- a sliding-window layer holds every token in its sliding format but the newest ones each query reads exact with
  its own (`first_exact`: its `sliding_recent` ones, and with per-channel keys the block still filling). Its
  recorded gradients sum only the queries that read a token coded (kvcal.profile.recording), since half of a
  512-token window's tokens are the continuation's own and a local layer's queries weigh their newest keys most;
  the tokens no query reads coded have g = 0.

Pruned tokens (alpha_low > 0) and FastGen's per-prompt policies are not modelled: the base settings must not use
them. The predicted loss of an assignment is a sum of table entries, computed without running the model:

    costs[l, h, s, b, a]   float64 [L, H, 2, len(BITS), len(ALPHAS)]   ½ Σ g² δ² with side s (0: K, 1: V) of layer
                                       l's format at BITS[b] bits, heavy hitters at ALPHAS[a], summed over windows,
                                       tokens, coordinates
    predicted(bits, high, a) = Σ_l,h,s costs[l, h, s, index of bits[l, h, s], a] + the high tier's table
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcal.runtime.backends.cpu import coding
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.storage import quant
from kvcal.runtime.storage.bases import ServedBases
from kvcal.runtime.storage.layout import RAW_BITS, PageLayout, TierFormat

BITS = (8, 4, 2)              # the catalogue: bits per side of a layer's low-tier or sliding format, widest first
HIGH = ("K16V16", "K8V8")     # and of the high tier (heavy hitters out of the window), one for every paged layer
# and the heavy-hitter threshold alpha (mean attention >= alpha / N keeps a token in the high tier), one for every
# paged layer, on a doubling grid
ALPHAS = (8.0, 16.0, 32.0, 64.0, 128.0)
BASE_ALPHA = 1                # ALPHAS[BASE_ALPHA]: the base settings' threshold (kvcal.profile.allocate)
SIDES = ("k", "v")
# bit widths whose codes index calibrated levels (fitted from the recording, `fit_layer_levels`) in paged layers; 8
# bits have enough uniform steps, and sliding layers are served uniform
LEVELED = (4, 2)


def layer_format(base: CompressionConfig, sliding: bool, k_bits: int, v_bits: int) -> TierFormat:
    """The format a layer's tokens are coded in with (k_bits, v_bits): the base's low tier (a paged layer) or its
    sliding format, with other bits; a paged layer's sides at `LEVELED` bits index calibrated levels."""
    fmt = base.sliding if sliding else base.low
    level = lambda bits: "calibrated" if not sliding and bits in LEVELED else "uniform"      # noqa: E731
    return dataclasses.replace(fmt, k_bits=k_bits, v_bits=v_bits, k_levels=level(k_bits), v_levels=level(v_bits))


def key_block(base: CompressionConfig, fmt: TierFormat, head_dim: int, sliding: bool) -> int:
    """Tokens that share a per-channel key's (scale, zero) in `fmt`: a paged layer's page of low tokens, a sliding
    layer's block (`CompressionConfig.sliding_block`, kvcal.runtime.hf.sliding)."""
    if sliding:
        return base.sliding_block
    return PageLayout.build(fmt, head_dim, head_dim, base.page_size(head_dim), base.low_tracked).tokens


def side_bytes(fmt: TierFormat, side: str, head_dim: int, base: CompressionConfig, sliding: bool) -> float:
    """Bytes one token of one KV head costs on `side` in `fmt` (a paged layer's low tier or a sliding layer's
    format, in `base`'s pages): codes, its (scale, zero) pairs, and for per-channel keys its share of the page's
    (or block's) per-channel pairs. A sliding layer's unquantized newest tokens (the part of a key block still
    filling) are not in it, as a page's slack is not."""
    layout = PageLayout.build(fmt, head_dim, head_dim, base.page_size(head_dim), base.low_tracked and not sliding)
    if side == "k":
        per_channel = fmt.k_mode == "channel"
        block = key_block(base, fmt, head_dim, sliding) if per_channel else 1
        return layout.k_bytes + fmt.meta_pair_bytes * (layout.k_groups + per_channel * head_dim / block)
    return layout.v_bytes + fmt.meta_pair_bytes * layout.v_groups


@dataclass
class FormatCosts:
    """The quality model's table and what it needs to price a choice (module docstring)."""

    costs: torch.Tensor          # float64 [L, H, 2, len(BITS), len(ALPHAS)]
    bytes: torch.Tensor          # float64 [L, 2, len(BITS)]: bytes per held token, summed over KV heads (an H-th
                                 # each: the allocated formats store every head at full rank)
    tokens: torch.Tensor         # float64 [L, len(ALPHAS)]: tokens each layer holds in the allocated format (per KV
                                 # head, mean)
    sliding: list[bool]          # per layer
    high_costs: torch.Tensor     # float64 [L, H, 2, len(HIGH), len(ALPHAS)]: ½ Σ g² δ² of the tokens read in the
                                 # high tier (its heavy hitters, the scored queries' windows) in each format
    high_bytes: torch.Tensor     # float64 [L, 2, len(HIGH)]: bytes per high-tier token, summed over KV heads
    high_tokens: torch.Tensor    # float64 [L, len(ALPHAS)]: tokens each layer holds in its high tier (per KV head)

    def per_head(self, bits: torch.Tensor) -> torch.Tensor:
        """bits long [L, 2] (every KV head of a layer alike) or [L, H, 2] -> [L, H, 2]."""
        return bits[:, None].expand(-1, self.costs.shape[1], -1) if bits.dim() == 2 else bits

    def head_bytes(self) -> torch.Tensor:
        """float64 [L, H, 2, len(BITS)]: bytes per held token of each KV head."""
        H = self.costs.shape[1]
        return (self.bytes / H)[:, None].expand(-1, H, -1, -1)

    def predicted(self, bits: torch.Tensor, high: int = 0, alpha: int = BASE_ALPHA) -> float:
        """bits long [L, H, 2] or [L, 2] (`per_head`; entries of BITS), high tier HIGH[high], heavy hitters at
        ALPHAS[alpha] -> the loss the assignment adds (½ Σ g² δ²)."""
        low = self.costs[..., alpha].gather(-1, self.index(self.per_head(bits))[..., None]).sum()
        return float(low + self.high_costs[..., high, alpha].sum())

    def held_bytes(self, bits: torch.Tensor, high: int = 0, alpha: int = BASE_ALPHA) -> float:
        """bits long [L, H, 2] or [L, 2], high tier HIGH[high], heavy hitters at ALPHAS[alpha] -> bytes the allocated
        formats hold at the recorded context."""
        per_token = self.head_bytes().gather(-1, self.index(self.per_head(bits))[..., None])[..., 0]   # [L, H, 2]
        high_part = self.high_bytes[..., high] * self.high_tokens[:, alpha, None]
        return float((per_token * self.tokens[:, alpha, None, None]).sum() + high_part.sum())

    @staticmethod
    def index(bits: torch.Tensor) -> torch.Tensor:
        lookup = torch.full((max(BITS) + 1,), -1, dtype=torch.long)
        lookup[list(BITS)] = torch.arange(len(BITS))
        return lookup[bits]


def coded_keys(k: torch.Tensor, fmt: TierFormat, page_tokens: int, levels: torch.Tensor | None = None) -> torch.Tensor:
    """k float32 [H, S, r] in the served basis -> as `fmt` stores it: per-channel over whole pages of `page_tokens`
    tokens (a last partial page stays raw, as its tokens would wait in the high tier), or per token. levels [H, 2**b]:
    the calibrated levels of a format whose keys use them (`TierFormat.k_levels`)."""
    return _coded(k, fmt, "k", page_tokens, levels)


def coded_values(v: torch.Tensor, fmt: TierFormat, levels: torch.Tensor | None = None) -> torch.Tensor:
    """v float32 [H, S, r] in the served basis -> as `fmt` stores it (per token, groups of `v_group` channels).
    levels [H, 2**b]: the calibrated levels of a format whose values use them (`TierFormat.v_levels`)."""
    return _coded(v, fmt, "v", 1, levels)


def coding_errors(x: torch.Tensor, g2: torch.Tensor, fmt: TierFormat, side: str, page_tokens: int,
                  levels: torch.Tensor | None = None) -> torch.Tensor:
    """Σ g² δ² per token of side `side` of x float32 [H, S, r] coded as `coded_keys` / `coded_values` code it, g2
    float64 [H, S, r] -> float64 [H, S] (0 for a raw format, and for the raw tail of per-channel keys)."""
    return _coded(x, fmt, side, page_tokens, levels, g2)


def _coded(x: torch.Tensor, fmt: TierFormat, side: str, page_tokens: int, levels: torch.Tensor | None,
           g2: torch.Tensor | None = None) -> torch.Tensor:
    """`coded_keys` or `coded_values` (g2 None), or `coding_errors`."""
    bits, mode = (fmt.k_bits, fmt.k_mode) if side == "k" else (fmt.v_bits, "token")
    H, S, r = x.shape
    if bits in RAW_BITS:
        return x if g2 is None else torch.zeros(H, S, dtype=torch.float64)
    lut = _levels(fmt.k_levels if side == "k" else fmt.v_levels, levels)              # [H, 1, K] or None
    if mode == "channel":
        n = S - S % page_tokens
        pages = x[:, :n].reshape(H, n // page_tokens, page_tokens, r)
        out = _round_trip(pages, bits, fmt.meta_bits, None if lut is None else lut[:, None], True, None,
                          None if g2 is None else g2[:, :n].reshape(pages.shape))
        if g2 is None:
            return torch.cat([out.reshape(H, n, r), x[:, n:]], dim=1)
        return torch.cat([out.reshape(H, n), torch.zeros(H, S - n, dtype=torch.float64)], dim=1)
    if mode == "token":
        return _round_trip(x, bits, fmt.meta_bits, lut, False, fmt.k_group if side == "k" else fmt.v_group, g2)
    raise ValueError(f"no prediction for {mode} keys")


def _round_trip(x: torch.Tensor, bits: int, meta_bits: int, levels: torch.Tensor | None, channel: bool,
                group: int | None, g2: torch.Tensor | None) -> torch.Tensor:
    """x [..., T, n] coded per channel over T or per token (quant's round trips) -> float32 [..., T, n], or with g2
    each token's Σ g2 δ², float64 [..., T]. By the CPU kernels where they load (one pass; equal codes, values to the
    rounding of one multiply-add), else by quant's torch reference."""
    if x.device.type == "cpu" and coding.available():
        return coding.round_trip(x, bits, meta_bits, levels, channel=channel, group=group, g2=g2)
    coded = (quant.round_trip_per_channel(x, bits, meta_bits, levels) if channel
             else quant.round_trip_per_token(x, bits, group, meta_bits, levels))
    return coded if g2 is None else (g2 * (coded - x).double() ** 2).sum(-1)


def _levels(kind: str, levels: torch.Tensor | None) -> torch.Tensor | None:
    """levels [H, K] -> [H, 1, K] for a calibrated side (one row per KV head, broadcast over tokens); None for a
    uniform one."""
    if kind != "calibrated":
        return None
    if levels is None:
        raise ValueError("a format with calibrated levels needs them: fit them first (`fit_layer_levels`)")
    return levels[:, None]


@torch.no_grad()
def fit_layer_levels(kv: tuple, grads: tuple, held: torch.Tensor, served: ServedBases, base: CompressionConfig,
                     layer: int, head_dim: int, samples: int = 1 << 15) -> dict[tuple[str, int], torch.Tensor]:
    """Calibrated levels of a paged layer's formats at every bit width of `LEVELED`, per KV head -> {(side, bits):
    float32 [H, 2**bits]}: weighted 1-D k-means (`codebooks.fit_levels`) on the held tokens' normalised codes (as
    the store normalises them: per-channel key pages, per-token values), each weighted by g² step², its share of
    ½ Σ g² δ² per unit of code error. kv, grads: key and value [1, H, S, d] and their gradients; held bool [H, S].
    At most `samples` evenly strided samples per fit."""
    from kvcal.profile.codebooks import fit_levels

    out: dict[tuple[str, int], torch.Tensor] = {}
    for s, side in enumerate(SIDES):
        x, g2 = _served(kv[s], grads[s], served, layer, s)
        for bits in LEVELED:
            fmt = layer_format(base, False, bits, bits)
            rows = []
            for h in range(x.shape[0]):
                xs, g2s = x[h, held[h]], g2[h, held[h]]                                       # [n, d]
                if s == 0:
                    T = key_block(base, fmt, head_dim, False)
                    n = len(xs) - len(xs) % T
                    xs, g2s = xs[:n].reshape(-1, T, xs.shape[-1]), g2s[:n].reshape(-1, T, xs.shape[-1])
                    u, step = quant.normalised_per_channel(xs, bits, fmt.meta_bits)
                else:
                    u, step = quant.normalised_per_token(xs, bits, fmt.v_group, fmt.meta_bits)
                u, w = u.reshape(-1), (g2s * step.double() ** 2).reshape(-1)
                stride = max(len(u) // samples, 1)
                rows.append(fit_levels(u[::stride][None], bits, w[::stride][None].float())[0] if len(u)
                            else torch.arange(1 << bits, dtype=torch.float32))
            out[side, bits] = torch.stack(rows)
    return out


def bundle_levels(levels: dict, L: int, H: int) -> dict[str, torch.Tensor]:
    """Fitted levels (paged layer -> {(side, bits): [H, 2**bits]}) -> the bundle's tensors (`levels.{side}.{bits}`
    float32 [L, H, 2**bits]); a layer without levels (sliding) gets the uniform grid, which the runtime accepts."""
    from kvcal.runtime.storage.levels import tensor_name

    out = {}
    for side in SIDES:
        for bits in LEVELED:
            t = torch.arange(1 << bits, dtype=torch.float32).repeat(L, H, 1)
            for layer, fitted in levels.items():
                t[layer] = fitted[side, bits]
            out[tensor_name(side, bits)] = t
    return out


def _served(x: torch.Tensor, g: torch.Tensor, served: ServedBases, layer: int, s: int):
    """A side's x, g [1, H, S, d] -> (x A float32, (g A^-T)² float64) [H, S, d] in the served basis."""
    # x -> x A in the served basis, so dL/d(x A) = g A^-T: for keys A = R D^-1 M (smoothed) and A^-T = R D M, the
    # query rotation; values' basis is orthogonal
    a, a_inv_t = ((served.rotation[layer], served.query_rotation[layer]) if s == 0
                  else (served.basis[layer], served.basis[layer]))
    return (torch.einsum("hsd,hde->hse", x[0].float().cpu(), a),
            torch.einsum("hsd,hde->hse", g[0].float().cpu(), a_inv_t).double() ** 2)


@torch.no_grad()
def continuation_score(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """query [1, Hq, M, d] of the M scored positions (the last M of the key's), key [1, H, S, d] -> float32 [H, S]:
    each key's attention summed over those queries (causal), max over a KV head's query heads per query, as the
    runtime's significance sums it."""
    H, S, M = key.shape[1], key.shape[2], query.shape[2]
    q = query[0].float()                                                              # [Hq, M, d]
    k = key[0].float().repeat_interleave(query.shape[1] // H, 0)                      # [Hq, S, d]
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.arange(S)[None, :] > torch.arange(S - M, S)[:, None]
    attention = logits.masked_fill_(causal, float("-inf")).softmax(-1)                # [Hq, M, S]
    return attention.view(H, -1, M, S).amax(1).sum(1)


def first_exact(base: CompressionConfig, sliding: bool, queries: torch.Tensor, prompt: int,
                sliding_window: int | None = None) -> torch.Tensor:
    """queries long [n]: positions of decode queries after a prompt of `prompt` tokens -> long [n]: the first key
    position each reads exact (its own key and every later one); older keys it reads in their coded format. A paged
    layer's query reads its `window` newest keys exact. A sliding layer's (`sliding_window`) reads its
    `sliding_recent` newest exact and, with per-channel keys, the block still filling: the runtime cuts blocks from
    the first token the prompt leaves unquantized (kvcal.runtime.hf.sliding), so every boundary follows from the
    prompt's length."""
    if not sliding:
        return queries - base.tiering.window + 1
    recent = base.sliding_recent
    block = base.sliding_block if base.sliding is not None and base.sliding.k_mode == "channel" else 1
    kept = min(prompt, sliding_window - 1)
    start = prompt - (kept - max(kept - recent, 0) // block * block)        # the prompt's first unquantized token
    return start + (queries - start - recent).clamp(min=0) // block * block


def newest_exact(base: CompressionConfig, sliding: bool, length: int, prompt: int,
                 sliding_window: int | None = None) -> int:
    """How many of the newest of `length` tokens the last query (position length - 1) reads exact, its own included
    (`first_exact`): a paged layer's window; a sliding layer's recent tokens and the block still filling."""
    return length - int(first_exact(base, sliding, torch.tensor([length - 1]), prompt, sliding_window)[0])


@torch.no_grad()
def held_masks(prefill_score: torch.Tensor | None, continuation: torch.Tensor, window: int,
               sliding: bool) -> torch.Tensor:
    """The tokens a layer holds in its allocated format, for every heavy-hitter threshold of `ALPHAS` (module
    docstring) -> bool [len(ALPHAS), H, S]. prefill_score [H, P]: each prompt token's attention summed over the
    prompt's queries, max over a KV head's query heads (the runtime's prefill significance); continuation [H, S]:
    the same sums over the M scored queries after the prompt (`continuation_score`), S = P + M; window: how many of
    the newest tokens the last query reads exact (`newest_exact`). A sliding layer holds every token that some scored
    query reads coded (the last one reads the most)."""
    H, S = continuation.shape
    at = torch.arange(S, dtype=torch.float64)
    aged = at < S - window
    if sliding:
        return aged.expand(len(ALPHAS), H, S).clone()
    P = prefill_score.shape[1]
    M = S - P
    # a prompt token out of the window at prefill is placed then, by its prefill mean against alpha / P, and every
    # token is held low at the end when its mean over every query that saw it falls below alpha / S
    at_prefill = at[:P] < P - window
    mean_prefill = prefill_score.double() / (P - at[:P])
    mean_end = (torch.cat([prefill_score.double(), torch.zeros(H, M, dtype=torch.float64)], 1)
                + continuation.double()) / (S - at)
    held = []
    for alpha in ALPHAS:
        low = mean_end < alpha / S
        # a token placed low stays low
        low[:, :P] |= at_prefill & (mean_prefill < alpha / P)
        held.append(low & aged)
    return torch.stack(held)


@torch.no_grad()
def add_layer_costs(costs: torch.Tensor, high_costs: torch.Tensor, layer: int, kv: tuple, grads: tuple,
                    held: torch.Tensor, high: torch.Tensor, served: ServedBases, base: CompressionConfig, sliding: bool,
                    head_dim: int, levels: dict | None = None) -> None:
    """Accumulate ½ Σ g² δ² of one window into costs [H, 2, len(BITS), len(ALPHAS)] for every catalogue entry of the
    held tokens (held bool [len(ALPHAS), H, S]) and into high_costs [H, 2, len(HIGH), len(ALPHAS)] for every
    high-tier format of the tokens read in the high tier (high bool [len(ALPHAS), H, S]). kv, grads: key and value
    [1, H, S, d] and their gradients; levels: the layer's calibrated levels ({(side, bits): [H, 2**bits]},
    `fit_layer_levels`). A per-token format's error is computed once per token and summed under each mask;
    per-channel keys are coded again for each mask, since a page's scales depend on which tokens fill it."""
    for s, side in enumerate(SIDES):
        x, g2 = _served(kv[s], grads[s], served, layer, s)
        for h in range(x.shape[0]):
            held_tokens = None          # per mask, the held tokens' x and g2 [1, n, d]: gathered once for every bits
            for b, bits in enumerate(BITS):
                fmt = layer_format(base, sliding, bits, bits)
                lut = (levels or {}).get((side, bits))
                lut = None if lut is None else lut[h:h + 1]                                    # [1, 2**bits]
                if s == 0 and fmt.k_mode == "channel" and bits not in RAW_BITS:
                    tokens = key_block(base, fmt, head_dim, sliding)
                    held_tokens = held_tokens or [(x[h, mask][None], g2[h, mask][None]) for mask in held[:, h]]
                    for i, (xs, g2s) in enumerate(held_tokens):
                        costs[h, s, b, i] += 0.5 * float(coding_errors(xs, g2s, fmt, side, tokens, lut).sum())
                    continue
                costs[h, s, b] += _masked_sums(coding_errors(x[h][None], g2[h][None], fmt, side, 1, lut)[0],
                                               held[:, h])
            for b, spec in enumerate(HIGH):
                errors = coding_errors(x[h][None], g2[h][None], TierFormat.parse(spec), side, 1)[0]
                high_costs[h, s, b] += _masked_sums(errors, high[:, h])


def _masked_sums(errors: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """½ of errors float64 [S] (Σ g² δ² per token), summed under each of masks bool [A, S] -> float64 [A]."""
    return 0.5 * (masks.double() * errors).sum(-1)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (average ranks for ties)."""
    def ranks(x: list[float]) -> torch.Tensor:
        t = torch.tensor(x, dtype=torch.float64)
        order = t.argsort()
        r = torch.empty_like(t)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for value in t.unique():                      # ties share their mean rank
            same = t == value
            r[same] = r[same].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp(min=1e-300))

