"""Evaluation: what "meets the target" means and how fidelity against dense is measured, for calibrate, bench and
report alike.

    target.py    QualityTarget (its `met` rule, Wilson and per-window bounds, to/from dict)
    fidelity.py  Fidelity; teacher-forced decode against dense logits (decode_fidelity, LogitScores, dense_logits)
    probe.py     DecodeProbe: many cache settings on one recorded prompt, stepwise
    passkey.py   passkey retrieval
"""

from kvcal.eval.fidelity import Fidelity, compare_logits, decode_fidelity, dense_logits, teacher_force
from kvcal.eval.passkey import passkey, passkey_prompt
from kvcal.eval.probe import DecodeProbe
from kvcal.eval.target import QualityTarget, bound_in_words, wilson_lower, window_lower

__all__ = ["DecodeProbe", "Fidelity", "QualityTarget", "bound_in_words", "compare_logits", "decode_fidelity",
           "dense_logits", "passkey", "passkey_prompt", "teacher_force", "wilson_lower", "window_lower"]
