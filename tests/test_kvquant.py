"""The KVQuant-style bench baseline on tiny random models: RoPE undone exactly, outliers kept bit-exactly, 3-bit
packing, error falling with bits, bytes equal to the layout's formula, and decoding that tracks dense."""

import pytest
import torch
from conftest import decode_logits, make_model, random_text
from transformers import DynamicCache

from kvcal.bench import kvquant as KQ
from kvcal.bench.rope import RopeTable, apply_rope, undo_rope
from kvcal.models import adapter_for
from kvcal.runtime.storage.quant import pack

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(tok, n_seq=2, n_words=70, seed=0):
    rows = [tok(random_text(n_words + 10, seed=seed + s), return_tensors="pt").input_ids[0, :n_words]
            for s in range(n_seq)]
    return torch.stack(rows)


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama and its KVQuant calibration on two windows of other text."""
    model, tok = make_model("llama")
    a = adapter_for(model.config)
    calib = _ids(tok, n_seq=2, n_words=100, seed=50)
    return model, tok, a, KQ.kvquant_calibration(model, a, calib)


# --------------------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("family, module, layers", [("llama", "k_proj", [0, 1]), ("qwen2", "k_proj", [0, 1]),
                                                    ("gemma3_text", "k_norm", [2])])
def test_undo_rope_gives_the_models_pre_rope_keys_and_rope_restores_them(family, module, layers):
    """The keys before RoPE are what the model computed before applying it (k_proj's output, or Gemma3's QK-norm's);
    RoPE of them is the cached key again, to fp32 precision."""
    model, tok = make_model(family)
    a = adapter_for(model.config)
    ids = _ids(tok)
    B, S = ids.shape
    seen = {}
    hooks = [getattr(a.attention(model, i), module).register_forward_hook(
        lambda mod, args, out, i=i: seen.__setitem__(i, out)) for i in layers]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    for h in hooks:
        h.remove()
    cos, sin = RopeTable(model.model.rotary_emb)(S, "cpu")
    for i in layers:
        post = cache.layers[i].keys                                                      # [B, H, S, d]
        pre = seen[i].reshape(B, S, a.num_kv_heads, a.head_dim).transpose(1, 2)
        torch.testing.assert_close(undo_rope(post, cos, sin), pre, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(apply_rope(undo_rope(post, cos, sin), cos, sin), post, atol=1e-5, rtol=1e-5)
        assert (post - pre).abs().max() > 0.1                                            # RoPE did move them


# --------------------------------------------------------------------------------------------- codes


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_codes_round_trips_and_keeps_packs_layout(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 5, 21), generator=g, dtype=torch.uint8)
    packed = KQ.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == (21 * bits + 7) // 8
    assert torch.equal(KQ.unpack_codes(packed, bits, 21), codes)
    # the bit-plane packer (the 3-bit path) lays codes out as quant.pack does, where both apply
    assert torch.equal(KQ.unpack_bitplanes(KQ.pack_bitplanes(codes, bits), bits, 21), codes)
    if bits != 3:
        assert torch.equal(KQ.pack_bitplanes(codes, bits), pack(codes, bits))
    else:                                        # 1 + 2 << 3 + 3 << 6 + ... + 7 << 18 = 0x1F58D1, little-endian
        assert KQ.pack_codes(torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8), 3).tolist() == [0xD1, 0x58,
                                                                                                          0x1F]


def test_outliers_round_trip_bit_exactly():
    """The m largest normalised elements of each key / value vector come back bit-exactly (fp16 data), the rest
    within the codebook's reach."""
    g = torch.Generator().manual_seed(0)
    B, H, n, d, m = 2, 3, 17, 64, 2
    x = torch.randn(B, H, n, d, generator=g)
    x[..., 5] += 50                                                      # an outlier channel (keys)
    x[0, 1, 3, 9] = 300.0                                                # a lone outlier
    x = x.half().float()                                                 # representable in fp16: exact means equal
    center, half = torch.zeros(H, d), torch.full((H, d), 3.0)          # keys' inliers land within +-1.5
    book = torch.linspace(-1.5, 1.5, 16)
    for enc, dec in ((lambda: KQ.encode_keys(x, center, half, book, 4, m, torch.float16),
                      lambda q: KQ.decode_keys(q, center, half, book, 4, d)),
                     (lambda: KQ.encode_values(x, book, 4, m, torch.float16),
                      lambda q: KQ.decode_values(q, book, 4, d))):
        q = enc()
        got = dec(q)
        top = x.abs().topk(m, dim=-1).indices
        assert torch.equal(q["idx"].long().sort(-1).values, top.sort(-1).values)
        assert torch.equal(got.gather(-1, top), x.gather(-1, top))     # bit-exact
        assert bool((got[..., 5] == x[..., 5]).all()) and got[0, 1, 3, 9] == 300.0
        rest = torch.ones_like(x, dtype=torch.bool).scatter_(-1, top, False)
        assert (got - x)[rest].abs().max() < 0.5                         # inliers: coded to the nearest level


def test_reconstruction_error_drops_as_bits_grow(tiny):
    model, tok, a, calib = tiny
    ids = _ids(tok, n_words=60, seed=20)
    dense = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, cache=dense, use_cache=True)
    errors = []
    for bits in (2, 3, 4):
        cache = KQ.KVQuantCache(model, calib, bits, bits, list(a.layer_types))
        with torch.inference_mode():
            model(input_ids=ids, cache=cache, use_cache=True)
        err = 0.0
        for layer, ref in zip(cache.layers, dense.layers):
            k, v = layer._read()
            assert torch.equal(k[:, :, 0], ref.keys[:, :, 0].half().float())     # the sink token: fp16, whole
            err += ((k - ref.keys) ** 2).sum() / (ref.keys ** 2).sum() + ((v - ref.values) ** 2).sum() / (
                ref.values ** 2).sum()
        errors.append(float(err))
    assert errors[0] > errors[1] > errors[2] > 0, errors
    assert errors[2] < errors[0] / 4, errors                             # each bit roughly halves the step


