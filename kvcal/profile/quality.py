"""Decode-phase fidelity of a compressed cache against the dense cache, on the same inputs.

Protocol: prefill P prompt tokens through the cache under test, then teacher-force the continuation one token per
step. Step t feeds continuation token t and predicts token t + 1, reading everything before it from the cache. The
prefill's own last prediction is not scored, because compressing the cache cannot change it (prefill attention runs
on the uncompressed K/V). The reference logits come from one dense forward pass over prompt + continuation.

Metrics over every scored prediction: mean KL(dense || compressed) in nats; top-1 agreement with the dense argmax;
continuation perplexity of the true tokens under both, and their ratio exp(mean NLL_c - mean NLL_d). Memory: bytes the
cache actually holds at the end (pages in the arena, metadata and fragmentation included), against an fp16 dense
cache of the same tokens.

`passkey` hides a random 5-digit key at a given depth of filler text and asks for it back.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class QualityTarget:
    """What "meets the target" means, for calibrate's search, its report and `kvcal bench` alike."""

    top1: float = 0.97          # top-1 agreement with dense on held-out text
    ppl_ratio: float = 1.02     # continuation perplexity / dense perplexity
    z: float = 1.5              # top-1 must hold at this many standard errors (Wilson lower bound), see `met`

    def met(self, measured) -> bool:
        """`measured` (a `Fidelity`, a search `Point`: anything with top1, predictions and ppl_ratio) meets the
        target: top-1's lower bound at `z` reaches it, and so does the perplexity ratio.

        The search keeps the cheapest point that passes, so a point that passes by luck is exactly what it would
        pick; the bound asks for more evidence the closer a point sits to the target (docs/calibration.md).
        """
        return self.top1_bound(measured) >= self.top1 and measured.ppl_ratio <= self.ppl_ratio

    def top1_bound(self, measured) -> float:
        """The lower of two bounds on top-1: Wilson over all predictions (binomial noise), and, with two or more
        windows, the mean of per-window top-1 less z standard errors of that mean (variation between documents,
        which the binomial bound does not see: a point can pass on one set of windows and miss on another)."""
        bound = wilson_lower(measured.top1, measured.predictions, self.z)
        return min(bound, window_lower(getattr(measured, "top1_windows", None) or [], self.z))


def window_lower(per_window: list[float], z: float) -> float:
    """Mean of per-window values less z standard errors of the mean (sample sd); 1.0 with fewer than two windows."""
    n = len(per_window)
    if n < 2 or z <= 0:
        return 1.0
    mean = sum(per_window) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in per_window) / (n - 1))
    return mean - z * sd / math.sqrt(n)


def wilson_lower(p: float, n: int, z: float) -> float:
    """Wilson score lower bound of a proportion p observed over n trials."""
    if n <= 0 or z <= 0:
        return p
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n)


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
    head = model.get_output_embeddings()
    return torch.cat([head(hidden[:, i:i + chunk]).float() for i in range(0, hidden.shape[1], chunk)], dim=1)


def dense_cache(model, records: dict):
    """A transformers `DynamicCache` holding a recorded prompt: `records` maps each layer to its K/V [B, H, n, d]
    (and more, ignored) or, for a sliding layer, (its kept window's keys, values, the number of tokens it has seen)."""
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
            layer.update(records[i][0].to(dtype), records[i][1].to(dtype))
    return cache


