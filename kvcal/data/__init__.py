"""Calibration and evaluation inputs: seeded random tokens, packaged corpora and user files (all offline)."""

from kvcal.data.corpora import CORPORA, Corpus, load_corpus, token_windows
from kvcal.data.random_tokens import allowed_token_ids, position_offsets, random_token_windows

__all__ = [
    "CORPORA",
    "Corpus",
    "allowed_token_ids",
    "load_corpus",
    "position_offsets",
    "random_token_windows",
    "token_windows",
]
