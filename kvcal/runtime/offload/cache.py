"""KVPR offloading: the KV cache lives on the host; each decode step recomputes a prefix of it on the device.

    from kvcal.runtime.offload import OffloadedCache
    with OffloadedCache(model, hardware=hw) as cache:            # hooks the attention modules; unhooked on exit
        out = model.generate(**inputs, cache=cache, max_new_tokens=32, do_sample=False)
    cache.history[layer]                                          # the l chosen at each decode step

Based on Jiang et al., "KVPR: Efficient LLM Inference with I/O-Aware KV Cache Partial Recomputation"; the cost
model and the split solver are ``kvcal.runtime.offload.kvpr``.

What the host holds (``HostTier``, one per offloaded layer, pinned on CUDA): the post-RoPE K/V of every
token, and **X = the input of the layer's ``k_proj``/``v_proj``**, i.e. the attention module's ``hidden_states``
argument, which is the residual stream *after* the layer's input norm (``input_layernorm``). That is the one tensor
from which K and V follow token by token with no other state: K = RoPE(k_norm?(k_proj(X)), position), V = v_proj(X).
Recompute then runs exactly the ops the attention module ran (the module's own ``k_proj``/``v_proj``/``k_norm`` and
its family's ``apply_rotary_pos_emb``); the pre-norm residual would be exact too but adds a norm to every recompute.
The RoPE (cos, sin) rows the model used are kept on the device, one table per layer type shared by all layers
(2·head_dim values per token, not per layer), so recompute at the original positions is right for padded
batches, scaled RoPE and Gemma3's local/global RoPE alike without re-deriving positions.

One decode step of layer i (row-by-row, latency-oriented: one batch goes through all layers; weights stay on the
device). With s tokens held and split l = ``split(i, s)``:

    x stream :  X[0:l]  host -> device, then K,V[0:l] = recompute(X)      (the recompute branch)
    kv stream:  K,V[l:s] host -> device                                    (the transfer branch, overlapping it)
    compute  :  waits on both events, K = cat(K[0:l], K[l:s], K_new) -> attention; stores X_new, K_new, V_new
                device -> host on the store stream

The fetch of layer i+1 is issued from layer i's ``update`` (before layer i attends), so at most two layers' past KV
are on the device at once: the one being attended and the one arriving (double buffering across layers). The first
offloaded layer of a step is fetched from its attention pre-hook, which still overlaps its Q/K/V projections. On a
machine without CUDA the same code runs with no streams (every ``_on(stream)`` is a no-op and events are None): the
"transfers" are real memcpy copies and the result is identical to the CUDA path's math.

Exactness: the transferred rows and the new tokens are the model's own K/V, bit for bit. The recomputed rows are
the same arithmetic on the same X, but a GEMM over l rows may sum in a different order than the GEMM that produced
the token (MKL uses other kernels below 16 rows; one decode token is a 1-row GEMM), so in fp32 they can differ by a
few ulp (docs/offload.md). Greedy generation is unchanged (tests/test_offload.py).

Scope of v1: the host tier holds the cache in the model dtype (uncompressed), for full-attention layers; sliding
layers (Gemma3) stay on the device as transformers' ``DynamicSlidingWindowLayer`` (they hold at most a window). The
cost model covers kvcal's compressed KV through ``LayerWorkload.kv_bytes_per_token``; serving compressed pages from
the host is not implemented here.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from kvcal.runtime.adapters import adapter_for
from kvcal.runtime.hf import cache_argument
from kvcal.runtime.offload import kvpr

logger = logging.getLogger(__name__)

SplitRule = str | int | Callable[[int, int], int]   # "auto" | "none" | "full" | fixed l | (layer, s) -> l


# ---- streams: the same code with and without CUDA ---------------------------------------------------------------


def _on(stream):
    """Run the block on `stream` (CUDA), or inline when there is no stream (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream):
    """An event marking everything issued so far on `stream`, or None without CUDA (all work is already done)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _wait(stream, event) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


def _copy(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The link: always a real copy (on CPU a memcpy standing in for PCIe), async from pinned memory on CUDA."""
    return src.to(device, non_blocking=True, copy=True)


@dataclass
class _Streams:
    x: torch.cuda.Stream | None = None       # X[0:l] transfer, then the recompute GEMMs
    kv: torch.cuda.Stream | None = None      # KV[l:s] transfer
    store: torch.cuda.Stream | None = None   # device -> host stores of each step's new X and K/V
    device: torch.device | None = None

    @classmethod
    def for_device(cls, device: torch.device) -> _Streams:
        if device.type != "cuda":
            return cls()
        return cls(*(torch.cuda.Stream(device) for _ in range(3)), device=device)

    def current(self):
        """The compute stream (the model's), or None on CPU."""
        return torch.cuda.current_stream(self.device) if self.x is not None else None