@torch.inference_mode()
def reference_logits(model, records: dict, continuation: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Dense logits [B, M, vocab] (float32) of continuation[:, :M] (continuation [B, M + 1]) after a recorded prompt:
    a transformers `DynamicCache` filled with the prompt's exact K/V from `records` (`DecodeProbe`'s, taken from the
    recording prefill), then `chunk` tokens per forward pass. Equal to one dense forward over prompt + continuation
    up to float rounding, at the cost of the continuation alone: the prompt is not run a second time."""
    cache = dense_cache(model, records)
    M = continuation.shape[1] - 1
    logits = [model(input_ids=continuation[:, t:min(t + chunk, M)], cache=cache, use_cache=True).logits
              .float() for t in range(0, M, chunk)]
    return torch.cat(logits, dim=1)


def teacher_force(model, cache, continuation: torch.Tensor, chunk: int = 1,
                  on_logits: Callable[[int, torch.Tensor], None] | None = None) -> tuple[torch.Tensor | None, float]:
    """Feed continuation[:, :-1] through `cache`, `chunk` tokens per forward pass: logits [B, M, vocab] float32,
    seconds. chunk = 1 is the stepwise decode users run. A larger chunk is the batched probe: the runtime's `attend`
    lets a chunk's tokens attend causally to each other and to the store, then the decode-phase policy steps
    (Algorithm 1, FastGen) run once per token of the chunk, so they see the same lengths as stepwise decode. What
    differs: a token attends to the earlier tokens of its own chunk unquantized, and to the store before their
    downgrades; docs/calibration.md measures what that changes. `on_logits(t, logits [B, c, vocab])`: hand each
    forward pass's logits (continuation positions t..t + c) over instead of keeping them (returns None for logits):
    [B, M, vocab] float32 is hundreds of MB at a 256-token continuation on a 50k vocabulary."""
    if chunk < 1:
        raise ValueError(f"`chunk={chunk}` must be at least 1")
    steps = []
    M = continuation.shape[1] - 1
    t0 = time.perf_counter()
    for t in range(0, M, chunk):
        logits = model(input_ids=continuation[:, t:min(t + chunk, M)], cache=cache, use_cache=True).logits
        if on_logits is None:
            steps.append(logits.float())
        else:
            on_logits(t, logits.float())
    return (torch.cat(steps, dim=1) if on_logits is None else None), time.perf_counter() - t0


class LogitScores:
    """`compare_logits`'s sums, added a few positions at a time (`add`), so no [B, M, vocab] tensor is needed."""

    def __init__(self, batch: int):
        self.kl, self.agree, self.nll, self.nll_ref = (torch.zeros(batch, dtype=torch.float64) for _ in range(4))
        self.count = 0          # positions per window so far

    def add(self, ref: torch.Tensor, got: torch.Tensor, target: torch.Tensor) -> None:
        """ref, got [B, c, vocab] logits; target [B, c] the true next tokens."""
        logp_ref, logp = F.log_softmax(ref.float(), -1), F.log_softmax(got.float(), -1)
        self.kl += (logp_ref.exp() * (logp_ref - logp)).sum(-1).sum(-1).double()
        self.agree += (ref.argmax(-1) == got.argmax(-1)).sum(-1).double()
        self.nll -= logp.gather(-1, target[..., None]).sum((-1, -2)).double()
        self.nll_ref -= logp_ref.gather(-1, target[..., None]).sum((-1, -2)).double()
        self.count += target.shape[1]

    def fidelity(self, prompt_tokens: int, seconds: float, cache=None) -> Fidelity:
        B, M = len(self.kl), self.count
        n = max(B * M, 1)
        nll, nll_ref = self.nll.sum().item() / n, self.nll_ref.sum().item() / n
        result = Fidelity(kl=self.kl.sum().item() / n, top1=self.agree.sum().item() / n, ppl=math.exp(nll),
                          ppl_dense=math.exp(nll_ref), ppl_ratio=math.exp(nll - nll_ref), predictions=B * M,
                          prompt_tokens=prompt_tokens, decode_ms_per_step=1000 * seconds / max(M, 1),
                          top1_windows=(self.agree / max(M, 1)).tolist())
        if getattr(cache, "kv", None) is not None:
            result.memory = cache.memory()
            result.tiers = tier_fractions(cache)
        return result


