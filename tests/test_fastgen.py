"""FastGen per-head patterns: budgets, nested kept sets, prompt recovery against a brute-force reference, pattern
choice, decode evictions, token classes, and the offline FastGenStatsCollector on tiny models."""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal.runtime.policies.fastgen import (
    FULL,
    PATTERNS,
    FastGenConfig,
    choose_pattern,
    decode_evictions,
    kept_sets,
    prompt_recovery,
    token_classes,
    token_flags,
)

# ---------------------------------------------------------------------------------------------- helpers


def _ceil(r: float, t: int) -> int:
    return math.ceil(Fraction(str(r)) * t)


def _causal_probs(B, H, g, n, seed=0, n_pad=None):
    """Softmax over random logits, causal, padding keys masked and padding query rows zero: [B, H, g, n, n]."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, H, g, n, n, generator=gen) * 2.0
    allowed = torch.ones(n, n, dtype=torch.bool).tril().expand(B, n, n).clone()
    if n_pad is not None:
        for b in range(B):
            allowed[b, :, : int(n_pad[b])] = False
    probs = torch.softmax(logits.masked_fill(~allowed[:, None, None], float("-inf")), dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def _reference_recovery(probs, rows, is_special, is_punct, score, cfg, n_pad=None):
    """Per-row Python loops, straight from the digest's §5.2 Profile: [4, B, H] (min over g per row, summed)."""
    B, H, g, c, n = probs.shape
    out = torch.zeros(4, B, H, dtype=torch.float64)
    for b in range(B):
        pad = 0 if n_pad is None else int(n_pad[b])
        for h in range(H):
            for ci, i in enumerate(rows):
                i = int(i)
                length = max(i + 1 - pad, 0)
                cands = list(range(pad, i + 1))
                spec = {j for j in cands if is_special[b, j]}
                punct = {j for j in cands if is_punct[b, j]}
                ranked = sorted(cands, key=lambda j: (-float(score[b, h, j]), j))
                freq = set(ranked[: _ceil(cfg.r_frequent, length)])
                local = {j for j in cands if j >= i + 1 - _ceil(cfg.r_local, length)}
                sets = [spec, spec | punct, spec | punct | freq, spec | punct | freq | local]
                for p, kept in enumerate(sets):
                    mass = [sum(float(probs[b, h, q, ci, j]) for j in kept) for q in range(g)]
                    out[p, b, h] += min(mass)
    return out.float()


# ---------------------------------------------------------------------------------------------- config, choice


def test_policy_list_and_config():
    assert PATTERNS[FULL] == "full" and len(PATTERNS) == 5
    assert PATTERNS[:4] == ("special", "special+punct", "special+punct+frequent", "special+punct+frequent+local")
    cfg = FastGenConfig()
    assert (cfg.recovery, cfg.r_local, cfg.r_frequent) == (0.95, 0.3, 0.3)
    for bad in (dict(recovery=1.5), dict(recovery=-0.1), dict(r_local=2.0), dict(r_frequent=-0.5)):
        with pytest.raises(ValueError):
            FastGenConfig(**bad)


def test_choose_pattern_first_feasible_else_full():
    cfg = FastGenConfig(recovery=0.9)
    rec = torch.tensor([
        [0.95, 0.50, 0.10, 0.20, float("nan")],    # special
        [0.96, 0.90, 0.20, 0.30, float("nan")],    # +punct (0.90 == T: feasible, ties -> earlier)
        [0.97, 0.95, 0.91, 0.40, float("nan")],    # +frequent
        [0.99, 0.99, 0.99, 0.89, float("nan")],    # +local
    ])[:, None, :]                                 # [4, B=1, H=5]
    policy = choose_pattern(rec, cfg)
    assert policy.dtype == torch.int64 and policy.shape == (1, 5)
    assert policy.tolist() == [[0, 1, 2, FULL, FULL]]         # NaN (never profiled) -> full
    assert choose_pattern(rec, FastGenConfig(recovery=1.0)).tolist() == [[FULL] * 5]
    assert choose_pattern(rec, FastGenConfig(recovery=0.0)).tolist() == [[0, 0, 0, 0, FULL]]


