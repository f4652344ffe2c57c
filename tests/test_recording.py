"""The search's recording (kvcal.profile.recording): its reference is the model's own, and its gradients are those of
the prompt's K/V as decode queries read them."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, random_text

from kvcal.eval import dense_logits
from kvcal.models import adapter_for
from kvcal.profile.recording import _record_window

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(tok, n: int = 90):
    return tok([random_text(300, seed=3)], return_tensors="pt").input_ids[:, :n]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_reference_is_the_dense_forward(model_type):
    """The recording's own attention (query heads stacked per KV head, eager masks; Gemma3's sliding layers read their
    kept window) gives the logits of one dense forward over prompt + continuation, to float order."""
    model, tok = make_model(model_type)
    ids = _ids(tok)
    P = 60
    sliding = [t == "sliding_attention" for t in adapter_for(model.config).layer_types]
    window = _record_window(model, ids[:, :P], ids[:, P:], sliding, chunk=8)
    want = torch.log_softmax(dense_logits(model, ids[:, :-1], start=P), -1)
    ref = window["ref"]
    assert torch.equal(ref.ids[..., 0], want.argmax(-1))
    assert (ref.logp - want.gather(-1, ref.ids)).abs().max() < 1e-4
    assert (ref.target_logp - want.gather(-1, ids[:, P + 1:, None])[..., 0]).abs().max() < 1e-4


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_bf16_prefill_leaves_a_float32_recording_within_bf16_rounding(model_type):
    """`prefill_dtype=bfloat16` runs the prompt's matrix products in bf16 and the continuation in float32: every
    recorded K/V and gradient is float32, and they differ from a float32 prefill's by bf16 rounding (unit roundoff
    2^-9 per product, a few products deep), not more."""
    model, tok = make_model(model_type)
    ids = _ids(tok)
    sliding = [t == "sliding_attention" for t in adapter_for(model.config).layer_types]
    exact, low = (_record_window(model, ids[:, :60], ids[:, 60:], sliding, prefill_dtype=dtype)
                  for dtype in (None, torch.bfloat16))
    assert 0 < (exact["ref"].logp - low["ref"].logp).abs().max() < 0.05
    for i, tensors in low["kv"].items():
        for got, want in zip(tensors, exact["kv"][i]):
            assert got.dtype == torch.float32
            assert (got - want).norm() <= 0.05 * want.norm()


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text"])
def test_continuation_score_is_the_attention_of_one_dense_forward(model_type):
    """The attention each paged layer's keys get from the continuation's queries, summed by the recording's own
    forward chunk by chunk, is `continuation_score` of one dense forward's queries and keys over prompt +
    continuation, to float order (the softmax's sums run over other blocks); a sliding layer's is zero."""
    from kvcal.profile.capture import capturing
    from kvcal.profile.quality_model import continuation_score

    class Keep:
        def __init__(self):
            self.qk = {}

        def add(self, layer, query, key, value):
            self.qk[layer] = (query.detach(), key.detach())

    model, tok = make_model(model_type)
    ids = _ids(tok)
    P = 60
    sliding = [t == "sliding_attention" for t in adapter_for(model.config).layer_types]
    window = _record_window(model, ids[:, :P], ids[:, P:], sliding, chunk=8)
    keep = Keep()
    with torch.no_grad(), capturing(model, keep):
        model(input_ids=ids[:, :-1])
    M = ids.shape[1] - 1 - P
    for layer, (query, key) in keep.qk.items():
        got = window["continuation_score"][layer]
        if sliding[layer]:
            assert not got.any()
            continue
        want = continuation_score(query[:, :, P:], key)
        assert want.sum() > M * 0.99          # each query's row sums to one, and the max over heads adds to it
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gradients_are_those_of_the_cached_prompt():
    """The recorded gradient of every prompt key and value is autograd's through transformers' own attention over a
    cache whose prompt K/V are leaves: dL/dK of what decode queries read, nothing else, over a continuation longer
    than one slice of the head. Cut into chunks, the recording drops the path through the continuation's hidden
    states into later queries, and its early layers' gradients differ."""
    from transformers import DynamicCache

    from kvcal.profile.recording import HEAD_SLICE

    model, tok = make_model("llama")
    ids = _ids(tok, 140)
    P, L = 60, model.config.num_hidden_layers
    assert ids.shape[1] - P - 1 > 2 * HEAD_SLICE
    window = _record_window(model, ids[:, :P], ids[:, P:], [False] * L)
    chunked = _record_window(model, ids[:, :P], ids[:, P:], [False] * L, chunk=16)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :P], cache=cache, use_cache=True)
    leaves = []
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.clone().requires_grad_(True), layer.values.clone().requires_grad_(True)
        leaves += [layer.keys, layer.values]
    for p in model.parameters():
        p.requires_grad_(False)
    logits = model(input_ids=ids[:, P:-1], cache=cache, use_cache=True).logits
    loss = torch.nn.functional.cross_entropy(logits[0], ids[0, P + 1:], reduction="sum")
    grads = torch.autograd.grad(loss, leaves)
    for i in range(L):
        key, value, g_key, g_value = window["kv"][i]
        assert g_key.abs().max() > 0
        torch.testing.assert_close(g_key[:, :, :P], grads[2 * i], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(g_value[:, :, :P], grads[2 * i + 1], rtol=1e-4, atol=1e-6)
    g_key_chunked = chunked["kv"][0][2][:, :, :P]
    assert (g_key_chunked - grads[0]).abs().max() > 1e-3 * grads[0].abs().max()


def test_a_sliding_layers_gradients_count_only_the_queries_that_read_it_coded():
    """Given the first key each query reads exact, a sliding layer's recorded K/V gradients are those through the
    reads of older keys (the reads the runtime serves coded): with every key read coded they are the gradients of
    the whole attention; with none, zero; with the 4 newest read exact, every token's gradient loses its newest
    readers' share, so the newest tokens lose it all. Paged layers keep their full gradients."""
    model, tok = make_model("gemma3_text")
    ids = _ids(tok, 110)
    P, L = 60, model.config.num_hidden_layers
    sliding = [t == "sliding_attention" for t in model.config.layer_types]
    layers = [i for i in range(L) if sliding[i]]
    assert layers and not all(sliding)
    positions = torch.arange(ids.shape[1])

    def record(exact_from):
        return _record_window(model, ids[:, :P], ids[:, P:], sliding, exact_from=dict.fromkeys(layers, exact_from))

    full = _record_window(model, ids[:, :P], ids[:, P:], sliding)
    every, half, none = record(positions + 1), record(positions - 3), record(torch.zeros_like(positions))
    for i in range(L):
        for side in (2, 3):                            # g_key, g_value
            g_full, g_every, g_half, g_none = (w["kv"][i][side] for w in (full, every, half, none))
            if not sliding[i]:
                assert torch.equal(g_half, g_full)
                continue
            torch.testing.assert_close(g_every, g_full, rtol=1e-4, atol=1e-6)
            assert not g_none.any()
            S = g_half.shape[2]
            assert not g_half[:, :, S - 4:].any() and g_half[:, :, :S - 4].abs().amax() > 0


def test_fitted_levels_predict_less_loss_than_uniform_codes():
    """The levels fitted on a window's held tokens, weighted by g² step², minimise the quality model's own sum there:
    with them, every 2- and 4-bit side of every layer is predicted to cost no more than with uniform codes (all
    samples fit here, so no subsampling), and at 2 bits less in total."""
    from conftest import random_bundle

    from kvcal.profile.allocate import base_settings
    from kvcal.profile.quality_model import (
        ALPHAS,
        BASE_ALPHA,
        BITS,
        HIGH,
        add_layer_costs,
        fit_layer_levels,
        held_masks,
    )
    from kvcal.profile.ranks import ranks_of
    from kvcal.runtime.storage.bases import served_bases

    model, tok = make_model("llama")
    a = adapter_for(model.config)
    bundle = random_bundle(model, tok)
    ids = _ids(tok)
    P, L, H = 60, model.config.num_hidden_layers, a.num_kv_heads
    base = base_settings(a.layer_types).with_tiering(window=8)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base, None)
    window = _record_window(model, ids[:, :P], ids[:, P:], [False] * L, chunk=64)
    for layer in range(L):
        key, value, g_key, g_value = window["kv"][layer]
        held = held_masks(window["prefill_score"][layer], window["continuation_score"][layer], 8, False)
        fitted = fit_layer_levels((key, value), (g_key, g_value), held[BASE_ALPHA], served, base, layer, a.head_dim)
        uniform = {k: torch.arange(t.shape[-1], dtype=torch.float32).expand_as(t) for k, t in fitted.items()}
        costs = []
        for levels in (fitted, uniform):
            c = torch.zeros(H, 2, len(BITS), len(ALPHAS), dtype=torch.float64)
            add_layer_costs(c, torch.zeros(H, 2, len(HIGH), len(ALPHAS), dtype=torch.float64), layer,
                            (key, value), (g_key, g_value), held, held, served, base, False, a.head_dim, levels)
            costs.append(c[..., BASE_ALPHA])
        assert (costs[0][..., 1:] <= costs[1][..., 1:] * (1 + 1e-9)).all(), layer      # 4 and 2 bits
        assert costs[0][..., 2].sum() < costs[1][..., 2].sum(), layer