class ChunkProbeAttention:
    """The attention a batched probe runs over a chunk of n new tokens, in place of the cache's backend `attend`,
    so that a chunk sees what stepwise decode would have shown it (docs/calibration.md measures the rest):

    - stepwise decode writes each token into the high tier before the next one reads it, so a later token of a chunk
      sees the earlier ones rounded through their head group's high-tier format, and only itself raw (the runtime's
      `attend` shows a chunk its own tokens raw: right for serving a prompt, optimistic for a probe);
    - the policy steps after token i of the chunk must see significance from queries up to i only, not from the
      whole chunk (a token just leaving the window has been seen by ~W queries; a 32-token chunk would inflate its
      mean by half). `attend` adds query 0's probabilities; `ScoreCatchUp`, run first at each step, adds query i's.

    What remains different: query i attends to the store before the policy steps of tokens < i moved or dropped
    anything. Writes still go through the cache's own backend (the store keeps it)."""

    def __init__(self, kv):
        self.kv = kv
        self.writes_cache = kv.backend.writes_cache
        self.pending: dict[int, tuple] = {}   # layer -> (probabilities [B, H, n, S + n], stored pos [B, H, S], start)

    @staticmethod
    def _round_trip(x: torch.Tensor, bits: int, group: int | None, meta_bits: int, raw16: torch.dtype) -> torch.Tensor:
        """x float32 [..., r] as a per-token high-tier slot holds it: what `CompressedStore.write` then `read` give."""
        from kvcal.runtime import quant
        from kvcal.runtime.layout import RAW_BITS

        if bits in RAW_BITS:
            return x.to(torch.float32 if bits == 32 else raw16).float()
        return quant.round_trip_per_token(x, bits, group, meta_bits)

    def stored_like(self, store, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """keys [B, H, n, r_k max], values [B, H, n, r_v max] -> both as the high tier stores them."""
        from kvcal.runtime import quant
        from kvcal.runtime.pages import HIGH

        kq, vq = torch.zeros_like(keys), torch.zeros_like(values)
        for g in store.groups[layer]:
            fmt = g.layouts[HIGH].fmt
            if fmt.k_mode == "channel":     # a high tier this probe cannot mirror: leave those tokens unquantized
                kq[:, g.heads], vq[:, g.heads] = keys[:, g.heads], values[:, g.heads]
                continue
            k = keys[:, g.heads, :, :g.r_k]
            if fmt.k_mode == "static":
                scale, zero = (t[:, None] for t in store.static_key_params(layer, HIGH, g.heads, g.r_k))  # [Hg, 1, r]
                kq[:, g.heads, :, :g.r_k] = quant.dequantize_static(quant.quantize_static(k, scale, zero, fmt.k_bits),
                                                                    scale, zero)
            else:
                kq[:, g.heads, :, :g.r_k] = self._round_trip(k, fmt.k_bits, fmt.k_group, fmt.meta_bits, store.raw16)
            vq[:, g.heads, :, :g.r_v] = self._round_trip(values[:, g.heads, :, :g.r_v], fmt.v_bits, fmt.v_group,
                                                         fmt.meta_bits, store.raw16)
        return kq, vq

    def attend(self, store, layer, query, new_keys, new_values, scale, track_scores=True):
        """As AttentionBackend.attend: query [B, H, g, n, r]; new_keys [B, H, n, r]; new_values [B, H, n, r_v]."""
        if track_scores:
            store.own_layer(layer)          # before the gather: the scores are written back to the pages it read
        stored = store.gather(layer)
        B, H, g, n, _ = query.shape
        S = stored.pos.shape[-1]
        new_keys, new_values = new_keys.float(), new_values.float()
        kq, vq = self.stored_like(store, layer, new_keys, new_values)
        q = query.float()
        logits = torch.einsum("bhgnr,bhsr->bhgns", q, torch.cat([stored.keys, kq], dim=2)) * scale
        own = torch.einsum("bhgnr,bhnr->bhgn", q, new_keys) * scale                # each token on itself, raw
        eye = torch.eye(n, dtype=torch.bool, device=q.device)
        logits[..., S:] = torch.where(eye, own[..., None], logits[..., S:])
        allowed = torch.cat([(stored.pos >= 0)[:, :, None, None, :].expand(B, H, 1, n, S),
                             torch.ones(n, n, dtype=torch.bool, device=q.device).tril().expand(B, H, 1, n, n)], -1)
        probs = torch.nan_to_num(torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1), nan=0.0)
        out = torch.einsum("bhgns,bhsr->bhgnr", probs, torch.cat([stored.values, vq], dim=2))
        diag = torch.diagonal(probs[..., S:], dim1=-2, dim2=-1)                      # [B, H, g, n]
        out = out + diag[..., None] * (new_values - vq)[:, :, None]                   # the raw value on the diagonal
        if not track_scores:
            return out, torch.zeros(B, H, n, device=q.device)
        top = probs.amax(dim=2)                                                          # [B, H, n, S + n]
        store.add_scores(layer, stored, top[:, :, 0, :S])
        self.pending[layer] = (top, stored.pos, self.kv.length[layer])
        return out, torch.diagonal(top[..., S:], dim1=-2, dim2=-1)                      # each token's own query


def _score_index(pos: torch.Tensor, N: int) -> torch.Tensor:
    """Each slot's index into a [..., N + 1] score delta: its cache index, or N for an empty slot and for a held
    token of an untracked tier (position `HELD`), which keeps no score."""
    return torch.where((pos >= 0) & (pos < N), pos, N)