# ---------------------------------------------------------------------------------------------- kept sets


def _kept_positions(kept, pos, b, h):
    return [sorted(int(p) for p in pos[b, h][kept[i, b, h]]) for i in range(4)]


def test_kept_sets_hand_example():
    cfg = FastGenConfig()                                   # r = 0.3: at t = 10 budgets are 3 and 3
    n = 10
    tokens_special = torch.zeros(1, n, dtype=torch.bool)
    tokens_special[0, 0] = True
    tokens_punct = torch.zeros(1, n, dtype=torch.bool)
    tokens_punct[0, 4] = True
    # head 0: slots = cache indices; head 1: slots reversed, token 0 already evicted, last slot empty
    pos = torch.stack([torch.arange(n), torch.tensor([9, 8, 7, 6, 5, 4, 3, 2, 1, -1])])[None]
    score = torch.tensor([[5, 1, 3, 3, 0, 3, 0, 0, 0, 2],
                          [0, 0, 0, 0, 4, 4, 4, 4, 0, 100]], dtype=torch.float32)[None]
    kept = kept_sets(tokens_special, tokens_punct, score, pos, torch.tensor([n]), cfg)
    assert kept.shape == (4, 1, 2, n) and kept.dtype == torch.bool
    # head 0: frequent = top 3 = {0 (5), 2, 3 (ties at 3 -> lower pos first, 5 loses)}; local = {7, 8, 9}
    assert _kept_positions(kept, pos, 0, 0) == [[0], [0, 4], [0, 2, 3, 4], [0, 2, 3, 4, 7, 8, 9]]
    # head 1: the empty slot's score is ignored; ties at 4 over pos {2, 3, 4, 5} -> {2, 3, 4}
    assert _kept_positions(kept, pos, 0, 1) == [[], [4], [2, 3, 4], [2, 3, 4, 7, 8, 9]]
    assert not kept[:, 0, 1, 9].any()                                  # empty slot never kept
    # flags given per slot [B, H, S] mean the same thing
    per_slot = [f[0][pos.clamp(min=0)] for f in (tokens_special, tokens_punct)]
    assert torch.equal(kept_sets(per_slot[0], per_slot[1], score, pos, torch.tensor([n]), cfg), kept)


def test_kept_sets_budgets_follow_current_length():
    cfg = FastGenConfig(r_local=0.3, r_frequent=0.3)
    n = 11                                                  # ⌈3.3⌉ = 4
    flags = torch.zeros(1, n, dtype=torch.bool)
    pos = torch.arange(n)[None, None]
    score = torch.arange(n, 0, -1, dtype=torch.float32)[None, None]     # older = more frequent
    kept = kept_sets(flags, flags, score, pos, torch.tensor([n]), cfg)
    assert int(kept[2].sum()) == 4 and kept[2, 0, 0, :4].all()
    assert _kept_positions(kept, pos, 0, 0)[3] == [0, 1, 2, 3, 7, 8, 9, 10]
    # left padding: budgets on the real length (11 - 1 = 10 -> 3), padding slots are empty (pos -1)
    pos_pad = torch.where(torch.arange(n) < 1, -1, torch.arange(n))[None, None]
    kept = kept_sets(flags, flags, score, pos_pad, torch.tensor([n]), cfg, n_pad=torch.tensor([1]))
    assert _kept_positions(kept, pos_pad, 0, 0)[3] == [1, 2, 3, 8, 9, 10]
    # exact products do not round up (0.3 * 10 = 3, not 4)
    kept = kept_sets(flags[:, :10], flags[:, :10], score[..., :10], pos[..., :10], torch.tensor([10]), cfg)
    assert int(kept[2].sum()) == 3 and int((kept[3] & ~kept[2]).sum()) == 3


# ---------------------------------------------------------------------------------------------- recovery


