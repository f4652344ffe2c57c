"""kvcal.runtime on tiny random models: exactness without compression, store round trips per tier format, memory
accounting, the token policy's branches, sliding-window layers."""

import pytest
import torch
from conftest import generate_scored, make_model, padded_batch, random_bundle, random_text
from transformers import DynamicCache

from kvcal.eval import decode_fidelity
from kvcal.runtime.cache import CompressedKV, CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.options import ServeOptions
from kvcal.runtime.policies.diffkv import TIER_HIGH as T_HIGH
from kvcal.runtime.policies.diffkv import TIER_LOW as T_LOW
from kvcal.runtime.policies.diffkv import TIER_PRUNED as PRUNED
from kvcal.runtime.policies.diffkv import TieringConfig, classify_prompt, decode_actions
from kvcal.runtime.storage.layout import PageLayout, TierFormat
from kvcal.runtime.storage.pages import HIGH, LOW
from kvcal.runtime.storage.store import CompressedStore


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_no_compression_reproduces_dense_generation(model_type):
    model, tok = make_model(model_type)
    inputs = padded_batch(tok)
    ref = generate_scored(model, inputs, DynamicCache(config=model.config))
    cache = KvcalCache.from_bundle(random_bundle(model, tok), model, CompressionConfig.none())
    got = generate_scored(model, inputs, cache)
    assert torch.equal(ref.sequences, got.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.scores, got.scores))
    assert diff < 1e-4
    if model_type == "gemma3_text":     # sliding layers stay transformers' own, bounded by the window
        sliding = [layer for layer, s in zip(cache.layers, cache.sliding) if s]
        assert sliding and all(layer.keys.shape[-2] <= 16 for layer in sliding)


def test_full_rank_rotation_is_exact_up_to_float_error():
    model, tok = make_model("llama")
    inputs = padded_batch(tok)
    ref = generate_scored(model, inputs, DynamicCache(config=model.config))
    cfg = CompressionConfig.none().with_(rotate=True)            # random R and B at full rank, raw float32 storage
    got = generate_scored(model, inputs, KvcalCache.from_bundle(random_bundle(model, tok), model, cfg))
    assert max((a - b).abs().max().item() for a, b in zip(ref.scores, got.scores)) < 1e-3
    assert torch.equal(ref.sequences, got.sequences)


def test_memory_equals_allocated_pages_and_release_frees_all():
    model, tok = make_model("llama")
    cache = KvcalCache.from_bundle(random_bundle(model, tok), model, CompressionConfig())
    generate_scored(model, padded_batch(tok), cache, n=8)
    arena = cache.kv.store.arena
    mem = cache.memory()
    assert mem["paged_bytes"] == arena.num_used * arena.page_bytes == arena.used_bytes() > 0
    used_by_tables = int((arena.page_table >= 0).sum())
    assert used_by_tables == arena.num_used
    arena.check_invariants()
    cache.release()
    assert arena.num_free == arena.num_pages and cache.memory()["paged_bytes"] == 0


@pytest.mark.parametrize("fmt", ["K8V4", "K4V2", "K8V8", "K2V2", "K16V16", "K32V32", "K8V4m8", "K2V2g4m8"])
def test_store_round_trip_per_token_formats(fmt):
    torch.manual_seed(0)
    H, d = 2, 16
    ranks = torch.tensor([[16, 8]])
    store = CompressedStore(ranks, torch.tensor([[12, 16]]), [0], high=TierFormat.parse(fmt),
                            low=TierFormat.parse("K4V2"), head_dim=d, batch=2, page_bytes=512, initial_pages=2,
                            initial_tokens=8)
    n = 70                                                  # several pages per entry: the arena and the table grow
    b, h = torch.arange(2).repeat_interleave(H * n), torch.arange(H).repeat_interleave(n).repeat(2)
    keys, values = torch.randn(len(b), 16), torch.randn(len(b), 16)
    pos = torch.arange(n).repeat(2 * H)
    store.append(0, HIGH, b, h, keys, values, pos, torch.rand(len(b)))
    got = store.gather(0)
    for bi in range(2):
        for hi in range(H):
            sel = (b == bi) & (h == hi)
            rk, rv = int(ranks[0, hi]), (12, 16)[hi]
            k_ref, v_ref = keys[sel, :rk], values[sel, :rv]
            k_got = got.keys[bi, hi][got.pos[bi, hi] >= 0][:, :rk]
            v_got = got.values[bi, hi][got.pos[bi, hi] >= 0][:, :rv]
            assert torch.equal(got.pos[bi, hi][got.pos[bi, hi] >= 0], torch.arange(n))
            f = TierFormat.parse(fmt)
            if f.k_bits == 32:
                assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)
            else:
                span = k_ref.amax(-1, keepdim=True) - k_ref.amin(-1, keepdim=True)
                half_step = 0.51 * (1.1 if f.meta_bits == 8 else 1)      # m8: scales up to ~9 % coarser
                assert ((k_got - k_ref).abs() <= span / (2 ** min(f.k_bits, 10) - 1) * half_step + 1e-2).all()
            assert (got.keys[bi, hi, :, rk:] == 0).all()                # padded coordinates are exactly zero


