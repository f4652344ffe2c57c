"""Quantized sliding-window layers (`CompressionConfig.sliding`, kvcal.runtime.hf.sliding) on a tiny Gemma3: the window
transformers keeps, in fewer bytes, with logits near dense; the settings codec; the refusals."""

import pytest
import torch
from conftest import decode_logits, make_model, random_bundle, random_text

from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.hf import KvcalCache
from kvcal.runtime.hf.sliding import QuantizedSlidingLayer
from kvcal.runtime.storage import quant
from kvcal.runtime.storage.layout import TierFormat

pytestmark = pytest.mark.usefixtures("one_thread")


def _serve(sliding: str | None, steps: int = 12, sliding_layers: tuple = (), sliding_recent: int = 0,
           page_tokens: int | None = None):
    model, tok = make_model("gemma3_text")
    bundle = random_bundle(model, tok)
    config = CompressionConfig(high=TierFormat(16, 16), sliding=TierFormat.parse(sliding) if sliding else None,
                               sliding_layers=sliding_layers, sliding_recent=sliding_recent, page_tokens=page_tokens)
    ids = tok([random_text(60, seed=1), random_text(60, seed=2)], return_tensors="pt").input_ids[:, :48]
    cache = KvcalCache.from_bundle(bundle, model, config)
    logits = decode_logits(model, cache, ids, ids.shape[1] - steps)
    return logits, cache, model


def test_sliding_layers_keep_the_window_in_the_format_bytes():
    logits, cache, model = _serve("K8V4")
    window, d, H = model.config.sliding_window, model.config.head_dim, model.config.num_key_value_heads
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(isinstance(layer, QuantizedSlidingLayer) for layer in sliding)
    mem = cache.memory()
    per_token = quant.packed_size(d, 8) + quant.packed_size(d, 4) + 2 * 4     # codes + one (scale, zero) each
    assert mem["sliding_bytes"] == len(sliding) * 2 * H * (window - 1) * per_token
    dense_logits, dense_cache, _ = _serve(None)
    dense_mem = dense_cache.memory()
    assert dense_mem["sliding_bytes"] == len(sliding) * 2 * H * (window - 1) * d * 2 * 2      # 16-bit, as served
    assert mem["fp16_bytes"] == dense_mem["fp16_bytes"] and mem["total_bytes"] < dense_mem["total_bytes"]
    # 8-bit keys and 4-bit values in the rotated, mixed basis: near the dense window, not equal to it
    p, q = torch.log_softmax(dense_logits, -1), torch.log_softmax(logits, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert 0 < kl.max() < 0.01                    # (a random tiny model's flat logits make top-1 meaningless)


def test_coarser_sliding_formats_cost_fewer_bytes_and_more_error():
    dense_logits, _, _ = _serve(None)
    p = torch.log_softmax(dense_logits, -1)
    kls, sizes = [], []
    for fmt in ("K8V8", "K4V4", "K2V2"):
        logits, cache, _ = _serve(fmt)
        q = torch.log_softmax(logits, -1)
        kls.append(float((p.exp() * (p - q)).sum(-1).mean()))
        sizes.append(cache.memory()["sliding_bytes"])
    assert sizes[0] > sizes[1] > sizes[2] and kls[0] < kls[1] < kls[2]


def test_a_sliding_layers_own_format_holds_its_window_in_that_formats_bytes():
    """`sliding_layers`: the named layer stores its window in its own format, the others in `sliding`."""
    _, base, model = _serve("K8V4")
    sliding = [i for i, layer in enumerate(base.layers) if layer.is_sliding]
    _, cache, _ = _serve("K8V4", sliding_layers=((sliding[0], TierFormat.parse("K4V4")),))
    assert [cache.layers[i].fmt.name for i in sliding] == ["K4V4"] + ["K8V4"] * (len(sliding) - 1)
    window, d, H = model.config.sliding_window, model.config.head_dim, model.config.num_key_value_heads
    saved = 2 * H * (window - 1) * (quant.packed_size(d, 8) - quant.packed_size(d, 4))     # 4-bit keys, one layer
    assert base.memory()["sliding_bytes"] - cache.memory()["sliding_bytes"] == saved


# m8: 8-bit scales and zeros; kg8: a key (scale, zero) per 8 channels
@pytest.mark.parametrize("fmt,pair,k_groups", [("K8V4g16", 4, 1), ("K8V4g16m8", 2, 1), ("K8V4g16kg8m8", 2, 4)])
def test_a_quantized_row_holds_codes_then_scales_and_reads_back(fmt, pair, k_groups):
    gen = torch.Generator().manual_seed(0)
    H, d = 2, 32
    rotation = torch.linalg.qr(torch.randn(H, d, d, generator=gen))[0]
    layer = QuantizedSlidingLayer(6, TierFormat.parse(fmt), rotation, torch.eye(d).expand(H, d, d))
    k, v = torch.randn(1, H, 9, d, generator=gen), torch.randn(1, H, 9, d, generator=gen)
    out_k, out_v = layer.update(k, v)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)        # first call: no old tokens, new ones as given
    k_row, v_row = d + k_groups * pair, d // 2 + 2 * pair
    assert layer.keys.shape == (1, H, 5, k_row) and layer.values.shape == (1, H, 5, v_row)
    assert layer.get_seq_length() == 9 and layer.get_mask_sizes(1) == (6, 4)   # transformers' sliding semantics
    k2, v2 = torch.randn(1, H, 1, d, generator=gen), torch.randn(1, H, 1, d, generator=gen)
    old_k, old_v = (t[:, :, :5] for t in layer.update(k2, v2))
    torch.testing.assert_close(old_k, k[:, :, 4:], atol=0.03, rtol=0)           # 8 bits over each token's range
    torch.testing.assert_close(old_v, v[:, :, 4:], atol=0.4, rtol=0)            # 4 bits per group of 16
    assert layer.held_bytes() == H * 5 * (k_row + v_row)