class ScoreCatchUp:
    """A token policy the batched probe runs before the real ones: at step i of a chunk it adds query i's attention
    probabilities (kept by `ChunkProbeAttention`) to the tokens still held, found by cache index, so Algorithm 1
    and FastGen see the significance stepwise decode would have given them."""

    name = "probe-scores"
    reads_scores = False     # it adds the scores itself; the real policies say whether the backend must track them

    def __init__(self, kv, attention: ChunkProbeAttention):
        self.kv, self.attention = kv, attention

    def decode(self, layer: int) -> None:
        from kvcal.runtime.pages import HIGH, LOW

        if layer not in self.attention.pending:
            return
        top, stored_pos, start = self.attention.pending[layer]
        B, H, n, width = top.shape
        S = width - n
        i = self.kv.length[layer] - start - 1            # the token just stored; query 0 was added by attend
        if i < 1:
            return
        N = start + n                                    # delta by cache index; index N collects empty slots
        delta = torch.zeros(B, H, N + 1, device=top.device)
        delta.scatter_add_(-1, _score_index(stored_pos, N), top[:, :, i, :S])
        delta[:, :, start:start + i] += top[:, :, i, S:S + i]
        store = self.kv.store
        store.own_layer(layer)
        b, h = self.kv.every_entry()
        for side in (HIGH, LOW):
            score, pos, word = store.section_scores(layer, side, b, h)
            if pos.shape[-1] == 0:
                continue
            pos = pos.view(B, H, -1)
            store.set_scores(layer, word.view(B, H, -1), pos,
                             score.view(B, H, -1) + delta.gather(-1, _score_index(pos, N)))


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


class DecodeProbe:
    """`decode_fidelity` for many compression settings on the same inputs, paying the shared work once.

    The dense reference logits and the prefill attention do not depend on the settings, so both run once here; each
    `measure` replays the recorded prefill into a fresh cache (the runtime's own write path, `CompressedKV.
    write_prefill`) and teacher-forces the continuation through it. With `chunk=1` results equal `decode_fidelity`
    with the same cache settings; with a larger chunk it is the batched probe the search uses (docs/calibration.md
    compares the two on real models).
    """

    @torch.inference_mode()
    def __init__(self, model, bundle, prompt: torch.Tensor, continuation: torch.Tensor, *, tokenizer=None,
                 fastgen=None):
        """`fastgen` (a FastGenConfig): also record each prompt's FastGen recovery statistics, so settings with
        FastGen can be measured (their r_l and r_f must equal these); needs `tokenizer`."""
        from kvcal.runtime.config import CompressionConfig
        from kvcal.runtime.hf import KvcalCache

        self.model, self.bundle, self.prompt, self.continuation = model, bundle, prompt, continuation
        self.tokenizer, self.fastgen = tokenizer, fastgen
        recording = KvcalCache.from_bundle(bundle, model, CompressionConfig.none().with_(fastgen=fastgen),
                                           tokenizer=tokenizer)
        recording.record = True
        model(input_ids=prompt, cache=recording, use_cache=True, logits_to_keep=1)
        self.records = dict(recording.kv.recorder)
        sliding = list(recording.sliding)
        for i, layer in enumerate(recording.layers):
            if sliding[i]:
                self.records[i] = (layer.keys, layer.values, layer.cumulative_length)
        recording.release()
        self.ref = reference_logits(model, self.records, continuation)
        # the replay rounds K/V through the store's formats (at most fp16), so the recorded copies need no more than
        # fp16 once the reference is made: half the probe's largest allocation (4 x 4k tokens of a 30-layer model
        # are 0.7 GB in float32). Sliding layers keep their window as the model's cache held it.
        for i, (key, value, *rest) in self.records.items():
            if not sliding[i]:
                self.records[i] = (key.half(), value.half(), *rest)

    @torch.inference_mode()
    def measure(self, config, bundle=None, chunk: int = 1) -> Fidelity:
        """Fidelity of `config` (a CompressionConfig), with `bundle`'s ranks (default: the probe's bundle).
        `chunk`: continuation tokens per forward pass (1: stepwise decode; more: the batched probe, see
        `teacher_force` and `ChunkProbeAttention`)."""
        cache = self.replay(config, bundle, chunk)
        page_s0 = cache.kv.store.page_seconds
        target = self.continuation[:, 1:]
        scores = LogitScores(target.shape[0])

        def score(t: int, logits: torch.Tensor) -> None:
            c = logits.shape[1]
            scores.add(self.ref[:, t:t + c], logits, target[:, t:t + c])

        _, seconds = teacher_force(self.model, cache, self.continuation, chunk, on_logits=score)
        result = scores.fidelity(self.prompt.shape[1], seconds, cache)
        result.page_ms_per_step = 1000 * (cache.kv.store.page_seconds - page_s0) / max(target.shape[1], 1)
        cache.release()
        return result

    def replay(self, config, bundle=None, chunk: int = 1):
        """A fresh KvcalCache of `config` holding the recorded prompt, ready for the continuation."""
        from kvcal.runtime.hf import KvcalCache

        if config.fastgen is not None and (self.fastgen is None or (config.fastgen.r_local, config.fastgen.r_frequent)
                                           != (self.fastgen.r_local, self.fastgen.r_frequent)):
            raise ValueError("this probe recorded no FastGen statistics for these r_local / r_frequent; make it with "
                             "`fastgen=`")
        cache = KvcalCache.from_bundle(bundle or self.bundle, self.model, config, tokenizer=self.tokenizer)
        cache.prime(self.records, token_ids=self.prompt)
        if chunk > 1 and cache.kv.raw:
            # a prompt the raw phase holds (CompressedKV): the batched probe's attention and score catch-up run on
            # the pages, which the raw phase would bypass and then hand over a whole chunk at once; go without it
            cache.release()
            cache = KvcalCache.from_bundle(bundle or self.bundle, self.model, config, tokenizer=self.tokenizer,
                                           raw_tokens=0)
            cache.prime(self.records, token_ids=self.prompt)
        if chunk > 1:
            kv = cache.kv
            kv.backend = ChunkProbeAttention(kv)
            kv.policies.insert(0, ScoreCatchUp(kv, kv.backend))
        return cache


