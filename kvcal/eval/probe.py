"""`DecodeProbe`: the decode-phase fidelity of many cache settings on the same inputs, paying the shared work once.

    probe = DecodeProbe(model, bundle, prompt, continuation, tokenizer=tokenizer)    # prompt [B, P], cont. [B, M + 1]
    fid = probe.measure(config)                                                        # a Fidelity
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from kvcal.eval.fidelity import (
    Fidelity,
    LogitScores,
    TopLogits,
    in_model_dtype,
    prefill_precision,
    reference_top,
    teacher_force,
)
from kvcal.eval.spilled import SpilledRecords


class DecodeProbe:
    """`decode_fidelity` for many compression settings on the same inputs, paying the shared work once.

    The dense reference (`TopLogits`) and the prefill attention do not depend on the settings, so both run once
    here; each `measure` replays the recorded prefill into a fresh cache (the runtime's own write path, `CompressedKV.
    write_prefill`) and teacher-forces the continuation through it one token per step, so results equal
    `decode_fidelity` with the same cache settings.
    """

    @torch.inference_mode()
    def __init__(self, model, bundle, prompt: torch.Tensor, continuation: torch.Tensor, *, tokenizer=None,
                 fastgen=None, on_window: Callable[[], None] | None = None,
                 on_reference: Callable[[int, dict], AbstractContextManager] | None = None,
                 prefill_dtype: torch.dtype | None = None):
        """`fastgen` (a FastGenConfig): also record each prompt's FastGen recovery statistics, so settings with
        FastGen can be measured (their r_l and r_f must equal these); needs `tokenizer`. `on_window()`: called as
        each window's recording is put away (a caller's heap trim: a window's prefill frees hundreds of MB).
        `on_reference(b, records)`: a context window b's reference forward runs in, given its recorded prefill (a
        caller's capture of the continuation's queries and keys; a window at a time, so not with `fastgen`).
        `prefill_dtype`: the prompts' prefill runs its matrix products in it (`prefill_precision`), the reference and
        every measured continuation in the model's dtype, all of them reading the same recorded prompt."""
        if on_reference is not None and fastgen is not None:
            raise ValueError("`on_reference` sees one window at a time; FastGen's statistics record the whole batch")
        from kvcal.runtime.adapters import adapter_for
        from kvcal.runtime.config import CompressionConfig
        from kvcal.runtime.hf import KvcalCache

        self.model, self.bundle, self.prompt, self.continuation = model, bundle, prompt, continuation
        self.tokenizer, self.fastgen = tokenizer, fastgen
        # a window at a time, so that the prefill's activations and the float32 K/V are one window's; FastGen's
        # statistics are per batch and recorded with the whole batch at once
        parts = [slice(b, b + 1) for b in range(len(prompt))] if fastgen is None else [slice(None)]
        config = CompressionConfig.none().with_(fastgen=fastgen)
        sliding = [t == "sliding_attention" for t in adapter_for(model.config).layer_types]
        self.ref, self.records = None, SpilledRecords()
        for part in parts:
            with prefill_precision(model, prefill_dtype):
                records, _ = KvcalCache.record_prompt(bundle, model, prompt[part], config, tokenizer=tokenizer)
            records = in_model_dtype(model, records)
            with on_reference(part.start, records) if on_reference else nullcontext():
                ref = reference_top(model, records, continuation[part])
            # the replay rounds K/V through the store's formats (at most fp16), so the recorded copies need no more
            # than fp16 once the reference is made. Sliding layers keep their window as the model's cache held it.
            records = {i: (key.half(), value.half(), *rest) if not sliding[i] else (key, value, *rest)
                       for i, (key, value, *rest) in records.items()}
            if len(parts) == 1:         # FastGen's statistics belong to the batch: kept whole, in memory
                self.ref, self.records = ref, records
                break
            # a window at a time on disk: four 4k windows of a 30-layer model are 0.4 GB even in fp16
            self.records.append(records)
            if self.ref is None:                 # the whole batch's reference, filled a window at a time
                self.ref = TopLogits.empty(len(prompt), *ref.logp.shape[1:])
            self.ref[part] = ref
            del records, ref
            if on_window:
                on_window()

    @torch.inference_mode()
    def measure(self, config, bundle=None, serve=None) -> Fidelity:
        """Fidelity of `config` (a CompressionConfig), with `bundle`'s ranks (default: the probe's bundle), served with
        `serve` (a ServeOptions; None: the defaults)."""
        cache = self.replay(config, bundle, serve)
        page_s0 = cache.kv.store.page_seconds
        target = self.continuation[:, 1:]
        scores = LogitScores(target.shape[0])

        def score(t: int, logits: torch.Tensor) -> None:
            c = logits.shape[1]
            scores.add(self.ref[:, t:t + c], logits, target[:, t:t + c])

        _, seconds = teacher_force(self.model, cache, self.continuation, on_logits=score)
        result = scores.fidelity(self.prompt.shape[1], seconds, cache)
        result.page_ms_per_step = 1000 * (cache.kv.store.page_seconds - page_s0) / max(target.shape[1], 1)
        cache.release()
        return result

    def replay(self, config, bundle=None, serve=None):
        """A fresh KvcalCache of `config` (served with `serve`, None: the defaults) holding the recorded prompt, ready
        for the continuation."""
        from kvcal.runtime.hf import KvcalCache
        from kvcal.runtime.options import ServeOptions

        if config.fastgen is not None and (self.fastgen is None or (config.fastgen.r_local, config.fastgen.r_frequent)
                                           != (self.fastgen.r_local, self.fastgen.r_frequent)):
            raise ValueError("this probe recorded no FastGen statistics for these r_local / r_frequent; make it with "
                             "`fastgen=`")
        cache = KvcalCache.from_bundle(bundle or self.bundle, self.model, config, tokenizer=self.tokenizer,
                                       serve=serve or ServeOptions())
        spilled = isinstance(self.records, SpilledRecords)
        cache.prime(self.records.batch() if spilled else self.records, token_ids=self.prompt)
        return cache