def test_settings_codec_and_refusals():
    config = CompressionConfig(sliding=TierFormat.parse("K4V4g32"))
    assert config.to_dict()["sliding"] == "K4V4g32"
    assert CompressionConfig.from_dict(config.to_dict()) == config
    assert "sliding" not in CompressionConfig().to_dict() and CompressionConfig.from_dict({}).sliding is None
    from kvcal.profile.report import settings_in_words

    assert "sliding-window layers K4V4g32 (4-bit keys, 4-bit values with a scale per 32 channels)" in \
        settings_in_words(config.to_dict())
    for bad in ("K4sV4", "K16V16"):
        with pytest.raises(ValueError, match="sliding-layer format .* must quantize keys per token or per channel"):
            CompressionConfig(sliding=TierFormat.parse(bad))
    layer = QuantizedSlidingLayer(8, TierFormat.parse("K8V4"), torch.eye(4).expand(1, 4, 4),
                                  torch.eye(4).expand(1, 4, 4))
    with pytest.raises(NotImplementedError, match="cannot be rolled back"):
        layer.activate_past_recording()


def _layers(recent: int, window: int = 12, d: int = 8):
    rotation = torch.linalg.qr(torch.randn(1, d, d, generator=torch.Generator().manual_seed(0)))[0]
    basis = torch.linalg.qr(torch.randn(1, d, d, generator=torch.Generator().manual_seed(1)))[0]
    return [QuantizedSlidingLayer(window, TierFormat.parse("K4V4m8"), rotation, basis, recent=r) for r in (0, recent)]


# Two layers that hold the same token rotate it (encode) and rotate it back (decode) in GEMMs over different numbers
# of tokens. The BLAS picks its kernel and its summation order by shape and instruction set, so the same token can
# read back a few ulp apart (2.4e-7 seen with AVX-512). Each coordinate is a sum of d = 8 products of unit-scale
# numbers, so reordering moves it by at most about d * eps * 8 < 1e-5; a token quantized differently (from another
# input or at another time) moves by a quantization step, at least 1e-2 for these 8-bit keys and 4-bit values.
REORDERED = {"rtol": 0, "atol": 1e-5}


