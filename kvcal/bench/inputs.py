"""The token ids `kvcal bench` measures every method on (`Inputs`), and the lengths it leaves out because they exceed
the model's window. Built once per run by `load_inputs`, from `BenchSettings`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.bench.settings import BenchSettings
from kvcal.data import Corpus, load_corpus, token_windows


@dataclass
class Inputs:
    """The token ids every method is measured on, and the lengths left out."""

    corpus: Corpus                                  # the eval split
    windows: torch.Tensor                           # quality: [windows, prompt + steps + 1]
    speed_ids: dict[int, torch.Tensor]              # context C -> [1, C + speed_steps + 1]
    passkey_lengths: list[int]
    cases: list[tuple[int, float]]                  # passkey (length, depth)
    filler: str                                     # the passkey's haystack text ("" without cases)
    skipped: list[dict]                             # {what, length, reason}: lengths past the model's window

    @property
    def units(self) -> int:
        """Progress units of one method: its quality run, each passkey case, each speed context."""
        return 1 + len(self.cases) + len(self.speed_ids)


def _speed_ids(tok, corpus: Corpus, s: BenchSettings, max_pos: int, skipped: list[dict]) -> dict[int, torch.Tensor]:
    out = {}
    for c in s.contexts:
        if c + s.speed_steps + 1 > max_pos:
            skipped.append({"what": "speed", "length": c, "reason": f"context {c} + {s.speed_steps + 1} decode "
                            f"steps exceeds the model's window ({max_pos} positions)"})
            continue
        try:
            out[c] = token_windows(tok, corpus, 1, c + s.speed_steps + 1, s.seed + 3)
        except ValueError as e:
            skipped.append({"what": "speed", "length": c, "reason": str(e)})
    return out


def _passkey_lengths(s: BenchSettings, max_pos: int, skipped: list[dict]) -> list[int]:
    out = []
    for n in s.passkey_lengths:
        if n + s.passkey_tokens > max_pos:
            skipped.append({"what": "passkey", "length": n, "reason": f"passkey length {n} + {s.passkey_tokens} "
                            f"answer tokens exceeds the model's window ({max_pos} positions)"})
        else:
            out.append(n)
    return out


def load_inputs(tok, s: BenchSettings, max_pos: int) -> Inputs:
    """Held-out windows, speed prompts and passkey cases of `s` that fit the model's `max_pos` positions."""
    if s.prompt + s.steps + 1 > max_pos:
        raise ValueError(f"`--prompt {s.prompt}` + `--steps {s.steps}` exceeds the model's window ({max_pos} "
                         "positions); lower them")
    corpus = load_corpus(s.dataset, "eval")
    windows = token_windows(tok, corpus, s.windows, s.prompt + s.steps + 1, s.seed)
    skipped: list[dict] = []
    speed_ids = _speed_ids(tok, corpus, s, max_pos, skipped)
    lengths = _passkey_lengths(s, max_pos, skipped)
    cases = [(n, depth) for n in lengths for depth in s.passkey_depths]
    filler = "\n\n".join(load_corpus("pydoc", "all").documents) if cases else ""
    return Inputs(corpus, windows, speed_ids, lengths, cases, filler, skipped)