def test_per_channel_pages_keep_outlier_channels():
    torch.manual_seed(0)
    store = CompressedStore(torch.tensor([[16]]), torch.tensor([[16]]), [0], high=TierFormat(8, 4),
                            low=TierFormat(4, 2, "channel"), head_dim=16, batch=1, page_bytes=512)
    T = PageLayout.build(TierFormat(4, 2, "channel"), 16, 16, 512).tokens
    keys = torch.randn(1, T, 16)
    keys[..., 3] *= 50                                                  # an outlier channel
    store.write_pages(0, torch.tensor([0]), torch.tensor([0]), keys, torch.randn(1, T, 16),
                      torch.arange(T)[None], torch.zeros(1, T))
    got = store.gather(0)
    k = got.keys[0, 0][got.side[0, 0] == LOW]
    normal = [c for c in range(16) if c != 3]
    err = (k[:, normal] - keys[0][:, normal]).abs().mean()
    assert err < 0.2 * keys[0][:, normal].std()


def test_m8_formats_halve_the_metadata_and_pages_read_back():
    f = TierFormat.parse("K4cV4g32m8")
    assert (f.k_mode, f.v_group, f.meta_bits) == ("channel", 32, 8) and f.name == "K4cV4g32m8"
    assert TierFormat.parse(f.name) == f and TierFormat.parse("K4cV4").meta_bits == 16
    with pytest.raises(ValueError, match="no scales or zeros"):
        TierFormat.parse("K16V16m8")
    fp16, m8 = (PageLayout.build(TierFormat.parse(n), 64, 64, 4096, tracked=False) for n in ("K4cV4", "K4cV4m8"))
    assert m8.v_off - m8.k_meta_off == 64 * 2 and fp16.v_off - fp16.k_meta_off == 64 * 4    # per-channel pairs
    assert m8.tokens > fp16.tokens                                          # the same page holds more tokens
    torch.manual_seed(0)
    store = CompressedStore(torch.tensor([[16]]), torch.tensor([[16]]), [0], high=TierFormat(8, 4),
                            low=TierFormat(4, 4, "channel", meta_bits=8), head_dim=16, batch=1, page_bytes=512,
                            low_tracked=False)
    T = store.groups[0][0].layouts[LOW].tokens
    keys, values = torch.randn(1, T, 16) + torch.linspace(-2, 2, 16), torch.randn(1, T, 16)
    store.write_pages(0, torch.tensor([0]), torch.tensor([0]), keys, values, torch.arange(T)[None],
                      torch.zeros(1, T))
    got = store.gather(0)
    low = got.side[0, 0] == LOW
    k_span = keys[0].amax(0) - keys[0].amin(0)                               # per channel over the page
    v_span = values[0].amax(-1, keepdim=True) - values[0].amin(-1, keepdim=True)   # per token
    assert ((got.keys[0, 0][low] - keys[0]).abs() <= k_span / 15 * 0.55).all()
    assert ((got.values[0, 0][low] - values[0]).abs() <= v_span / 15 * 0.55).all()