@pytest.mark.float_order
def test_the_recent_tokens_stay_as_they_came_and_the_older_ones_as_without_them():
    """`sliding_recent`: the newest r tokens are read back exactly and cost 2 bytes an element; a token that leaves
    them is quantized from what came, so it reads back as a layer without recent tokens stores it (up to float
    order: `REORDERED`)."""
    r, window = 4, 12
    plain, with_recent = _layers(r, window)
    g = torch.Generator().manual_seed(2)
    seen = []
    for n in (7, 1, 3, 1, 1, 1, 1, 1, 1, 1):           # a prompt, then decode steps past the window (11 kept)
        k, v = torch.randn(2, 1, n, 8, generator=g), torch.randn(2, 1, n, 8, generator=g)
        seen.append(k)
        (k0, v0), (k1, v1) = plain.update(k, v), with_recent.update(k, v)
        assert k1.shape == k0.shape and v1.shape == v0.shape
        past = torch.cat(seen, -2)[:, :, -k1.shape[-2]:]
        held = k1.shape[-2] - n                          # tokens read from the cache, the new ones after them
        newest = min(r, held)
        torch.testing.assert_close(k1[:, :, held - newest:], past[:, :, held - newest:], rtol=0, atol=0)
        torch.testing.assert_close(k1[:, :, :held - newest], k0[:, :, :held - newest], **REORDERED)
        torch.testing.assert_close(v1[:, :, :held - newest], v0[:, :, :held - newest], **REORDERED)
        assert not torch.equal(k0[:, :, held - newest:held], past[:, :, held - newest:held]) or newest == 0
    assert with_recent.tokens_held() == plain.tokens_held() == 2 * (window - 1)
    row = plain.held_bytes() // plain.tokens_held()
    assert with_recent.held_bytes() == 2 * ((window - 1 - r) * row + r * 2 * 8 * 2)


@pytest.mark.float_order
def test_recent_tokens_follow_batch_edits_and_crop():
    plain, layer = _layers(4)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 1, 8, 8, generator=g), torch.randn(3, 1, 8, 8, generator=g)
    for each in (plain, layer):
        each.update(k, v)
        each.batch_select_indices(torch.tensor([2, 0]))
    quantized, _ = plain.update(k[:2, :, :1], v[:2, :, :1])
    keys, _ = layer.update(k[:2, :, :1], v[:2, :, :1])
    torch.testing.assert_close(keys[:, :, 4:8], k[[2, 0], :, 4:8], rtol=0, atol=0)     # the recent ones
    layer.crop(-3)              # 9 held (tokens 0-4 quantized, 5-8 recent): the 3 newest go, all recent ones
    assert layer.get_seq_length() == 6 and layer.tokens_held() == 2 * 6
    again, _ = layer.update(k[:2, :, :1], v[:2, :, :1])
    torch.testing.assert_close(again[:, :, :5], quantized[:, :, :5], **REORDERED)
    torch.testing.assert_close(again[:, :, 5], k[[2, 0], :, 5], rtol=0, atol=0)


def test_recent_tokens_in_the_cache_settings_and_bytes():
    logits, cache, model = _serve("K4V4", sliding_recent=6)
    plain_logits, plain, _ = _serve("K4V4")
    dense_logits, _, _ = _serve(None)
    window, d, H = model.config.sliding_window, model.config.head_dim, model.config.num_key_value_heads
    n = sum(layer.is_sliding for layer in cache.layers)
    per_token = quant.packed_size(d, 4) * 2 + 2 * 4
    assert cache.memory()["sliding_bytes"] == n * 2 * H * ((window - 1 - 6) * per_token + 6 * d * 2 * 2)
    p = torch.log_softmax(dense_logits, -1)

    def kl(x):
        q = torch.log_softmax(x, -1)
        return float((p.exp() * (p - q)).sum(-1).mean())

    assert kl(logits) < kl(plain_logits)
    config = CompressionConfig(sliding=TierFormat.parse("K4V4"), sliding_recent=6)
    assert config.to_dict()["sliding_recent"] == 6 and CompressionConfig.from_dict(config.to_dict()) == config
    assert "sliding_recent" not in CompressionConfig(sliding=TierFormat.parse("K4V4")).to_dict()
    from kvcal.runtime.config import split_sliding_spec  # the "+r" spec of the search and benchmarks

    assert config.sliding_spec == "K4V4+6" and split_sliding_spec("K4V4+6") == ("K4V4", 6)
    assert split_sliding_spec("K4V4") == ("K4V4", None) and CompressionConfig().sliding_spec is None
    for bad in ({"sliding_recent": -1, "sliding": TierFormat.parse("K4V4")}, {"sliding_recent": 4}):
        with pytest.raises(ValueError, match="must be a non-negative integer, and 0 unless"):
            CompressionConfig(**bad)


def test_the_manifest_export_refuses_quantized_sliding_layers(tmp_path):
    from kvcal.export import export_manifest

    model, tok = make_model("gemma3_text")
    with pytest.raises(ValueError, match="no field for quantized sliding-window layers"):
        export_manifest(random_bundle(model, tok), tmp_path / "m", CompressionConfig(sliding=TierFormat(8, 4)),
                        model=model)
    assert not (tmp_path / "m").exists()


