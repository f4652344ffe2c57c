"""Palu-style pre-RoPE low-rank KV cache for `kvcal bench`. Based on Chang et al., Palu, ICLR 2025 (arXiv 2407.21118).

Palu replaces each head's K (and V) projection W [d, hidden] by a low-rank pair: the cache keeps the latent x·A
(rank r), and attention reconstructs K = latent·B, applies RoPE to every cached token at its position, and attends.
Its decomposition is a *whitened* SVD (SVD-LLM): with X^T X = S S^T the Gram of the projection's inputs on
calibration text, take the SVD S^T W^T = U Σ V^T and set A = S^{-T} U_r Σ_r, B = V_r^T, which minimises
||X W^T - X A B|| over the calibration activations.

Since x W^T V_r = x S^{-T} U_r Σ_r = x A, the latent is exactly the pre-RoPE key (minus its bias) projected on V_r,
the top-r right singular vectors of S^T W^T. So the cache does not need the hidden states: `PaluLayer.update` undoes
RoPE on the post-RoPE keys transformers hands it (exact: RoPE is a rotation per position), stores
latent = (K_pre - b) V_r in fp16 (the model's dtype if 16-bit), and returns K = RoPE((latent V_r^T) + b) for every
cached token, and V = latent_v V_v,r^T + b_v. This is bit-for-bit Palu's arithmetic up to float rounding; Palu fuses
V's B into W_O instead, which gives the same output.

Faithfulness caveats: one decomposition per KV head (Palu's M-LRD; its default G-LRD shares a latent over groups of 4
heads), ranks uniform over layers and heads and equal for K and V (Palu allocates them by Fisher information), no
latent quantization. Reconstruction and RoPE run for every cached token at every step (Palu's Triton kernel fuses
them; here they are plain torch, so Palu's decode time is an upper bound). Prefill also attends over reconstructed
K/V, as in Palu, whose projections are replaced. Llama and Qwen2 only: Gemma3's QK-norm sits between W_K and RoPE,
so its pre-RoPE keys are not linear in the latent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.bench.caches import CountingCache, CountingLayer, memory_dict, store_dtype, tensor_bytes
from kvcal.bench.rope import RopeTable, apply_rope, undo_rope

PALU_FAMILIES = ("llama", "qwen2")


@dataclass
class PaluFactors:
    """Per (layer, KV head) bases: the columns of k_basis[l, h] (resp. v_basis) are the right singular vectors of
    S^T W_K[h]^T, by descending singular value; the latent of rank r is (K_pre - bias) @ basis[:, :r]."""

    k_basis: torch.Tensor            # [L, H, d, d] float32
    v_basis: torch.Tensor            # [L, H, d, d] float32
    k_bias: torch.Tensor             # [L, H, d] float32 (zeros where the projection has no bias)
    v_bias: torch.Tensor             # [L, H, d] float32
    calibration_tokens: int          # tokens whose inputs made the whitening Gram


def unsupported_reason(adapter) -> str | None:
    """Why the Palu baseline cannot run on this model family, or None."""
    if adapter.family not in PALU_FAMILIES:
        return (f"Palu-style low rank needs K linear in the latent before RoPE; `{adapter.family}` applies a QK-norm "
                f"there (supported: {', '.join(PALU_FAMILIES)})")
    return None


@torch.inference_mode()
def palu_factors(model, adapter, windows: torch.Tensor, eps: float = 1e-6) -> PaluFactors:
    """Whitened SVD of each head's W_K and W_V from the projection inputs of `windows` [n, S] (calibration text)."""
    L, H, d = adapter.num_layers, adapter.num_kv_heads, adapter.head_dim
    grams: dict[int, torch.Tensor] = {}

    def hook(layer):
        def pre(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()                       # [tokens, hidden]
            grams[layer] = grams.get(layer, 0) + x.T @ x
        return pre

    handles = [adapter.attention(model, i).k_proj.register_forward_pre_hook(hook(i)) for i in range(L)]
    try:
        for w in windows:
            model(input_ids=w[None].to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    bases = {"k": torch.zeros(L, H, d, d), "v": torch.zeros(L, H, d, d)}
    biases = {"k": torch.zeros(L, H, d), "v": torch.zeros(L, H, d)}
    for layer in range(L):
        g = grams[layer]
        g = g + eps * g.diagonal().mean() * torch.eye(g.shape[0], dtype=g.dtype)
        s = torch.linalg.cholesky(g)                                                     # g = s s^T
        attn = adapter.attention(model, layer)
        for kind, proj in (("k", attn.k_proj), ("v", attn.v_proj)):
            w = proj.weight.double()                                                     # [H * d, hidden]
            for h in range(H):
                m = s.T @ w[h * d:(h + 1) * d].T                                         # [hidden, d]
                _, _, vh = torch.linalg.svd(m, full_matrices=False)
                bases[kind][layer, h] = vh.T.float()                                    # columns = V
            if proj.bias is not None:
                biases[kind][layer] = proj.bias.float().view(H, d)
    return PaluFactors(bases["k"], bases["v"], biases["k"], biases["v"], int(windows.numel()))


class PaluLayer(CountingLayer):
    """Latents lat_k, lat_v [B, H, seen, r] in the store dtype."""

    method = "Palu"

    def __init__(self, owner: PaluCache, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.lat_k = self.lat_v = None

    def lazy_initialization(self, key_states, value_states) -> None:
        B, H, _, _ = key_states.shape
        r, sd = self.owner.rank, store_dtype(key_states.dtype)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.lat_k = key_states.new_zeros(B, H, 0, r, dtype=sd)
        self.lat_v = value_states.new_zeros(B, H, 0, r, dtype=sd)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        o, i = self.owner, self.layer_idx
        cos, sin = o.rope(self.seen + n, key_states.device)                             # [N, d] float32
        c, s = cos[self.seen:], sin[self.seen:]
        k_pre = undo_rope(key_states.float(), c, s)
        lat_k = torch.einsum("bhnd,hdr->bhnr", k_pre - o.k_bias[i][None, :, None], o.k_proj[i])
        lat_v = torch.einsum("bhnd,hdr->bhnr", value_states.float() - o.v_bias[i][None, :, None], o.v_proj[i])
        self.lat_k = torch.cat([self.lat_k, lat_k.to(self.lat_k.dtype)], dim=2)
        self.lat_v = torch.cat([self.lat_v, lat_v.to(self.lat_v.dtype)], dim=2)
        self.seen += n
        keys = torch.einsum("bhnr,hdr->bhnd", self.lat_k.float(), o.k_proj[i]) + o.k_bias[i][None, :, None]
        keys = apply_rope(keys, cos, sin)                                                # RoPE at every position
        values = torch.einsum("bhnr,hdr->bhnd", self.lat_v.float(), o.v_proj[i]) + o.v_bias[i][None, :, None]
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def reset(self) -> None:
        super().reset()
        self.lat_k = self.lat_v = None


class PaluCache(CountingCache):
    """Pre-RoPE low-rank latents for every full-attention layer, at uniform rank `rank` (see the module docstring)."""

    method = "Palu"

    def __init__(self, model, factors: PaluFactors, rank: int, layer_types: list[str]):
        d = factors.k_basis.shape[-1]
        if not 1 <= rank <= d:
            raise ValueError(f"Palu `rank={rank}` must be in [1, {d}]")
        if any(t == "sliding_attention" for t in layer_types):
            raise ValueError("the Palu baseline does not support sliding-window layers")
        self.rank, self.head_dim = rank, d
        self.rope = RopeTable(model.model.rotary_emb)
        self.k_proj = factors.k_basis[..., :rank]                                       # [L, H, d, r]
        self.v_proj = factors.v_basis[..., :rank]
        self.k_bias, self.v_bias = factors.k_bias, factors.v_bias
        super().__init__(layers=[PaluLayer(self, i) for i in range(len(layer_types))])

    def memory(self) -> dict[str, float]:
        total = fp16 = 0
        for layer in self.layers:
            if layer.is_initialized:
                B, H, n, _ = layer.lat_k.shape
                total += tensor_bytes(layer.lat_k) + tensor_bytes(layer.lat_v)
                fp16 += B * H * n * self.head_dim * 2 * 2
        return memory_dict(total, fp16)