def test_prompt_classification_and_window():
    policy = TieringConfig(window=2, alpha_high=2.0, alpha_low=0.5)
    N = 8
    pos = torch.arange(N)[None, None]
    seen = (N - pos).float()
    mean = torch.tensor([[[0.5, 0.3, 0.2, 0.05, 0.01, 0.3, 0.0, 0.0]]])  # desired mean significance
    tier = classify_prompt(policy, mean * seen, pos, torch.zeros(1, dtype=torch.long), torch.tensor([N]))
    # thresholds: high >= 2/8 = 0.25, low >= 0.5/8 = 0.0625; the last 2 tokens are the window
    assert tier[0, 0].tolist() == [T_HIGH, T_HIGH, T_LOW, PRUNED, PRUNED, T_HIGH, T_HIGH, T_HIGH]


def _actions(hi_mean, lo_mean, length, window=2, channel=False, tiering=None):
    """decode_actions for one (sequence, head) given the mean significance of each high and low slot."""
    tiering = tiering or TieringConfig(window=window, alpha_high=2.0, alpha_low=0.5)
    L = torch.tensor([length])
    hi_pos = torch.arange(len(hi_mean)).view(1, 1, -1)
    lo_pos = torch.arange(len(lo_mean)).view(1, 1, -1)        # the policy only needs how many queries saw them
    hi_s = torch.tensor(hi_mean).view(1, 1, -1) * (L - hi_pos)
    lo_s = torch.tensor(lo_mean, dtype=torch.float32).view(1, 1, -1) * (L - lo_pos)
    return decode_actions(tiering, hi_s, hi_pos, lo_s, lo_pos, torch.zeros(1, dtype=torch.long), L, channel)


def test_algorithm1_branches():
    # length 8, window 2 -> candidate t_c is cache index 5; thresholds high 0.25, low 0.0625
    # t_c high (0.3): the least significant eligible high token (index 1, 0.1) is downgraded to low
    a = _actions([0.5, 0.1, 0.4, 0.3, 0.5, 0.3, 0.9, 0.9], [], 8)
    assert (a.high_to_low.item(), a.prune_high.item(), a.prune_low.item()) == (1, -1, -1)
    # t_c high, victim below the low threshold: pruned instead
    a = _actions([0.5, 0.01, 0.4, 0.3, 0.5, 0.3, 0.9, 0.9], [], 8)
    assert (a.high_to_low.item(), a.prune_high.item()) == (-1, 1)
    # t_c low (0.1): it moves to low, and the least significant low token is pruned if below 0.0625
    a = _actions([0.5, 0.5, 0.4, 0.3, 0.5, 0.1, 0.9, 0.9], [0.2, 0.01], 8)
    assert (a.high_to_low.item(), a.prune_low.item()) == (5, 1)
    # t_c below the low threshold: pruned directly
    a = _actions([0.5, 0.5, 0.4, 0.3, 0.5, 0.01, 0.9, 0.9], [0.2], 8)
    assert (a.high_to_low.item(), a.prune_high.item(), a.prune_low.item()) == (-1, 5, -1)
    # no tiering: nothing ever moves
    a = _actions([0.0] * 8, [], 8, tiering=TieringConfig(window=2))
    assert (a.high_to_low.item(), a.prune_high.item(), a.prune_low.item()) == (-1, -1, -1)


def test_algorithm1_without_pruning_and_with_per_channel_low_pages_takes_no_action():
    """What `DiffKVTiers.decode` skips for alpha_low = 0 with a per-channel low tier: Algorithm 1 then never acts
    (only whole pending low pages move), whatever the scores, lengths and threshold base."""
    from kvcal.runtime.policies.diffkv import decode_actions

    gen = torch.Generator().manual_seed(0)
    for base in ("length", "position"):
        for alpha_high in (0.5, 2.0, 1e9):
            tiering = TieringConfig(window=4, alpha_high=alpha_high, alpha_low=0.0, threshold_base=base)
            for _ in range(20):
                B, H, S, L = 2, 3, 40, 48
                hi_pos = torch.randperm(L, generator=gen)[:S].expand(B, H, S).clone()
                hi_pos[..., -3:] = -1
                lo_pos = torch.randint(0, L, (B, H, 8), generator=gen)
                hi_s = torch.rand(B, H, S, generator=gen) * torch.rand(B, H, S, generator=gen) ** 4
                lo_s = torch.rand(B, H, 8, generator=gen) * 1e-3
                a = decode_actions(tiering, hi_s, hi_pos, lo_s, lo_pos, torch.zeros(B, dtype=torch.long),
                                   torch.full((B,), L), per_channel_low=True)
                assert all(bool((t == -1).all()) for t in (a.high_to_low, a.prune_high, a.prune_low))