@pytest.mark.parametrize("g,padded", [(1, False), (2, False), (2, True)])
def test_prompt_recovery_matches_bruteforce_and_chunks_add_up(g, padded):
    B, H, n = 2, 2, 13
    cfg = FastGenConfig(recovery=0.9, r_local=0.25, r_frequent=0.3)
    gen = torch.Generator().manual_seed(1)
    n_pad = torch.tensor([0, 3]) if padded else None
    probs = _causal_probs(B, H, g, n, seed=2, n_pad=n_pad)
    is_special = torch.rand(B, n, generator=gen) < 0.15
    is_punct = torch.rand(B, n, generator=gen) < 0.2
    score = torch.randint(0, 4, (B, H, n), generator=gen).float()     # many ties
    rows = torch.arange(n)
    ref = _reference_recovery(probs, rows, is_special, is_punct, score, cfg, n_pad)
    one = prompt_recovery(probs, rows, is_special, is_punct, score, cfg, n_pad=n_pad)
    assert one.shape == (4, B, H)
    torch.testing.assert_close(one, ref, atol=1e-5, rtol=1e-5)
    split = 6
    two = (prompt_recovery(probs[:, :, :, :split], rows[:split], is_special, is_punct, score, cfg, n_pad=n_pad)
           + prompt_recovery(probs[:, :, :, split:], slice(split, n), is_special, is_punct, score, cfg, n_pad=n_pad))
    torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)
    assert (one[1:] >= one[:-1]).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 24), st.integers(0, 10_000),
       st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_recovery_nested_and_bounded(B, H, g, n, seed, r_l, r_f):
    cfg = FastGenConfig(r_local=r_l, r_frequent=r_f)
    gen = torch.Generator().manual_seed(seed)
    probs = _causal_probs(B, H, g, n, seed=seed)
    is_special = torch.rand(B, n, generator=gen) < 0.2
    is_punct = torch.rand(B, n, generator=gen) < 0.2
    score = probs.amax(2).sum(3)
    rec = prompt_recovery(probs, torch.arange(n), is_special, is_punct, score, cfg) / n
    assert (rec >= 0).all() and (rec <= 1 + 1e-5).all()
    assert (rec[1:] >= rec[:-1]).all()                                 # nested: never decreases along the list
    policy = choose_pattern(rec, cfg)
    assert ((policy >= 0) & (policy <= FULL)).all()
    # every key kept (r_l = 1 covers each row's whole prefix) -> full mass
    all_local = prompt_recovery(probs, torch.arange(n), is_special, is_punct, score, FastGenConfig(r_local=1.0))
    torch.testing.assert_close(all_local[3] / n, torch.ones(B, H), atol=1e-5, rtol=0)


def test_special_sink_head_picks_special():
    """A planted attention sink on the BOS token: the head is profiled special-only; a diffuse head goes full."""
    n = 32
    probs = torch.zeros(1, 2, 1, n, n)
    probs[0, 0, 0, :, 0] = 0.97
    idx = torch.arange(n)
    probs[0, 0, 0, idx, idx] += 0.03
    probs[0, 0, 0, 0, 0] = 1.0
    probs[0, 1, 0] = torch.ones(n, n).tril() / torch.arange(1, n + 1)[:, None]
    is_special = torch.zeros(1, n, dtype=torch.bool)
    is_special[0, 0] = True
    no_punct = torch.zeros(1, n, dtype=torch.bool)
    score = probs.amax(2).sum(3)
    rec = prompt_recovery(probs, idx, is_special, no_punct, score, FastGenConfig()) / n
    assert choose_pattern(rec, FastGenConfig(recovery=0.95)).tolist() == [[0, FULL]]


# ---------------------------------------------------------------------------------------------- decode