def tier_fractions(cache) -> dict[str, float]:
    """Fractions of token-heads (compressed layers) held high, held low, or pruned."""
    kv = cache.kv
    counts = kv.tier_counts()
    layer = kv.layers[0]
    seen = (kv.length[layer] * kv.batch - int(kv.n_pad.sum())) * kv.store.num_kv_heads * len(kv.layers)
    return {"high": counts["high"] / seen, "low": counts["low"] / seen,
            "pruned": 1 - (counts["high"] + counts["low"]) / seen}


# --------------------------------------------------------------------------------------------------------- passkey

_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
_QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer, filler_ids: list[int], length: int, depth: float, seed: int) -> tuple[list[int], str]:
    """Token ids of about `length` tokens: filler text with the needle at relative `depth` (0 = start, 1 = end),
    then the question. Returns (ids, key)."""
    key = str(random.Random(seed).randint(10000, 99999))
    needle = tokenizer(_NEEDLE.format(key=key), add_special_tokens=False).input_ids
    question = tokenizer(_QUESTION, add_special_tokens=False).input_ids
    prefix = tokenizer("", add_special_tokens=True).input_ids     # BOS where the tokenizer uses one
    room = length - len(needle) - len(question) - len(prefix)
    if room < 1 or room > len(filler_ids):
        raise ValueError(f"passkey length {length} needs {room} filler tokens; {len(filler_ids)} available")
    cut = int(round(depth * room))
    return prefix + filler_ids[:cut] + needle + filler_ids[cut:room] + question, key


@torch.inference_mode()
def passkey(model, tokenizer, filler_text: str, lengths: list[int], depths: list[float],
            make_cache: Callable[[], object], seed: int = 0, new_tokens: int = 8) -> dict:
    """Greedy retrieval accuracy per (length, depth) and overall."""
    filler = tokenizer(filler_text, add_special_tokens=False).input_ids
    results = {}
    for length in lengths:
        for depth in depths:
            ids, key = passkey_prompt(tokenizer, filler, length, depth, seed + length + int(depth * 100))
            cache = make_cache()
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 cache=cache, pad_token_id=tokenizer.eos_token_id)
            text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
            results[f"{length}@{depth:g}"] = key in text
            if hasattr(cache, "release"):
                cache.release()
    return {"accuracy": sum(results.values()) / len(results), "cases": results}