# ---- host tier ----------------------------------------------------------------------------------------------------


class HostTier:
    """One layer's offloaded state, sequence-major so that [0:l] and [l:s] are contiguous (one DMA each).

    x:      [cap, B, hidden]     input of k_proj/v_proj (post input-norm), model dtype
    keys:   [cap, B, H_kv, d]    post-RoPE K as the model produced it
    values: [cap, B, H_kv, d]
    ``length`` tokens are valid; capacity doubles when full. ``stored`` is the event of the last store (CUDA).
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.x = self.keys = self.values = None
        self.length = 0
        self.stored = None

    def _grow(self, need: int, x: torch.Tensor, k: torch.Tensor) -> None:
        cap = 0 if self.x is None else self.x.shape[0]
        if need <= cap:
            return
        if self.stored is not None:
            self.stored.synchronize()         # an async store may still be writing the old buffers
        cap = max(need, 2 * cap, 16)
        B, _, hidden = x.shape
        _, H, _, d = k.shape
        new = lambda *shape: torch.empty(*shape, dtype=k.dtype, pin_memory=self.pin)   # noqa: E731
        x_new, k_new, v_new = new(cap, B, hidden), new(cap, B, H, d), new(cap, B, H, d)
        if self.length:
            x_new[:self.length].copy_(self.x[:self.length])
            k_new[:self.length].copy_(self.keys[:self.length])
            v_new[:self.length].copy_(self.values[:self.length])
        self.x, self.keys, self.values = x_new, k_new, v_new

    def append(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, streams: _Streams) -> None:
        """Store n new tokens: x [B, n, hidden], k/v [B, H, n, d] (on the device)."""
        n = x.shape[1]
        self._grow(self.length + n, x, k)
        s = self.length
        store, cur = streams.store, streams.current()
        if store is not None:
            store.wait_stream(cur)            # the new tensors are produced on the compute stream
        with _on(store):
            self.x[s:s + n].copy_(x.transpose(0, 1), non_blocking=True)          # [B, n, h] -> [n, B, h]
            self.keys[s:s + n].copy_(k.permute(2, 0, 1, 3), non_blocking=True)   # [B, H, n, d] -> [n, B, H, d]
            self.values[s:s + n].copy_(v.permute(2, 0, 1, 3), non_blocking=True)
        if store is not None:
            for t in (x, k, v):
                t.record_stream(store)        # keep the device sources alive until the copy ran
        self.stored = _record(store)
        self.length = s + n

    def nbytes(self) -> int:
        """Host bytes in use (valid tokens only)."""
        if self.x is None:
            return 0
        per = self.x[0].numel() * self.x.element_size() + 2 * self.keys[0].numel() * self.keys.element_size()
        return per * self.length


@dataclass
class _Fetch:
    """A layer's past K/V on their way to the device: recomputed [0:l] and transferred [l:s] (tensors [B, H, *, d])."""

    s: int
    l: int
    k_rec: torch.Tensor
    v_rec: torch.Tensor
    k_xfer: torch.Tensor
    v_xfer: torch.Tensor
    ready: tuple            # events of the two branches (None on CPU)

    def merge(self, stream) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, H, s, d] once both branches are done (the compute stream waits on their events)."""
        for ev in self.ready:
            _wait(stream, ev)
        if stream is not None:
            for t in (self.k_rec, self.v_rec, self.k_xfer, self.v_xfer):
                t.record_stream(stream)       # allocated on a side stream, read on the compute stream
        if self.l == 0:
            return self.k_xfer, self.v_xfer
        if self.l == self.s:
            return self.k_rec, self.v_rec
        return torch.cat([self.k_rec, self.k_xfer], dim=-2), torch.cat([self.v_rec, self.v_xfer], dim=-2)


# ---- cache --------------------------------------------------------------------------------------------------------


class OffloadedLayer(CacheLayerMixin):
    """One full-attention layer whose K/V (and X) live in a ``HostTier``; ``update`` returns the full K/V."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: OffloadedCache, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.host = HostTier(owner.pin)
        self.fetched: _Fetch | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """key/value_states [B, H, n, d] of the n new tokens -> full K/V [B, H, s + n, d] for attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        x = owner._x.pop(self.layer_idx, None)
        if x is None:
            raise RuntimeError(f"offloaded layer {self.layer_idx} got K/V without its X: the attention pre-hook did "
                               "not run (was the cache closed, or the model called without `cache=cache`?)")
        keys, values = key_states, value_states
        if self.host.length:
            fetch = self.fetched if self.fetched is not None and self.fetched.s == self.host.length else None
            fetch = fetch or owner._fetch(self.layer_idx)
            self.fetched = None
            k_past, v_past = fetch.merge(owner.streams.current())
            keys = torch.cat([k_past, key_states], dim=-2)
            values = torch.cat([v_past, value_states], dim=-2)
        self.host.append(x, key_states, value_states, owner.streams)
        owner._prefetch_after(self.layer_idx)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.host.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.host.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.host, self.fetched = HostTier(self.owner.pin), None

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("OffloadedCache does not support beam search; use greedy decoding or sampling")


class OffloadedCache(Cache):
    """A transformers ``Cache`` that keeps full-attention K/V (and their layer inputs X) on the host: KVPR.

    Parameters
    ----------
    model:
        A Llama / Qwen2 / Gemma3 causal LM (``kvcal.runtime.adapters``). Attention pre-hooks are registered now and
        removed by ``close()`` (or leaving the ``with`` block).
    split:
        ``"auto"`` (``kvpr.solve_split`` per layer and step from ``hardware``), ``"none"`` (l = 0: plain offloading),
        ``"full"`` (l = s: recompute everything), an int (fixed l, clamped to s) or ``f(layer, s) -> l``.
    hardware:
        ``kvpr.Hardware`` for ``"auto"``; None profiles this machine once (``kvcal.runtime.offload.profiler``, cached).
    mode:
        cost-model schedule. Default ``"pipelined"``: this runtime sends X and KV over one link and prefetches a layer
        ahead, so its steady state is max(link bytes, recompute); the paper's ``"row"`` ignores X's bytes (§7-G).
    """

    def __init__(self, model: nn.Module, *, split: SplitRule = "auto", hardware: kvpr.Hardware | None = None,
                 mode: kvpr.Schedule | str = kvpr.Schedule.PIPELINED):
        if isinstance(split, str) and split not in ("auto", "none", "full"):
            raise ValueError(f"`split={split!r}` must be 'auto', 'none', 'full', an int or a callable (layer, s) -> l")
        self.model, self.adapter = model, adapter_for(model.config)
        self.split, self.mode, self.hardware = split, kvpr.Schedule(mode), hardware
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.pin = self.device.type == "cuda"                 # pinned host buffers: async H2D/D2H copies
        self.streams = _Streams.for_device(self.device)
        a = self.adapter
        self.offloaded = [i for i in range(a.num_layers) if not a.is_sliding(i)]
        self._next = {i: j for i, j in zip(self.offloaded, self.offloaded[1:])}
        layers = [DynamicSlidingWindowLayer(a.sliding_window) if a.is_sliding(i) else OffloadedLayer(self, i)
                  for i in range(a.num_layers)]
        super().__init__(layers=layers)
        self.history: dict[int, list[int]] = {i: [] for i in self.offloaded}   # l per decode step, per layer
        self._x: dict[int, torch.Tensor] = {}                                  # this step's X per layer
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}          # layer type -> cos, sin [B, S, d]
        self._attn = {i: a.attention(model, i) for i in self.offloaded}
        self._apply_rope = {i: sys.modules[type(m).__module__].apply_rotary_pos_emb for i, m in self._attn.items()}
        self._hooks = [self._attn[i].register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)
                       for i in self.offloaded]

    # -------------------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Remove the attention pre-hooks (the cache keeps its data)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> OffloadedCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def host_bytes(self) -> int:
        return sum(self.layers[i].host.nbytes() for i in self.offloaded)

    # -------------------------------------------------------------------------------------------- hooks

    def _pre_hook(self, layer_idx: int):
        def hook(module, args, kwargs):
            if cache_argument(kwargs) is not self:
                return None                   # the model runs with another cache: not ours to capture
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]      # [B, n, hidden]
            rope = kwargs.get("position_embeddings")
            if rope is None:
                raise RuntimeError("OffloadedCache needs the attention module's `position_embeddings` (cos, sin) "
                                   f"keyword; {type(module).__name__} did not receive it")
            self._x[layer_idx] = x
            layer = self.layers[layer_idx]
            self._extend_rope(self.adapter.layer_types[layer_idx], rope, layer.host.length, x.shape[0])
            if layer.fetched is None and layer.host.length:
                layer.fetched = self._fetch(layer_idx)   # first layer of the step: nobody prefetched it
            return None

        return hook

    def _extend_rope(self, layer_type: str, rope, start: int, batch: int) -> None:
        """Append the cos/sin rows of positions [start, start + n) to the layer type's table (once per step)."""
        cos, sin = rope                                                   # [B or 1, n, d]
        n = cos.shape[1]
        table = self._rope.get(layer_type)
        have = 0 if table is None else table[0].shape[1]
        if have >= start + n:
            return
        assert have == start, f"RoPE table of {layer_type} has {have} rows, expected {start}"
        cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
        if table is not None:
            cos, sin = torch.cat([table[0], cos], dim=1), torch.cat([table[1], sin], dim=1)
        self._rope[layer_type] = (cos.contiguous(), sin.contiguous())

    # -------------------------------------------------------------------------------------------- KVPR

    def choose_split(self, layer_idx: int, s: int, batch: int) -> int:
        """l for this layer at s held tokens (0 <= l <= s)."""
        if s == 0 or self.split == "none":
            return 0
        if self.split == "full":
            return s
        if self.split == "auto":
            a = self.adapter
            elem = torch.tensor([], dtype=self.dtype).element_size()
            w = kvpr.LayerWorkload(batch=batch, tokens=s, hidden=a.hidden_size, kv_heads=a.num_kv_heads,
                                   head_dim=a.head_dim, x_bytes_per_elem=elem)     # X and KV in the model dtype
            return kvpr.solve_split(w, self._hardware(), self.mode).l
        l = self.split(layer_idx, s) if callable(self.split) else int(self.split)
        return max(0, min(l, s))

    def _hardware(self) -> kvpr.Hardware:
        if self.hardware is None:
            from kvcal.runtime.offload.profiler import profile_for_model

            self.hardware = profile_for_model(self.model, device=self.device).hardware
        return self.hardware

    def recompute(self, layer_idx: int, x: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, H, l, d] of tokens [start, start + l) from their X [B, l, hidden], by the attention module's ops."""
        attn, d = self._attn[layer_idx], self.adapter.head_dim
        B, l, _ = x.shape
        k = attn.k_proj(x).view(B, l, -1, d).transpose(1, 2)       # [B, l, H*d] -> [B, H, l, d]
        v = attn.v_proj(x).view(B, l, -1, d).transpose(1, 2)
        k_norm = getattr(attn, "k_norm", None)
        if k_norm is not None:
            k = k_norm(k)                                           # Gemma3: QK-norm before RoPE, as its forward
        cos, sin = self._rope[self.adapter.layer_types[layer_idx]]
        _, k = self._apply_rope[layer_idx](k, k, cos[:, start:start + l], sin[:, start:start + l])
        return k, v

    def past(self, layer_idx: int, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, H, s, d] of the s held tokens, assembled with split l (recompute [0:l], transfer [l:s])."""
        s = self.layers[layer_idx].host.length
        if not 0 <= l <= s:
            raise ValueError(f"`l={l}` must be in [0, {s}] (tokens held by layer {layer_idx})")
        return self._fetch(layer_idx, l).merge(self.streams.current())

    def _fetch(self, layer_idx: int, l: int | None = None) -> _Fetch:
        """Start both branches for this layer's past tokens: recompute [0:l] from X, transfer KV [l:s]."""
        host = self.layers[layer_idx].host
        s, batch = host.length, host.x.shape[1]
        if l is None:
            l = self.choose_split(layer_idx, s, batch)
            self.history[layer_idx].append(l)
            logger.debug("layer %d: %d tokens held, recompute %d, transfer %d", layer_idx, s, l, s - l)
        st, cur = self.streams, self.streams.current()
        for side in (st.x, st.kv):
            if side is not None:
                side.wait_stream(cur)          # RoPE rows and earlier device work are issued on the compute stream
                _wait(side, host.stored)       # the host rows must be written before they are read
        ev_x = None
        if l == 0:                                                               # plain offloading: no X, no GEMM
            k_rec = v_rec = host.keys.new_empty(0, device=self.device)
        else:
            with _on(st.x):
                x = _copy(host.x[:l], self.device).transpose(0, 1)               # [l, B, h] -> [B, l, h]
                k_rec, v_rec = self.recompute(layer_idx, x)
                ev_x = _record(st.x)
        with _on(st.kv):
            k_xfer = _copy(host.keys[l:s], self.device).permute(1, 2, 0, 3)      # [s-l, B, H, d] -> [B, H, s-l, d]
            v_xfer = _copy(host.values[l:s], self.device).permute(1, 2, 0, 3)
            ev_kv = _record(st.kv)
        return _Fetch(s, l, k_rec, v_rec, k_xfer, v_xfer, (ev_x, ev_kv))

    def _prefetch_after(self, layer_idx: int) -> None:
        """Double buffering: start the next offloaded layer's fetch while this one attends."""
        j = self._next.get(layer_idx)
        if j is None:
            return
        nxt = self.layers[j]
        if nxt.host.length and nxt.fetched is None:   # it has not run this step yet, so it holds the past tokens
            nxt.fetched = self._fetch(j)

    # -------------------------------------------------------------------------------------------- Cache API

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("OffloadedCache cannot be cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("OffloadedCache does not support expanding the batch; build one cache per batch")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("OffloadedCache does not support selecting batch rows")

    def reset(self) -> None:
        super().reset()
        self._x, self._rope = {}, {}
        self.history = {i: [] for i in self.offloaded}