def test_decode_policy_keeps_counts_consistent():
    """Tiered decoding on a tiny model: every token-head is in exactly one tier; the window stays high."""
    model, tok = make_model("llama")
    cfg = CompressionConfig(low=TierFormat(4, 2), tiering=TieringConfig(window=4, alpha_high=1.6, alpha_low=1.1))
    cache = KvcalCache.from_bundle(random_bundle(model, tok), model, cfg)
    ids = tok([random_text(60, seed=3)], return_tensors="pt").input_ids
    res = decode_fidelity(model, ids[:, :40], ids[:, 40:], lambda: cache)
    assert abs(sum(res.tiers.values()) - 1) < 1e-6
    assert res.tiers["low"] > 0 and res.tiers["pruned"] > 0
    # KL is a sum over the vocabulary of p (log p - log q); near-identical logits leave float rounding of about
    # vocab x eps x |log p|, which can fall below zero
    assert 0 <= res.top1 <= 1 and res.kl >= -1e-6


def test_scores_are_received_probability():
    """Prefill significance equals the brute-force column sums of the attention probabilities (max over the
    group's query heads)."""
    torch.manual_seed(0)
    B, H, g, n, d = 1, 2, 2, 6, 8
    q, k, v = torch.randn(B, H, g, n, d), torch.randn(B, H, n, d), torch.randn(B, H, n, d)
    from kvcal.runtime.backends.reference import TorchBackend

    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
    out, score = TorchBackend.prefill(q, k, v, mask, 0.3)
    logits = torch.einsum("bhgnd,bhsd->bhgns", q, k) * 0.3
    probs = torch.softmax(logits.masked_fill(~mask[:, None, None], float("-inf")), -1)
    torch.testing.assert_close(score, probs.amax(2).sum(2))
    torch.testing.assert_close(out, probs @ v[:, :, None])


def test_ragged_ranks_per_head():
    model, tok = make_model("llama")
    rank = torch.tensor([[16, 8], [12, 16]], dtype=torch.int32)
    bundle = random_bundle(model, tok, rank_k=rank, rank_v=rank.flip(-1))
    cfg = CompressionConfig(high=TierFormat(32, 32))
    cache = KvcalCache.from_bundle(bundle, model, cfg)
    generate_scored(model, padded_batch(tok), cache, n=4)
    kv: CompressedKV = cache.kv
    assert [len(kv.store.groups[layer]) for layer in kv.layers] == [2, 2]
    assert kv.rotation[0].shape == (2, 16, 16) and (kv.rotation[0][1, :, 8:] == 0).all()


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_probe_replay_equals_full_run(model_type):
    """DecodeProbe (recorded prefill, replayed writes) gives the same logits as running the prefill per setting."""
    from kvcal.eval import DecodeProbe

    model, tok = make_model(model_type)
    bundle = random_bundle(model, tok)
    ids = tok([random_text(70, seed=5), random_text(70, seed=6)], return_tensors="pt").input_ids
    cfg = CompressionConfig(low=TierFormat(4, 2, "channel"), tiering=TieringConfig(window=4, alpha_high=1.6,
                                                                                alpha_low=1.1))
    probe = DecodeProbe(model, bundle, ids[:, :40], ids[:, 40:])
    replayed = probe.measure(cfg)
    full = decode_fidelity(model, ids[:, :40], ids[:, 40:], lambda: KvcalCache.from_bundle(bundle, model, cfg))
    assert replayed.top1 == full.top1 and abs(replayed.kl - full.kl) < 1e-6
    assert replayed.memory == full.memory and replayed.tiers == full.tiers


