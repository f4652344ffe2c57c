"""Seeded random-token windows for the token-independent rotation pass (FDC §5.1).

Token ids are drawn uniformly from the tokenizer's ordinary vocabulary: special and added tokens are excluded (they
carry control meaning and would pull attention sinks into the statistics), and so are embedding rows beyond the
tokenizer (untrained padding). If the tokenizer puts a BOS token in front of real text, each window starts with it,
as real prompts do.

Positions: a post-RoPE vector depends on its absolute position through RoPE's low-frequency planes, so a rotation
calibrated only on positions 0..1023 describes long-context keys poorly. Windows are therefore placed at position
offsets spread evenly over [0, max_position) (`position_offsets`). Attention itself depends only on relative
positions, so each window's hidden states are exactly what they would be at offset 0; only the captured post-RoPE
vectors move.
"""

from __future__ import annotations

import torch


def allowed_token_ids(tokenizer, vocab_size: int) -> torch.Tensor:
    """int64 [n] ids that random windows may contain."""
    n = min(len(tokenizer), vocab_size)
    banned = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    keep = torch.ones(n, dtype=torch.bool)
    for i in banned:
        if 0 <= i < n:
            keep[i] = False
    return torch.nonzero(keep).flatten()


def leading_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts in front of text, or None if it adds none."""
    ids = tokenizer("a").input_ids
    bos = tokenizer.bos_token_id
    return bos if bos is not None and len(ids) > 0 and ids[0] == bos else None


def random_token_windows(tokenizer, vocab_size: int, n_tokens: int, seq_len: int, seed: int) -> torch.Tensor:
    """int64 [ceil(n_tokens / seq_len), seq_len] random token ids (see module docstring)."""
    if n_tokens < 1 or seq_len < 2:
        raise ValueError(f"need `--random-tokens` >= 1 and a sequence length >= 2 (got {n_tokens}, {seq_len})")
    n_seq = -(-n_tokens // seq_len)
    allowed = allowed_token_ids(tokenizer, vocab_size)
    gen = torch.Generator().manual_seed(seed)
    ids = allowed[torch.randint(len(allowed), (n_seq, seq_len), generator=gen)]
    bos = leading_bos(tokenizer)
    if bos is not None:
        ids[:, 0] = bos
    return ids


def position_offsets(n_seq: int, seq_len: int, max_position: int) -> list[int]:
    """First position of each of `n_seq` windows, evenly spread so the windows cover [0, max_position)."""
    span = max(max_position - seq_len, 0)
    if n_seq == 1:
        return [0]
    return [round(i * span / (n_seq - 1)) for i in range(n_seq)]
