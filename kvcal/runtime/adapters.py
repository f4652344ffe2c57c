"""One adapter per architecture family: where attention lives, how query heads group onto KV heads, and the per-KV-head
slices of W_V and W_O; and the identity hashes a bundle records (architecture fingerprint, weights, tokenizer).

It lives in the runtime because serving checks a bundle against the model it is given (`KvcalCache.from_bundle`) and
the offload cache reads the same facts; `kvcal.models` re-exports it for the offline half. Torch only.

Post-RoPE Q and K are not read from here: every supported family calls transformers' attention interface with
post-RoPE (and, for Gemma3, post-QK-norm) query and key states, so kvcal captures them by registering an attention
function (`kvcal.profile.capture`) and serves them the same way (`kvcal.runtime.hf`). The adapter holds what differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

# model_type -> family. Only families that kvcal's tests and benchmarks exercise are listed.
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelAdapter:
    """Architecture facts kvcal needs, read once from a transformers config.

    Shapes use L = num_layers, H = num_kv_heads, g = group_size (query heads per KV head), d = head_dim.
    """

    family: str                      # "llama" (Llama, SmolLM), "qwen2", "gemma3"
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    layer_types: tuple[str, ...]     # per layer: "full_attention" or "sliding_attention"
    sliding_window: int | None       # tokens a sliding layer sees (Gemma3), None when no layer slides
    scaling: float                   # softmax scale the model uses (1/sqrt(d), or Gemma3's query_pre_attn_scalar)
    norm_gain_offset: float          # input RMSNorm multiplies by (offset + weight): 0 for Llama/Qwen2, 1 for Gemma3
    max_positions: int               # max_position_embeddings

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def query_heads(self, kv_head: int) -> range:
        """Query heads served by `kv_head` (transformers' repeat_kv order: contiguous blocks of g)."""
        g = self.group_size
        return range(kv_head * g, (kv_head + 1) * g)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        return _decoder(model).layers[layer].self_attn

    def v_weight(self, model: nn.Module, layer: int, kv_head: int) -> torch.Tensor:
        """Effective map from the residual stream to this head's V: diag(norm gain) @ W_V[h]^T, float32 [hidden, d].

        The input RMSNorm's gain is folded in because it scales input directions before W_V sees them; the SVD of
        W_V alone would rank directions by the wrong norm.
        """
        block = _decoder(model).layers[layer]
        d = self.head_dim
        w_v = block.self_attn.v_proj.weight[kv_head * d:(kv_head + 1) * d].float()       # [d, hidden]
        gain = block.input_layernorm.weight.float() + self.norm_gain_offset              # [hidden]
        return gain[:, None] * w_v.T                                                     # [hidden, d]

    def o_weight(self, model: nn.Module, layer: int, kv_head: int) -> torch.Tensor:
        """Columns of W_O that read this KV head's query heads, float32 [g * d, hidden]."""
        d, heads = self.head_dim, self.query_heads(kv_head)
        w_o = _decoder(model).layers[layer].self_attn.o_proj.weight.float()              # [hidden, Hq * d]
        return w_o[:, heads.start * d:heads.stop * d].T


def _decoder(model: nn.Module) -> nn.Module:
    return model.model if hasattr(model, "model") else model


def _text_config(config):
    return getattr(config, "text_config", None) or config


def adapter_for(config) -> ModelAdapter:
    """Build the adapter for a transformers config, or raise `UnsupportedModelError` naming the supported types."""
    config = _text_config(config)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture `{model_type}`: kvcal supports {', '.join(sorted(FAMILIES))} "
            "(Llama/SmolLM, Qwen2, Gemma3 text)"
        )
    family = FAMILIES[model_type]
    n_layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_types = tuple(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
    sliding = any(t == "sliding_attention" for t in layer_types)
    if family == "gemma3":
        scaling = config.query_pre_attn_scalar ** -0.5
        if getattr(config, "attn_logit_softcapping", None):
            raise UnsupportedModelError("Gemma3 with `attn_logit_softcapping` is not supported (softcapped logits "
                                        "are not a dot product); use a checkpoint without it")
    else:
        scaling = head_dim ** -0.5
    return ModelAdapter(
        family=family,
        model_type=model_type,
        num_layers=n_layers,
        num_q_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        layer_types=layer_types,
        sliding_window=getattr(config, "sliding_window", None) if sliding else None,
        scaling=scaling,
        norm_gain_offset=1.0 if family == "gemma3" else 0.0,
        max_positions=getattr(config, "max_position_embeddings", 4096),
    )


# ---------------------------------------------------------------------------------------------- identity

# Config fields that change what a bundle describes. Weights are checked separately (weights_hash), because a fine-tune
# keeps the architecture but moves the statistics.
_ARCH_FIELDS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
    "layer_types", "sliding_window", "query_pre_attn_scalar", "attention_bias", "tie_word_embeddings",
)


def fingerprint(config) -> str:
    """sha256 (16 hex) of the architecture fields of a config: equal for the same architecture and size."""
    config = _text_config(config)
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    fields = {k: d.get(k) for k in _ARCH_FIELDS if d.get(k) is not None}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


@torch.no_grad()
def weights_hash(model: nn.Module, adapter: ModelAdapter) -> str:
    """sha256 (16 hex) of the K and V projections of the first and last layer, rounded to bf16.

    bf16 rounding makes the hash the same whether the same weights were loaded in fp32 or bf16.
    """
    h = hashlib.sha256()
    for layer in sorted({0, adapter.num_layers - 1}):
        attn = adapter.attention(model, layer)
        for proj in (attn.k_proj, attn.v_proj):
            w = proj.weight
            if w.device.type == "meta":       # offloaded by accelerate (device_map): read it from the checkpoint
                w = _checkpoint_tensor(model, proj)
            w = w.detach().to("cpu", torch.bfloat16).contiguous()
            h.update(w.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def _checkpoint_tensor(model: nn.Module, module: nn.Module) -> torch.Tensor:
    """The weight of `module` as stored in the model's safetensors checkpoint (for offloaded modules)."""
    from pathlib import Path

    from safetensors import safe_open

    name = next(n for n, m in model.named_modules() if m is module) + ".weight"
    folder = Path(model.config._name_or_path)
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118
                return f.get_tensor(name)
    raise ValueError(f"offloaded weight `{name}` not found in the checkpoint at `{folder}`")


def tokenizer_hash(tokenizer) -> str:
    """sha256 (16 hex) of the vocabulary and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    payload = json.dumps([vocab, sorted(tokenizer.all_special_tokens)], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
