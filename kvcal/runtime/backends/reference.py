"""The reference attention backend: dequantize the store, then dense float32 attention (`TorchBackend`). Every other
backend is checked against it; the contract is in `kvcal.runtime.backends.base`."""

from __future__ import annotations

import torch

from kvcal.runtime.backends.base import AttentionBackend, _softmax_attend, exact_visible, prompt_probs, prompt_rows


class TorchBackend(AttentionBackend):
    """Reference backend: dequantize the store, then dense float32 attention. Runs wherever torch runs."""

    @classmethod
    def name(cls) -> str:
        return "torch"

    @classmethod
    def supports(cls, device: torch.device) -> list[str]:
        return []

    @staticmethod
    def prefill(query, keys, values, mask, scale):
        B, H, g, n, d = query.shape
        out = torch.empty(B, H, g, n, values.shape[-1], device=query.device)
        score = torch.zeros(B, H, n, device=query.device)
        for rows in prompt_rows(query):
            probs = prompt_probs(query, keys, mask, scale, rows)                    # [B, H, g, c, w]
            w = probs.shape[-1]
            out[:, :, :, rows] = torch.einsum("bhgns,bhsr->bhgnr", probs, values[:, :, :w].float())
            score[:, :, :w] += probs.amax(dim=2).sum(dim=2)
        return out, score

    @staticmethod
    def attend(store, layer, query, exact_keys, exact_values, scale, track_scores=True, exact_from=None):
        if track_scores:
            store.own_layer(layer)          # before the gather: the scores are written back to the pages it read
        stored = store.gather(layer)
        B, H, g, n, _ = query.shape
        S, m = stored.pos.shape[-1], exact_keys.shape[2]
        keys = torch.cat([stored.keys, exact_keys.float()], dim=2)                  # [B, H, S + m, r]
        values = torch.cat([stored.values, exact_values.float()], dim=2)
        allowed = torch.cat([(stored.pos >= 0)[:, :, None, None, :].expand(B, H, 1, n, S),
                             exact_visible(B, n, m, exact_from, query.device)[:, None, None].expand(B, H, 1, n, m)],
                            dim=-1)
        out, probs = _softmax_attend(query, keys, values, allowed, scale)
        if not track_scores:
            return out, torch.zeros(B, H, m, device=query.device)
        store.add_scores(layer, stored, probs[..., :S].sum(dim=2))
        return out, probs[..., S:].sum(dim=2)