@pytest.mark.parametrize("exact_window", [False, True])
def test_the_windows_tokens_are_charged_at_the_high_tiers_format(exact_window):
    """Unless the window is held exact, the runtime writes every new token to its high tier, so an 8-bit high tier
    codes what each query reads in its window. At the catalogue's largest threshold no token of this short sequence
    is a heavy hitter (a mean attention of ALPHAS[-1] / N is above 1), yet the 8-bit high tier must be charged for
    the windows of the scored queries, and for nothing with the window exact; the 16-bit one costs nothing."""
    from conftest import random_bundle

    from kvcal.profile.allocate import base_settings
    from kvcal.profile.quality_model import ALPHAS, HIGH
    from kvcal.profile.ranks import ranks_of
    from kvcal.profile.recording import record_search
    from kvcal.runtime.storage.bases import served_bases

    model, tok = make_model("llama")
    a = adapter_for(model.config)
    bundle = random_bundle(model, tok)
    ids = _ids(tok)
    assert ALPHAS[-1] > ids.shape[1] and HIGH == ("K16V16", "K8V8")
    base = base_settings(a.layer_types).with_tiering(window=8).with_(exact_window=exact_window)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base, None)
    costs = record_search(model, ids[:, :60], ids[:, 60:], served, base, list(a.layer_types), a.head_dim).costs
    assert (costs.high_tokens[:, -1] == 0).all()
    charged = costs.high_costs[..., 1, -1]
    assert ((charged == 0) if exact_window else (charged > 0)).all() and (costs.high_costs[..., 0, :] == 0).all()
