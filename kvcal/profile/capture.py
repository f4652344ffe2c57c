"""Stream post-RoPE Q, K and V per (layer, KV head) out of a running model, without storing activations.

Every supported family hands its post-RoPE (and, for Gemma3, post-QK-norm) query and key states to transformers'
attention interface. `capturing(model, *collectors)` swaps in an attention function that shows those tensors to each
collector and then runs the model's usual SDPA attention, so outputs are unchanged. Collectors reduce what they see
to fixed-size statistics (Gram matrices here), so memory is O(L·H·d²) whatever the token count.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Protocol

import torch

from kvcal.models import ModelAdapter

CAPTURE_IMPL = "kvcal_capture"


class Collector(Protocol):
    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """query [B, Hq, S, d], key and value [B, H, S, d], all post-RoPE, straight from the model."""


_ACTIVE: ContextVar[tuple[Collector, ...]] = ContextVar("kvcal_capture", default=())


def _capture_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' attention-function signature; `args` (dropout, scaling) may come positionally, as from
    kvpress's `attention_patch`, which wraps every registered attention function once imported."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for collector in _ACTIVE.get():
        collector.add(module.layer_idx, query, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


@contextlib.contextmanager
def attending_by(model, name: str, attention, mask: str, state: ContextVar, value):
    """Within the block, `model` attends by `attention` (transformers' attention-function signature), registered as
    `name` with transformers' `mask` mask function ("sdpa" or "eager"), and `state` holds `value` for it to read."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, {"sdpa": sdpa_mask, "eager": eager_mask}[mask])
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    token = state.set(value)
    try:
        yield
    finally:
        state.reset(token)
        model.set_attn_implementation(previous)


def capturing(model, *collectors: Collector):
    """Within the block, every forward pass of `model` feeds `collectors`."""
    return attending_by(model, CAPTURE_IMPL, _capture_attention, "sdpa", _ACTIVE, collectors)


class CollectorSet:
    """Several collectors fed by one pass and checkpointed as one: state keys are prefixed by each one's name."""

    def __init__(self, **named: Collector):
        self.named = named

    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        for collector in self.named.values():
            collector.add(layer, query, key, value)

    def start(self, window: int) -> None:
        """Tell the collectors that follow the pass's windows which one runs (`passes.run_pass`)."""
        for collector in self.named.values():
            if hasattr(collector, "start"):
                collector.start(window)

    def set_tokens(self, token_ids: torch.Tensor) -> None:
        """Hand the window's token ids [B, n] to the collectors that need them (FastGen's token classes)."""
        for collector in self.named.values():
            if hasattr(collector, "set_tokens"):
                collector.set_tokens(token_ids)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": t for name, c in self.named.items() for k, t in c.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """All or nothing: a state missing any collector's part raises before any collector is changed, so a caller
        that falls back to recomputing (Checkpoint.load) starts from empty collectors."""
        parts = {name: {k[len(name) + 1:]: t for k, t in state.items() if k.startswith(f"{name}.")}
                 for name in self.named}
        missing = [name for name, part in parts.items() if part.keys() != self.named[name].state_dict().keys()]
        if missing:
            raise KeyError(f"checkpoint state has no (or a different) part for collector `{missing[0]}`")
        for name, c in self.named.items():
            c.load_state_dict(parts[name])


class GramCollector:
    """Streaming float64 Gram matrices per (layer, KV head).

    kk [L, H, d, d]: sum of k k^T over key rows;  qq [L, H, d, d]: sum of q q^T over the rows of every query head of
    the group;  vv [L, H, d, d]: sum of v v^T;  rows [L]: token rows seen per layer (per KV head);
    k_absmax, v_absmax [L, H]: largest |element| of K (post-RoPE) and V, for FP8 scales (kvcal export).
    """

    def __init__(self, adapter: ModelAdapter):
        L, H, d = adapter.num_layers, adapter.num_kv_heads, adapter.head_dim
        self.kk = torch.zeros(L, H, d, d, dtype=torch.float64)
        self.qq = torch.zeros(L, H, d, d, dtype=torch.float64)
        self.vv = torch.zeros(L, H, d, d, dtype=torch.float64)
        self.rows = torch.zeros(L, dtype=torch.int64)
        self.k_absmax = torch.zeros(L, H, dtype=torch.float32)
        self.v_absmax = torch.zeros(L, H, dtype=torch.float32)
        self.group = adapter.group_size

    @torch.no_grad()
    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        B, H, S, d = key.shape
        q = query.to("cpu", torch.float64).view(B, H, self.group, S, d)
        k = key.to("cpu", torch.float64)
        v = value.to("cpu", torch.float64)
        self.kk[layer] += torch.einsum("bhsd,bhse->hde", k, k)
        self.qq[layer] += torch.einsum("bhgsd,bhgse->hde", q, q)
        self.vv[layer] += torch.einsum("bhsd,bhse->hde", v, v)
        self.rows[layer] += B * S
        k_max, v_max = (t.detach().abs().amax(dim=(0, 2, 3)).float().cpu() for t in (key, value))
        self.k_absmax[layer] = torch.maximum(self.k_absmax[layer], k_max)
        self.v_absmax[layer] = torch.maximum(self.v_absmax[layer], v_max)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"kk": self.kk, "qq": self.qq, "vv": self.vv, "rows": self.rows, "k_absmax": self.k_absmax,
                "v_absmax": self.v_absmax}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name in ("kk", "qq", "vv", "rows", "k_absmax", "v_absmax"):
            getattr(self, name).copy_(state[name])