def _blocked(block: int = 4, fmt: str = "K4cV4g16m8", window: int = 20, H: int = 2, d: int = 32):
    gen = torch.Generator().manual_seed(5)
    rotation = torch.linalg.qr(torch.randn(H, d, d, generator=gen))[0]
    return QuantizedSlidingLayer(window, TierFormat.parse(fmt), rotation, torch.eye(d).expand(H, d, d), block=block)


@pytest.mark.float_order
def test_per_channel_keys_wait_for_a_block_then_read_back_as_a_per_channel_page():
    """Per-channel keys (KIVI's layout in a window): the newest tokens wait unquantized until a block of them has
    come; a block is coded with one (scale, zero) per channel over its tokens, exactly as the paged tiers' per-channel
    pages code their keys (`quant.round_trip_per_channel`), up to the rotation's float order (`REORDERED`). Whole
    blocks are held while any of their tokens is in the window, and every byte is counted."""
    block, H, d = 4, 2, 32
    layer = _blocked(block, H=H, d=d)
    keep = layer.sliding_window - 1
    g = torch.Generator().manual_seed(6)
    seen = []
    for n in (13, 1, 1, 1, 1, 5, 1, 1, 9):               # a prompt, then decode steps and chunks past the window
        k, v = torch.randn(1, H, n, d, generator=g), torch.randn(1, H, n, d, generator=g)
        old_len = min(sum(t.shape[2] for t in seen), keep)
        seen.append(k)
        out_k, _ = layer.update(k, v)
        assert out_k.shape[2] == old_len + n and torch.equal(out_k[:, :, old_len:], k)
        kept = min(sum(t.shape[2] for t in seen), keep)
        raw = layer.recent_keys.shape[2]
        coded = layer.values.shape[2]
        assert coded + raw == kept and raw < block and layer.keys.shape[2] % block == 0
        assert 0 <= layer.keys.shape[2] - coded < block and layer.key_scales.shape[2] == layer.keys.shape[2] // block
        assert layer.held_bytes() == (layer.keys.numel() + layer.key_scales.numel() + layer.values.numel()
                                      + 2 * 2 * H * raw * d)
    # the next call reads the window back: its raw tokens exact, its blocks as per-channel pages code them
    past = torch.cat(seen, -2)
    read, _ = layer.update(past[:, :, :0], torch.zeros(1, H, 0, d))
    torch.testing.assert_close(read[:, :, coded:], past[:, :, -raw:] if raw else past[:, :, :0], rtol=0, atol=0)
    first = past.shape[2] - coded - raw - (layer.keys.shape[2] - coded)       # the oldest held block's first token
    blocks = past[:, :, first:past.shape[2] - raw] @ layer.rotation          # [1, H, blocks * block, d]
    pages = quant.round_trip_per_channel(blocks.reshape(1, H, -1, block, d), 4, meta_bits=8)
    expected = (pages.reshape(1, H, -1, d) @ layer.rotation.transpose(-1, -2))[:, :, -coded:]
    torch.testing.assert_close(read[:, :, :coded], expected, **REORDERED)
    assert not torch.equal(read[:, :, :coded], past[:, :, -coded - raw:past.shape[2] - raw])


def test_per_channel_keys_follow_batch_edits_and_crop_only_their_raw_tokens():
    layer = _blocked(block=4, window=40)
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(3, 2, 10, 32, generator=g), torch.randn(3, 2, 10, 32, generator=g)
    layer.update(k, v)                                   # 8 coded in two blocks, 2 raw
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert layer.key_scales.shape[0] == layer.keys.shape[0] == layer.recent_keys.shape[0] == 2
    read, _ = layer.update(k[:2, :, :0], v[:2, :, :0])
    torch.testing.assert_close(read[:, :, 8:], k[[2, 0], :, 8:], rtol=0, atol=0)
    layer.crop(-2)                                       # the two raw tokens
    assert layer.get_seq_length() == 8 and layer.tokens_held() == 2 * 2 * 8
    with pytest.raises(RuntimeError, match="only its 0 unquantized ones can go"):
        layer.crop(-1)