def test_decode_evictions():
    cfg = FastGenConfig()
    n = 10
    is_special = torch.zeros(1, n, dtype=torch.bool)
    is_special[0, [0, 5]] = True
    is_punct = torch.zeros(1, n, dtype=torch.bool)
    is_punct[0, 3] = True
    pos = torch.where(torch.arange(n) < 9, torch.arange(n), -1).expand(1, 5, n)   # slot 9 empty
    score = torch.rand(1, 5, n, generator=torch.Generator().manual_seed(0))
    kept = kept_sets(is_special, is_punct, score, pos, torch.tensor([9]), cfg)
    policy = torch.tensor([[0, 1, 2, 3, FULL]])
    drop = decode_evictions(policy, kept, pos)
    assert drop.shape == (1, 5, n) and drop.dtype == torch.bool
    assert not drop[0, 4].any()                                        # full evicts nothing
    assert not drop[:, :, 9].any()                                     # empty slot is not a token to drop
    assert pos[0, 0][~drop[0, 0] & (pos[0, 0] >= 0)].tolist() == [0, 5]   # special head keeps only specials
    assert pos[0, 1][~drop[0, 1] & (pos[0, 1] >= 0)].tolist() == [0, 3, 5]
    for h in range(4):                                                 # each head: exactly its kept set survives
        assert torch.equal(~drop[0, h] & (pos[0, h] >= 0), kept[h, 0, h])
    assert (drop[0, :4].sum(-1).diff() <= 0).all()                     # nested: fewer drops along the list


# ---------------------------------------------------------------------------------------------- token classes


def _punct_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "the", ".", ",", "?", "...", "$", "e.g", "«", "),"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_token_classes_conftest_tokenizer():
    from conftest import make_tokenizer

    tok = make_tokenizer()
    special, punct = token_classes(tok)
    assert special.dtype == torch.int64 and punct.dtype == torch.int64
    assert set(special.tolist()) == {0, 1, 2}                          # <unk>, <s>, </s>
    assert punct.numel() == 0                                          # words only
    assert token_classes(tok)[0] is special                            # cached per tokenizer


def test_token_classes_punctuation_and_added_specials():
    tok = _punct_tokenizer()
    special, punct = token_classes(tok)
    assert set(punct.tolist()) == {4, 5, 6, 7, 10, 11}                 # . , ? ... « ),   (not $, e.g, the)
    tok.add_tokens(["[INST]"], special_tokens=True)
    special2, punct2 = token_classes(tok)                              # vocabulary grew: recomputed
    assert tok.convert_tokens_to_ids("[INST]") in special2.tolist()
    assert torch.equal(punct2, punct)
    ids = torch.tensor([[1, 3, 4, 8, 6]])
    is_special, is_punct = token_flags(ids, special2, punct2)
    assert is_special.tolist() == [[True, False, False, False, False]]
    assert is_punct.tolist() == [[False, False, True, False, True]]


@pytest.mark.slow
def test_token_classes_smollm2_tokenizer():
    from transformers import AutoTokenizer

    from kvcal.models import resolve_model

    try:
        folder = resolve_model("smollm2-135m").folder
    except ValueError as e:
        pytest.skip(f"smollm2-135m unavailable: {e}")
    tok = AutoTokenizer.from_pretrained(folder)
    special, punct = token_classes(tok)
    punct = set(punct.tolist())
    for text in (".", ",", "?", " .", " ,", " ?"):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] in punct, text
    for text in ("the", " the"):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] not in punct, text
    assert tok.convert_tokens_to_ids("<|im_start|>") in special.tolist()


# ---------------------------------------------------------------------------------------------- collector


class _Recorder:
    def __init__(self):
        self.seen = {}

    def add(self, layer, query, key, value):
        self.seen[layer] = (query.detach().clone(), key.detach().clone())