def test_per_channel_low_tier_seals_pages_in_prefill_and_decode():
    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    ids = tok([random_text(90, seed=7)], return_tensors="pt").input_ids
    cfg = CompressionConfig(low=TierFormat(4, 2, "channel"),
                            tiering=TieringConfig(window=4, alpha_high=2.0, alpha_low=0.9))
    cache = KvcalCache.from_bundle(bundle, model, cfg, serve=ServeOptions(page_bytes=256))
    with torch.no_grad():
        model(input_ids=ids[:, :50], cache=cache, use_cache=True)
        T_low = cache.kv.store.groups[0][0].layouts[LOW].tokens
        after_prefill = cache.kv.store.fill[:, :, :, LOW].clone()
        low = cache.kv.store.gather(0)
        for b, h in torch.nonzero(after_prefill[0] > 0).tolist():   # each prefill page: neighbours in position order
            pos = low.pos[b, h][low.side[b, h] == LOW][:int(after_prefill[0, b, h])].view(-1, T_low)
            assert bool((pos.diff(dim=1) > 0).all()), pos
        for t in range(50, 89):
            model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
        cache_tokens = cache.kv.store.fill[:, :, :, LOW]
    assert int(after_prefill.sum()) > 0 and bool((after_prefill % T_low == 0).all())   # whole pages only
    assert bool((cache_tokens > after_prefill).any())                                   # sealed during decode too
    assert bool((cache_tokens % T_low == 0).all())


class ProjectedCache(DynamicCache):
    """Dense reference for low rank: the cache keeps K·P_k and V·P_v (P = B_r B_r^T); prefill attends to the
    unprojected prompt (as kvcal's prefill does), decode steps attend to projected K/V, new token included."""

    def __init__(self, model, pk, pv):
        super().__init__(config=model.config)
        self.pk, self.pv = pk, pv                         # [L, H, d, d]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k = torch.einsum("bhnd,hde->bhne", key_states, self.pk[layer_idx])
        v = torch.einsum("bhnd,hde->bhne", value_states, self.pv[layer_idx])
        prefill = self.layers[layer_idx].get_seq_length() == 0 if layer_idx < len(self.layers) else True
        keys, values = super().update(k, v, layer_idx, *args, **kwargs)
        if prefill:
            return key_states, value_states
        return keys, values


def test_low_rank_matches_projected_reference():
    model, tok = make_model("llama")
    rank_k = torch.tensor([[8, 12], [16, 5]], dtype=torch.int32)
    rank_v = torch.tensor([[10, 16], [4, 13]], dtype=torch.int32)
    bundle = random_bundle(model, tok, rank_k=rank_k, rank_v=rank_v)
    proj = lambda basis, rank: torch.stack([torch.stack([basis[l, h, :, :rank[l, h]] @ basis[l, h, :, :rank[l, h]].T
                                                         for h in range(rank.shape[1])])
                                            for l in range(rank.shape[0])])  # noqa: E731
    ref_cache = ProjectedCache(model, proj(bundle.qk_rotation, rank_k), proj(bundle.v_basis, rank_v))
    inputs = padded_batch(tok)
    ref = generate_scored(model, inputs, ref_cache, n=12)
    cfg = CompressionConfig(high=TierFormat(32, 32), low=TierFormat(32, 32))
    got = generate_scored(model, inputs, KvcalCache.from_bundle(bundle, model, cfg), n=12)
    assert max((a - b).abs().max().item() for a, b in zip(ref.scores, got.scores)) < 1e-4


def test_fastgen_every_head_full_reproduces_dense():
    from kvcal.runtime.policies.fastgen import FULL, FastGenConfig

    model, tok = make_model("llama")
    inputs = padded_batch(tok)
    ref = generate_scored(model, inputs, DynamicCache(config=model.config))
    cfg = CompressionConfig.none().with_(fastgen=FastGenConfig(recovery=1.0, r_local=0.0, r_frequent=0.0))
    cache = KvcalCache.from_bundle(random_bundle(model, tok), model, cfg, tokenizer=tok)
    got = generate_scored(model, inputs, cache)
    assert all(bool((p == FULL).all()) for p in cache.kv.policy("fastgen").choice.values())
    assert torch.equal(ref.sequences, got.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.scores, got.scores)) < 1e-4