# --------------------------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("family, bits", [("llama", 3), ("llama", 2), ("gemma3_text", 4)])
def test_memory_is_the_layouts_formula(family, bits):
    model, tok = make_model(family)
    a = adapter_for(model.config)
    calib = KQ.kvquant_calibration(model, a, _ids(tok, n_words=100, seed=50))
    ids = _ids(tok, n_words=50)
    cache = KQ.KVQuantCache(model, calib, bits, bits, list(a.layer_types))
    decode_logits(model, cache, ids, 40)
    B, S = ids.shape
    H, d, m = a.num_kv_heads, a.head_dim, KQ.outlier_count(a.head_dim)
    assert m == 1 and calib.outliers == m
    full = [i for i in range(a.num_layers) if not a.is_sliding(i)]
    # per full layer, sequence and KV head: token 0 whole in fp16 (K and V), then per token the K and V codes,
    # the value's fp16 centre and half-range, and m outliers of K and of V (fp16 value + uint8 index)
    per = 2 * d * 2 + (S - 1) * 2 * ((d * bits + 7) // 8)
    per += (S - 1) * (2 * 2 + 2 * m * (2 + 1))
    sliding = sum(layer.keys.numel() * 2 * 2 for i, layer in enumerate(cache.layers) if a.is_sliding(i))  # 16-bit
    mem = cache.memory()
    assert mem["total_bytes"] == len(full) * B * H * per + sliding
    sliding_fp16 = sum(layer.keys.numel() * 2 * 2 for i, layer in enumerate(cache.layers) if a.is_sliding(i))
    assert mem["fp16_bytes"] == len(full) * B * H * S * d * 2 * 2 + sliding_fp16
    assert mem["fixed_bytes"] == KQ.fixed_bytes(len(full), H, d, bits, bits)
    assert mem["ratio_to_fp16"] == mem["total_bytes"] / mem["fp16_bytes"]


# --------------------------------------------------------------------------------------------- decoding


def test_decoding_tracks_dense_better_at_4_bits_than_at_2(tiny):
    model, tok, a, calib = tiny
    ids = _ids(tok, n_words=70, seed=30)
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[:, 39:].log_softmax(-1)
    kl = {}
    for bits in (2, 4):
        got = decode_logits(model, KQ.KVQuantCache(model, calib, bits, bits, list(a.layer_types)), ids, 40)
        kl[bits] = float((ref.exp() * (ref - got.log_softmax(-1))).sum(-1).mean())
    assert 0 < kl[4] < kl[2] / 4, kl
    with torch.inference_mode():                                         # and it serves `generate`
        out = model.generate(input_ids=ids[:1, :40], max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id,
                             cache=KQ.KVQuantCache(model, calib, 4, 4, list(a.layer_types)))
    assert out.shape == (1, 46)


def test_methods_calibrate_once_on_first_use(tiny):
    model, tok, a, calib = tiny
    calls = []

    def calibration():
        calls.append(1)
        return calib

    methods = KQ.kvquant_methods(model, a, calibration, 2, 200)
    assert [m.key for m in methods] == ["kvquant-k4v4", "kvquant-k3v3", "kvquant-k2v2"] and not calls
    assert {m.family for m in methods} == {"quantization"} and {m.series for m in methods} == {"KVQuant-style"}
    cache = methods[2].make_cache(model, tok)
    assert len(calls) == 1 and cache.k_bits == cache.v_bits == 2
    assert cache.memory()["fixed_bytes"] == KQ.fixed_bytes(a.num_layers, a.num_kv_heads, a.head_dim, 2, 2)
