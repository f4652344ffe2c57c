"""Offline FastGen statistics on calibration text: how much prompt attention each compressed pattern
(`kvcal.runtime.policies.fastgen.PATTERNS`) retains per (layer, KV head), and how many tokens it keeps.

Based on FastGen (Ge et al., ICLR 2024), Eq. 1–2, Alg. 1. The paper profiles each prompt online; this is the
optional offline mode: the same per-prompt recovery, averaged over calibration windows, so a model's
pattern distribution (Fig. 3 analogue) and its expected pruned ratio can be read before serving.

    collector = FastGenStatsCollector(adapter, *token_classes(tokenizer))
    with capturing(model, collector):
        for window in windows:                       # [B, n] token ids, no padding
            collector.set_tokens(window)
            model(input_ids=window, use_cache=False)
    collector.recovery, collector.kept_fraction      # [L, H, 4] each
"""

from __future__ import annotations

import logging

import torch

from kvcal.models import ModelAdapter
from kvcal.runtime.backends.base import prompt_probs
from kvcal.runtime.policies.fastgen import FastGenConfig, choose_pattern, kept_sets, prompt_recovery, token_flags

logger = logging.getLogger(__name__)


class FastGenStatsCollector:
    """Streaming FastGen profile per (layer, KV head, compressed pattern), as a `capture` collector.

    recovery_sum [L, H, 4] float64: per window, the mean over query rows of the retained attention mass (min over the
        group's query heads per row, see `kvcal.runtime.policies.fastgen`), summed over windows;
    kept_sum [L, H, 4] float64: per window, the fraction of its tokens each pattern keeps at the end of the window
        (current length t = n, frequent ranked by the final column sums), summed over windows;
    windows [L] int64: windows (sequences) seen per layer.

    Sliding-window layers (Gemma3) are not profiled: FastGen does not compress them (they are already bounded by
    their window), so their recovery and kept fraction stay NaN, and `choose_pattern` maps NaN to full.
    Windows must be unpadded (calibration windows are); every row and key is a real token.
    """

    def __init__(self, adapter: ModelAdapter, special_ids: torch.Tensor, punct_ids: torch.Tensor,
                 cfg: FastGenConfig | None = None, *, chunk: int = 256):
        L, H = adapter.num_layers, adapter.num_kv_heads
        if chunk < 1:
            raise ValueError(f"`chunk={chunk}` must be >= 1")
        self.cfg = cfg or FastGenConfig()
        self.group = adapter.group_size
        self.scale = [adapter.scaling] * L            # softmax scale per layer, the module's own
        self.sliding = [adapter.is_sliding(i) for i in range(L)]
        self.special_ids, self.punct_ids = special_ids.to(torch.int64), punct_ids.to(torch.int64)
        self.chunk = chunk
        self.recovery_sum = torch.zeros(L, H, 4, dtype=torch.float64)
        self.kept_sum = torch.zeros(L, H, 4, dtype=torch.float64)
        self.windows = torch.zeros(L, dtype=torch.int64)
        self._tokens: torch.Tensor | None = None

    def set_tokens(self, token_ids: torch.Tensor) -> None:
        """Token ids [B, n] of the window about to be forwarded (call before each forward pass)."""
        if token_ids.dim() != 2:
            raise ValueError(f"`token_ids` must be [B, n], got shape {tuple(token_ids.shape)}")
        self._tokens = token_ids.detach().to(torch.int64)

    def _probs(self, q: torch.Tensor, k: torch.Tensor, rows: slice, scale: float) -> torch.Tensor:
        """q [B, H, g, n, d], k [B, H, n, d] -> causal probabilities of rows [B, H, g, c, w] (float32) over the
        first w = rows.stop keys, by the runtime's own prompt softmax."""
        n = k.shape[2]
        causal = torch.ones(1, n, n, dtype=torch.bool, device=k.device).tril()                # [1, n, n]
        return prompt_probs(q, k, causal, scale, rows)

    @torch.no_grad()
    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.sliding[layer]:
            return
        B, H, n, d = key.shape
        if self._tokens is None or tuple(self._tokens.shape) != (B, n):
            got = None if self._tokens is None else tuple(self._tokens.shape)
            raise RuntimeError(f"FastGenStatsCollector needs `set_tokens` with shape {(B, n)} before the forward, "
                               f"got {got}")
        q = query.float().view(B, H, self.group, n, d)
        k = key.float()
        scale = self.scale[layer]
        is_special, is_punct = token_flags(self._tokens.to(k.device), self.special_ids, self.punct_ids)
        chunks = [slice(s, min(s + self.chunk, n)) for s in range(0, n, self.chunk)]
        # pass 1: final column sums (max over the group's query heads), the frequent ranking
        score = torch.zeros(B, H, n, device=k.device)
        for rows in chunks:
            score[..., :rows.stop] += self._probs(q, k, rows, scale).amax(dim=2).sum(dim=2)
        # pass 2: retained mass per pattern, recomputing each chunk's probabilities (memory stays one chunk)
        rec = torch.zeros(4, B, H, device=k.device)
        for rows in chunks:
            rec += prompt_recovery(self._probs(q, k, rows, scale), rows, is_special, is_punct, score, self.cfg)
        rec = rec / n                                                                     # mean over rows
        pos = torch.arange(n, device=k.device).expand(B, H, n)
        length = torch.full((B,), n, dtype=torch.int64, device=k.device)
        kept = kept_sets(is_special, is_punct, score, pos, length, self.cfg).float().mean(-1)   # [4, B, H]
        self.recovery_sum[layer] += rec.sum(1).T.double().cpu()                           # [4, B, H] -> [H, 4]
        self.kept_sum[layer] += kept.sum(1).T.double().cpu()
        self.windows[layer] += B

    @property
    def recovery(self) -> torch.Tensor:
        """[L, H, 4] float32 mean recovery per compressed pattern (NaN for layers never profiled)."""
        return self._mean(self.recovery_sum)

    @property
    def kept_fraction(self) -> torch.Tensor:
        """[L, H, 4] float32 mean fraction of a window's tokens each pattern keeps (NaN for layers never profiled)."""
        return self._mean(self.kept_sum)

    def _mean(self, total: torch.Tensor) -> torch.Tensor:
        w = self.windows.to(torch.float64)[:, None, None]
        return torch.where(w > 0, total / w.clamp(min=1), torch.full_like(total, float("nan"))).float()

    def patterns(self, cfg: FastGenConfig | None = None) -> torch.Tensor:
        """[L, H] int64: the pattern each head would take on the average calibration window (4 = full)."""
        return choose_pattern(self.recovery.permute(2, 0, 1), cfg or self.cfg)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"recovery_sum": self.recovery_sum, "kept_sum": self.kept_sum, "windows": self.windows}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name in ("recovery_sum", "kept_sum", "windows"):
            getattr(self, name).copy_(state[name])