def test_per_channel_sliding_keys_in_the_cache_bytes():
    """A cache whose sliding format keys per channel over blocks of `page_tokens`: the window's coded tokens at
    their codes and values' pairs, a block's per-channel pairs, the unfilled block's tokens at 16 bits."""
    logits, cache, model = _serve("K4cV4g16", page_tokens=4)
    dense_logits, _, _ = _serve(None)
    window, d, H = model.config.sliding_window, model.config.head_dim, model.config.num_key_value_heads
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert all(layer.block == 4 and layer.channel for layer in sliding)
    kept, raw = window - 1, sliding[0].recent_keys.shape[2]         # raw: the unfilled block's tokens
    blocks = -(-(kept - raw) // 4)
    per_layer = 2 * H * (blocks * 4 * quant.packed_size(d, 4) + blocks * 4 * d
                         + (kept - raw) * (quant.packed_size(d, 4) + 4 * d // 16) + raw * 2 * d * 2)
    assert cache.memory()["sliding_bytes"] == len(sliding) * per_layer
    p, q = torch.log_softmax(dense_logits, -1), torch.log_softmax(logits, -1)
    assert 0 < float((p.exp() * (p - q)).sum(-1).max()) < 0.05


@pytest.mark.parametrize("fmt,recent,prompt", [("K4cV4g16m8", 0, 13), ("K4cV4g16m8", 3, 13), ("K4cV4g16m8", 0, 5),
                                               ("K4cV4g16m8", 14, 13), ("K8V4", 0, 9), ("K8V4", 2, 30)])
def test_the_quality_model_knows_which_keys_each_decode_query_reads_exact(fmt, recent, prompt):
    """`quality_model.first_exact` (what the calibration's table and coded probe assume) against the layer itself:
    at every decode step, the query reads exact the tokens the layer holds unquantized, and its own (keys that left
    the window are read by no query, so a boundary before it means the same)."""
    from kvcal.profile.quality_model import first_exact

    window, block, d = 12, 4, 32
    layer = _blocked(block, fmt, window, H=1, d=d)
    layer.recent = recent
    base = CompressionConfig(sliding=TierFormat.parse(fmt), sliding_recent=recent, page_tokens=block)
    g = torch.Generator().manual_seed(8)
    layer.update(torch.randn(1, 1, prompt, d, generator=g), torch.randn(1, 1, prompt, d, generator=g))
    for i in range(prompt, prompt + 3 * block + 2):
        unquantized = layer.recent_keys.shape[2]
        got = int(first_exact(base, True, torch.tensor([i]), prompt, window))
        assert max(got, i - (window - 1)) == i - unquantized, i
        layer.update(torch.randn(1, 1, 1, d, generator=g), torch.randn(1, 1, 1, d, generator=g))


def _random_levels(H: int, bits: int, gen: torch.Generator) -> torch.Tensor:
    """Levels as a bundle holds them (`levels.k.{bits}`' rows): float32 [H, 2**bits], sorted, endpoints 0 and
    2**bits - 1, the inner ones anywhere between."""
    top = (1 << bits) - 1
    inner = torch.rand(H, top - 1, generator=gen).sort(-1).values * top
    return torch.cat([torch.zeros(H, 1), inner, torch.full((H, 1), float(top))], -1)


def _window_after(fmt: str, B: int, H: int, d: int, window: int, block: int, steps: int, recent: int = 0):
    """A served sliding layer (torch reference) after a prompt of 3 * window tokens and `steps` decode tokens: the
    `SlidingWindow` its last step handed to the attention."""
    from kvcal.runtime.hf import pending
    from kvcal.runtime.options import ServeOptions

    gen = torch.Generator().manual_seed(steps)
    rotation = torch.linalg.qr(torch.randn(H, d, d, generator=gen))[0]
    basis = torch.linalg.qr(torch.randn(H, d, d, generator=gen))[0]
    tier = TierFormat.parse(fmt)
    levels = tuple(_random_levels(H, bits, gen) if kind == "calibrated" else None
                   for bits, kind in ((tier.k_bits, tier.k_levels), (tier.v_bits, tier.v_levels)))
    layer = QuantizedSlidingLayer(window, tier, rotation, basis, recent=recent, block=block,
                                  serve=ServeOptions(backend="torch"), levels=levels)
    layer.layer_idx = 0
    layer.update(torch.randn(B, H, 3 * window, d, generator=gen), torch.randn(B, H, 3 * window, d, generator=gen))
    for _ in range(steps):
        layer.update(torch.randn(B, H, 1, d, generator=gen), torch.randn(B, H, 1, d, generator=gen))
        pending.clear()
    return layer, layer.window


# per-channel keys over blocks (the oldest block partly out of the window after 1..9 steps), per-token keys with
# and without groups, fp16 and 8-bit pairs, 2/3/4/8 bits (3-bit codes straddling bytes)
@pytest.mark.parametrize("fmt,steps", [("K8cV8g32m8", 1), ("K4cV4g32m8", 5), ("K2cV2g16", 9), ("K8V4kg8m8", 3),
                                       ("K4V2", 2), ("K2cV4m8", 8), ("K3cV3g32m8", 4), ("K3V3kg8", 7),
                                       # calibrated levels on either side, per-channel and per-token keys
                                       ("K4cnV4ng32m8", 5), ("K2cnV2nm8", 9), ("K3cnV3ng32m8", 4), ("K8cV2ng16", 6),
                                       ("K4nV4kg8m8", 3), ("K2nV3n", 2)])
def test_the_cpu_kernel_reads_a_sliding_window_as_the_torch_reference(fmt, steps):
    """`CpuBackend.sliding_decode` reads the codes in place and equals the torch reference, which dequantizes them,
    within 1e-5 of the output's scale: the same products in another order (dots in 16 lanes, softmax sums in one
    pass) and the kernel's exp, within 2 ulp of std::exp."""
    from kvcal.runtime.backends.base import AttentionBackend
    from kvcal.runtime.backends.cpu.backend import CpuBackend

    pytest.importorskip("kvcal.runtime.backends.cpu.build").load_library()
    B, H, G, d = 2, 2, 3, 64
    _, window = _window_after(fmt, B, H, d, window=40, block=8, steps=steps, recent=3 if steps % 2 else 0)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, G, d, generator=gen)
    r = window.tail_keys.shape[2]
    tail_k, tail_v = torch.randn(B, H, r, d, generator=gen), torch.randn(B, H, r, d, generator=gen)
    visible = torch.ones(B, window.coded + r, dtype=torch.bool)
    visible[0, :steps + 2] = False                      # the first sequence's left padding
    for seen in (None, visible):
        want = AttentionBackend.sliding_decode(window, q, tail_k, tail_v, 0.2, seen)
        got = CpuBackend.sliding_decode(window, q, tail_k, tail_v, 0.2, seen)
        assert window.coded > 0 and r >= 1
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    seen_all = AttentionBackend.sliding_decode(window, q, tail_k, tail_v, 0.2)
    assert torch.equal(want[1], seen_all[1]) and not torch.allclose(want[0], seen_all[0])    # the padding hidden


def test_a_served_decode_step_reads_the_codes_as_attention_reads_the_dequantized_window(monkeypatch):
    """In a KvcalCache a decode step's sliding layers attend to their codes through the backend (`attend`: query
    rotated into the key basis, output back from the value basis) and give the logits transformers' attention gives
    over the dequantized window in the model basis, up to float order (the rotations are applied to the query and
    the output instead of every key and value); with left padding inside the window too, hidden as the mask hides
    it."""
    from kvcal.runtime.backends.base import AttentionBackend

    model, tok = make_model("gemma3_text")
    bundle = random_bundle(model, tok)
    config = CompressionConfig(high=TierFormat(16, 16), sliding=TierFormat.parse("K4cV4g16m8"), page_tokens=8)
    ids = tok([random_text(60, seed=1), random_text(60, seed=2)], return_tensors="pt").input_ids[:, :48]
    calls = []
    reference = AttentionBackend.sliding_decode
    monkeypatch.setattr(AttentionBackend, "sliding_decode",
                        staticmethod(lambda *a: calls.append(1) or reference(*a)))

    def serve(read_codes: bool, mask=None, ids=ids):
        from kvcal.runtime.options import ServeOptions

        cache = KvcalCache.from_bundle(bundle, model, config, serve=ServeOptions(backend="torch"))
        for layer in cache.layers:
            if isinstance(layer, QuantizedSlidingLayer) and not read_codes:
                layer.serve = None            # on its own: `update` returns the dequantized window
        with torch.inference_mode():
            if mask is None:
                return decode_logits(model, cache, ids, 36)
            out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
            step = model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1), cache=cache,
                         use_cache=True)
            return torch.cat([out.logits[:, -1:], step.logits], 1)

    sliding = sum(layer == "sliding_attention" for layer in model.config.layer_types)
    dequantized = serve(False)
    assert not calls
    read = serve(True)
    assert len(calls) == sliding * 12                   # every decode step of every sliding layer
    torch.testing.assert_close(read, dequantized, rtol=0, atol=1e-4 * float(dequantized.abs().max()))
    short = ids[:, :12]                                 # shorter than the window (16): the padding stays in it
    mask = torch.ones_like(short)
    mask[0, :5] = 0                                     # left padding of the first sequence
    calls.clear()
    padded = serve(True, mask, short)
    assert len(calls) == sliding
    want = serve(False, mask, short)
    torch.testing.assert_close(padded, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    calls.clear()
    unmasked = serve(True, torch.ones_like(short), short)   # the same tokens seen, padding and all: other logits
    assert (unmasked[0, -1] - padded[0, -1]).abs().max() > 1e-2 * float(want.abs().max())
    torch.testing.assert_close(unmasked[1], padded[1], rtol=0, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("fmt", ["K4cnV4ng32m8", "K4nV2nkg8", "K4cV4g32m8", "K2cnV3nm8"])
def test_a_sliding_layer_codes_its_window_as_the_quantizer_the_quality_model_calls(fmt):
    """The window a sliding layer holds, read back in the model basis, equals quant's round trips of its tokens in the
    stored bases (per-channel keys over whole blocks, per-token keys and values in their groups), on calibrated
    levels as on uniform ones: the codes the quality model and the coded probe price are the codes served."""
    from kvcal.runtime.hf.sliding import SlidingWindow

    B, H, d, window, block = 2, 2, 64, 40, 8
    gen = torch.Generator().manual_seed(0)
    rotation = torch.linalg.qr(torch.randn(H, d, d, generator=gen))[0]
    basis = torch.linalg.qr(torch.randn(H, d, d, generator=gen))[0]
    tier = TierFormat.parse(fmt)
    k_levels, v_levels = (_random_levels(H, bits, gen) if kind == "calibrated" else None
                          for bits, kind in ((tier.k_bits, tier.k_levels), (tier.v_bits, tier.v_levels)))
    layer = QuantizedSlidingLayer(window, tier, rotation, basis, block=block, levels=(k_levels, v_levels))
    keys, values = torch.randn(B, H, 3 * window, d, generator=gen), torch.randn(B, H, 3 * window, d, generator=gen)
    layer.update(keys, values)
    held = SlidingWindow(tier, layer.block, layer.keys, layer.key_scales, layer.values, layer.recent_keys,
                         layer.recent_values, layer.levels)
    got_k, got_v = layer.model_basis(held)
    n, m = layer.values.shape[2], layer.keys.shape[2]          # coded tokens, and the key rows of their blocks
    assert n > 0 and (m - n < block if tier.k_mode == "channel" else m == n)
    lut = lambda t, *pad: None if t is None else t[(slice(None),) + (None,) * len(pad)]     # noqa: E731
    y = torch.einsum("bhnd,hde->bhne", values[:, :, -(window - 1):][:, :, :n], basis)
    want_v = torch.einsum("bhne,hde->bhnd", quant.round_trip_per_token(y, tier.v_bits, tier.v_group, tier.meta_bits,
                                                                       lut(v_levels, 1)), basis)
    y = torch.einsum("bhnd,hde->bhne", keys[:, :, -(window - 1) - (m - n):][:, :, :m], rotation)
    if tier.k_mode == "channel":
        coded_k = quant.round_trip_per_channel(y.reshape(B, H, m // block, block, d), tier.k_bits, tier.meta_bits,
                                               lut(k_levels, 1, 1)).reshape(B, H, m, d)
    else:
        coded_k = quant.round_trip_per_token(y, tier.k_bits, tier.k_group, tier.meta_bits, lut(k_levels, 1))
    want_k = torch.einsum("bhne,hde->bhnd", coded_k[:, :, m - n:], rotation)
    # the same codes; the rotations back are products over other operand shapes, whose float order may differ: a
    # sum of 64 products of numbers below 4 moves by at most about 64 * 4 * 4 * 2**-24 < 1e-4 (float32), where one
    # 2- to 4-bit step of these unit-scale tokens is above 5e-2
    torch.testing.assert_close(got_v[:, :, :n], want_v, rtol=0, atol=1e-4)
    torch.testing.assert_close(got_k[:, :, :n], want_k, rtol=0, atol=1e-4)