def test_fastgen_prunes_and_replays():
    from kvcal.eval import DecodeProbe
    from kvcal.runtime.policies.fastgen import FastGenConfig

    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    ids = tok([random_text(70, seed=8), random_text(70, seed=9)], return_tensors="pt").input_ids
    fast = FastGenConfig(recovery=0.5)
    cfg = CompressionConfig(fastgen=fast)
    with pytest.raises(ValueError, match="tokenizer"):
        KvcalCache.from_bundle(bundle, model, cfg)
    full = decode_fidelity(model, ids[:, :40], ids[:, 40:],
                           lambda: KvcalCache.from_bundle(bundle, model, cfg, tokenizer=tok))
    assert full.tiers["pruned"] > 0.1 and full.tiers["low"] == 0
    probe = DecodeProbe(model, bundle, ids[:, :40], ids[:, 40:], tokenizer=tok, fastgen=fast)
    replayed = probe.measure(cfg)
    assert replayed.top1 == full.top1 and abs(replayed.kl - full.kl) < 1e-6 and replayed.tiers == full.tiers


def test_fastgen_token_ids_go_to_the_cache_of_each_call():
    """Two FastGen caches taking turns on one model each see only their own tokens (the decoder pre-hook hands the
    ids to the cache of the call), so interleaved decoding equals running each alone; `inputs_embeds` is refused."""
    from kvcal.runtime.policies.fastgen import FastGenConfig

    model, tok = make_model("llama")
    bundle = random_bundle(model, tok)
    cfg = CompressionConfig(fastgen=FastGenConfig(recovery=0.5))
    prompts = [tok([random_text(50, seed=s)], return_tensors="pt").input_ids for s in (3, 4)]

    def steps(cache, ids, n=6):
        out = model(input_ids=ids, cache=cache, use_cache=True)
        yield out.logits[:, -1]
        for _ in range(n):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
            yield out.logits[:, -1]

    with torch.no_grad():
        alone = [list(steps(KvcalCache.from_bundle(bundle, model, cfg, tokenizer=tok), p)) for p in prompts]
        runs = [steps(KvcalCache.from_bundle(bundle, model, cfg, tokenizer=tok), p) for p in prompts]
        together = [[], []]
        for pair in zip(*runs):
            for i, logits in enumerate(pair):
                together[i].append(logits)
        for a, b in zip(alone, together):
            torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=0, atol=0)
        cache = KvcalCache.from_bundle(bundle, model, cfg, tokenizer=tok)
        with pytest.raises(ValueError, match="`input_ids`, not `inputs_embeds`"):
            model(inputs_embeds=model.get_input_embeddings()(prompts[0]), cache=cache, use_cache=True)


def test_runtime_depends_only_on_torch_safetensors_transformers():
    """Every import in kvcal/runtime, lazy ones included, is the standard library, the runtime itself, torch,
    safetensors or transformers (the optional cuda backend adds cuda-python and its numpy)."""
    import ast
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "kvcal" / "runtime"
    allowed = {"torch", "safetensors", "transformers"}
    bad = []
    for f in sorted(root.rglob("*.py")):
        extra = {"cuda", "numpy"} if "cuda" in f.relative_to(root).parts else set()
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                if name.startswith("kvcal.runtime") or top in sys.stdlib_module_names | allowed | extra:
                    continue
                bad.append(f"{f.relative_to(root)}: {name}")
    assert not bad, bad


@pytest.mark.parametrize("B,m", [(1, 3), (4, 1), (3, 5)])
def test_per_head_matmul_is_the_per_head_product(B, m):
    """The decode projections (one bmm, batch folded into rows) equal x·w per (sequence, head), from strided inputs
    as transformers hands them (query transposed from [B, n, H, d])."""
    from kvcal.runtime.cache import per_head_matmul

    gen = torch.Generator().manual_seed(B * 10 + m)
    H, d, r = 3, 8, 6
    x = torch.randn(B, m, H, d, generator=gen).transpose(1, 2)                 # [B, H, m, d], not contiguous
    w = torch.randn(H, d, r, generator=gen)
    got = per_head_matmul(x, w)
    assert got.shape == (B, H, m, r)
    for b in range(B):
        for h in range(H):
            torch.testing.assert_close(got[b, h], x[b, h] @ w[h], rtol=1e-6, atol=1e-6)