def _profile(model_type, n=40, B=2, chunk=16):
    from conftest import make_model

    from kvcal.models import adapter_for
    from kvcal.profile.capture import capturing
    from kvcal.profile.fastgen_stats import FastGenStatsCollector

    model, tok = make_model(model_type)
    adapter = adapter_for(model.config)
    special, punct = token_classes(tok)
    ids = torch.randint(3, len(tok), (B, n), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = tok.bos_token_id
    col, rec = FastGenStatsCollector(adapter, special, punct, chunk=chunk), _Recorder()
    col.set_tokens(ids)
    with torch.no_grad(), capturing(model, col, rec):
        model(input_ids=ids, use_cache=False)
    return model, adapter, col, rec, ids, special, punct


def test_policy_collector_tiny_llama():
    from kvcal.profile.fastgen_stats import FastGenStatsCollector

    model, adapter, col, rec, ids, special, punct = _profile("llama")
    L, H = adapter.num_layers, adapter.num_kv_heads
    recovery, kept = col.recovery, col.kept_fraction
    assert recovery.shape == kept.shape == (L, H, 4)
    assert col.windows.tolist() == [2] * L
    assert (recovery >= 0).all() and (recovery <= 1 + 1e-5).all()
    assert (recovery.diff(dim=-1) >= 0).all()
    assert (kept >= 0).all() and (kept <= 1).all() and (kept.diff(dim=-1) >= 0).all()
    # the BOS is the only special in each window: special keeps 1/n of the tokens
    torch.testing.assert_close(kept[..., 0], torch.full((L, H), 1 / ids.shape[1]))
    assert col.patterns().shape == (L, H)

    # the collector's probabilities are the model's own (scale, causality): compare with eager attention weights
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attn = model(input_ids=ids, use_cache=False, output_attentions=True).attentions
    B, n = ids.shape
    g = adapter.group_size
    for layer in range(L):
        q, k = rec.seen[layer]
        probs = col._probs(q.float().view(B, H, g, n, -1), k.float(), slice(0, n), col.scale[layer])
        torch.testing.assert_close(probs.reshape(B, H * g, n, n), attn[layer].float(), atol=1e-5, rtol=1e-4)
        # chunked streaming (chunk=16) equals one dense pass
        score = probs.amax(2).sum(2)
        is_s, is_p = token_flags(ids, special, punct)
        dense = prompt_recovery(probs, torch.arange(n), is_s, is_p, score, col.cfg) / n
        torch.testing.assert_close(recovery[layer], dense.mean(1).T, atol=1e-5, rtol=1e-5)

    # state round trip
    other = FastGenStatsCollector(adapter, special, punct)
    other.load_state_dict(col.state_dict())
    torch.testing.assert_close(other.recovery, recovery)
    torch.testing.assert_close(other.kept_fraction, kept)


def test_policy_collector_requires_tokens_and_skips_sliding_layers():
    from conftest import make_model

    from kvcal.models import adapter_for
    from kvcal.profile.capture import capturing
    from kvcal.profile.fastgen_stats import FastGenStatsCollector

    _, adapter, col, _, _, _, _ = _profile("gemma3_text", n=24, B=1, chunk=8)
    for layer in range(adapter.num_layers):
        if adapter.is_sliding(layer):
            assert col.recovery[layer].isnan().all() and col.kept_fraction[layer].isnan().all()
            assert (col.patterns()[layer] == FULL).all()
        else:
            r = col.recovery[layer]
            assert (r >= 0).all() and (r <= 1 + 1e-5).all() and (r.diff(dim=-1) >= 0).all()

    model, tok = make_model("llama")
    fresh = FastGenStatsCollector(adapter_for(model.config), *token_classes(tok))
    with pytest.raises(RuntimeError, match="set_tokens"), torch.no_grad(), capturing(model, fresh):
        model(input_ids=torch.tensor([[1, 5, 6, 7]]), use_cache=False)


def test_fastgen_recovery_of_a_long_prompt_is_the_mean_over_its_profile_rows(monkeypatch):
    """Beyond PROFILE_ROWS tokens, a prompt's recovery is the mean over evenly spaced real query rows (the last one
    included), computed from the same probabilities the prefill ran, in several row blocks."""
    from conftest import make_model, random_bundle, random_text

    import kvcal.runtime.policies.fastgen as fastgen
    from kvcal.runtime.backends import base as attention
    from kvcal.runtime.backends.reference import TorchBackend
    from kvcal.runtime.config import CompressionConfig
    from kvcal.runtime.hf import KvcalCache
    from kvcal.runtime.options import ServeOptions

    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    tok.padding_side = "left"
    inputs = tok([random_text(120, seed=1), random_text(70, seed=2)], return_tensors="pt", padding=True)
    n = inputs.input_ids.shape[1]
    monkeypatch.setattr(fastgen, "PROFILE_ROWS", 24)
    monkeypatch.setattr(attention, "_BLOCK_ELEMENTS", 1 << 12)          # several row blocks
    rows = fastgen.profile_rows(n)
    assert len(rows) == 24 and rows[0] == 0 and rows[-1] == n - 1 and (rows.diff() >= 1).all()
    assert torch.equal(fastgen.profile_rows(20), torch.arange(20))
    cfg = FastGenConfig(0.9)
    cache = KvcalCache.from_bundle(bundle, model, CompressionConfig(fastgen=cfg), tokenizer=tok,
                                   serve=ServeOptions("torch"))
    cache.record = True
    captured = {}
    real_prefill = TorchBackend.prefill

    def prefill(query, keys, values, mask, scale):
        captured.setdefault("args", (query, keys, mask, scale))
        return real_prefill(query, keys, values, mask, scale)

    monkeypatch.setattr(TorchBackend, "prefill", staticmethod(prefill))
    with torch.no_grad():
        model(**inputs, cache=cache, use_cache=True)
    key, value, score, real, statistics = cache.kv.recorder[0]
    query, keys, mask, scale = captured["args"]
    full = attention.prompt_probs(query, keys, mask, scale, slice(0, n))            # every row, every key
    is_special, is_punct = fastgen.token_flags(inputs.input_ids, *cache.token_classes)
    n_pad = (~real).sum(-1)
    want = fastgen.prompt_recovery(full[:, :, :, rows], rows, is_special, is_punct, score, cfg, n_pad)
    want = want / (rows[None, :] >= n_pad[:, None]).sum(-1)[None, :, None]
    torch.testing.assert_close(statistics["fastgen"], want, atol=1e-5, rtol=1e-5)


def test_fastgen_statistics_from_the_text_pass_equal_a_pass_of_their_own_at_offset_zero():
    """The text pass's first windows give the FastGen statistics (`passes.FirstWindows` inside its CollectorSet), at the
    pass's spread position offsets, where a pass of their own ran them at offset 0: attention depends on positions
    only through their differences, so the two agree up to the float rounding of RoPE at other angles. The Gram
    statistics beside them are those of the text pass alone, bit for bit, and the windows past the first two are not
    profiled."""
    from conftest import make_model

    from kvcal.models import LoadedModel, adapter_for
    from kvcal.profile.capture import CollectorSet, GramCollector
    from kvcal.profile.fastgen_stats import FastGenStatsCollector
    from kvcal.profile.passes import FirstWindows, run_pass

    model, tok = make_model("llama")
    adapter = adapter_for(model.config)
    lm = LoadedModel(model, tok, adapter, None, 0.0)
    special, punct = token_classes(tok)
    ids = torch.randint(3, len(tok), (4, 48), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = tok.bos_token_id
    offsets = [0, 300, 700, 1100]
    first_two = FirstWindows(FastGenStatsCollector(adapter, special, punct), 2)
    text = CollectorSet(grams=GramCollector(adapter), fastgen=first_two)
    run_pass(lm, "calibration-text", ids, offsets, text)
    own = run_pass(lm, "policy-statistics", ids[:2], [0, 0], FastGenStatsCollector(adapter, special, punct))
    shared = text.named["fastgen"].collector
    assert shared.windows.tolist() == own.windows.tolist() == [2] * adapter.num_layers
    torch.testing.assert_close(shared.recovery, own.recovery, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared.kept_fraction, own.kept_fraction)
    alone = run_pass(lm, "calibration-text", ids, offsets, GramCollector(adapter))
    for name, t in alone.state_dict().items():
        assert torch.equal(text.named["grams"].state_dict()[name], t), name
