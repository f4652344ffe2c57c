"""Passkey retrieval: a random 5-digit key hidden at a given depth of filler text, asked for back."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
_QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer, filler_ids: list[int], length: int, depth: float, seed: int) -> tuple[list[int], str]:
    """Token ids of about `length` tokens: filler text with the needle at relative `depth` (0 = start, 1 = end),
    then the question. Returns (ids, key)."""
    key = str(random.Random(seed).randint(10000, 99999))
    needle = tokenizer(_NEEDLE.format(key=key), add_special_tokens=False).input_ids
    question = tokenizer(_QUESTION, add_special_tokens=False).input_ids
    prefix = tokenizer("", add_special_tokens=True).input_ids     # BOS where the tokenizer uses one
    room = length - len(needle) - len(question) - len(prefix)
    if room < 1 or room > len(filler_ids):
        raise ValueError(f"passkey length {length} needs {room} filler tokens; {len(filler_ids)} available")
    cut = int(round(depth * room))
    return prefix + filler_ids[:cut] + needle + filler_ids[cut:room] + question, key


@torch.inference_mode()
def passkey(model, tokenizer, filler_text: str, lengths: list[int], depths: list[float],
            make_cache: Callable[[], object], seed: int = 0, new_tokens: int = 8) -> dict:
    """Greedy retrieval accuracy per (length, depth) and overall."""
    filler = tokenizer(filler_text, add_special_tokens=False).input_ids
    results = {}
    for length in lengths:
        for depth in depths:
            ids, key = passkey_prompt(tokenizer, filler, length, depth, seed + length + int(depth * 100))
            cache = make_cache()
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 cache=cache, pad_token_id=tokenizer.eos_token_id)
            text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
            results[f"{length}@{depth:g}"] = key in text
            if hasattr(cache, "release"):
                cache.release()
    return {"accuracy": sum(results.values()) / len(results), "cases": results}
