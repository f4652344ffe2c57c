"""What `kvcal bench` measures of one method: quality and memory on held-out windows, passkey retrieval, speed.

`measure_quality` and `measure_speed` take a `Method` and its inputs and return report rows (kvcal.bench.report has
the schema); `PasskeyProbe` pays one prompt's prefill once for every method on the kvcal store. The protocol that
runs them over all methods is `kvcal.bench.run`.
"""

from __future__ import annotations

import time

import torch

from kvcal.bench.method import Method
from kvcal.eval import DecodeProbe, QualityTarget
from kvcal.runtime.policies.fastgen import FastGenConfig


def release(cache) -> None:
    """Give back a kvcal cache's pages now (other caches hold plain tensors that go with the object)."""
    if hasattr(cache, "release"):
        cache.release()


def memory_row(mem: dict, tokens: int) -> dict:
    """A row's memory (report schema) from a cache's `memory()` over `tokens` tokens."""
    return {"bytes_per_token": mem["total_bytes"] / tokens, "ratio_to_fp16": mem["ratio_to_fp16"],
            "total_bytes": int(mem["total_bytes"]), "fp16_bytes": int(mem["fp16_bytes"]), "tokens": int(tokens),
            "fixed_bytes": int(mem.get("fixed_bytes", 0))}


@torch.inference_mode()
def measure_quality(method: Method, probe: DecodeProbe, model, tokenizer,
                    target: QualityTarget) -> tuple[dict, dict]:
    """(quality, memory) of `method` on the probe's windows: store methods replay the probe's recorded prefill,
    other caches run their own. "Meets the target" is `target.met`, the rule calibrate's search applies."""
    from kvcal.eval import compare_logits, teacher_force

    B, P = probe.prompt.shape
    steps = probe.continuation.shape[1] - 1
    cfg = method.config
    if method.replays and (cfg.fastgen is None or (cfg.fastgen.r_local, cfg.fastgen.r_frequent)
                            == (probe.fastgen.r_local, probe.fastgen.r_frequent)):
        fid = probe.measure(cfg, method.bundle, serve=method.serve)
        mem = fid.memory
    else:
        cache = method.make_cache(model, tokenizer, reserve=steps)
        model(input_ids=probe.prompt, cache=cache, use_cache=True, logits_to_keep=1)
        got, seconds = teacher_force(model, cache, probe.continuation)
        fid = compare_logits(probe.ref, got, probe.continuation[:, 1:], P, seconds, cache)
        mem = cache.memory()
        release(cache)
    memory = memory_row(mem, B * (P + steps))
    quality = {"kl": fid.kl, "top1": fid.top1, "ppl_ratio": fid.ppl_ratio, "ppl": fid.ppl, "ppl_dense": fid.ppl_dense,
               "predictions": fid.predictions, "decode_ms_per_step": fid.decode_ms_per_step,
               "meets_target": target.met(fid),
               "tiers": fid.tiers}
    return quality, memory


@torch.inference_mode()
def measure_speed(method: Method, model, tokenizer, ids: torch.Tensor, context: int, steps: int) -> dict:
    """ids [1, >= context + steps + 1]: prefill `context` tokens, then steps + 1 decode steps (the first warms up)."""
    cache = method.make_cache(model, tokenizer, reserve=steps + 1)
    t0 = time.perf_counter()
    model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    times = []
    for t in range(steps + 1):
        t0 = time.perf_counter()
        model(input_ids=ids[:, context + t:context + t + 1], cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
    mem = memory_row(cache.memory(), context + steps + 1)
    release(cache)
    return {"context": context, "prefill_tokens_per_s": context / prefill,
            "decode_ms_per_step": 1000 * sum(times[1:]) / steps, "bytes_per_token": mem["bytes_per_token"],
            "ratio_to_fp16": mem["ratio_to_fp16"]}


class PasskeyProbe:
    """`passkey` for many methods on the kvcal store, paying each prompt's prefill once.

    kvcal's prefill attends on the uncompressed K/V whatever the settings, so the first answer token and the
    prefill's inputs are the same for every store method: record them once per prompt (as `DecodeProbe` does), then
    replay the prefill into a fresh cache per method (`KvcalCache.prime`) and decode greedily, stopping at EOS as
    `generate` does. Prompts, keys and seeds are those of `kvcal.eval.passkey`.
    """

    @torch.inference_mode()
    def __init__(self, model, bundle, tokenizer, filler: str, length: int, depth: float, seed: int,
                 fastgen: FastGenConfig):
        from kvcal.eval import passkey_prompt
        from kvcal.runtime.config import CompressionConfig
        from kvcal.runtime.hf import KvcalCache

        self.model, self.tokenizer = model, tokenizer
        filler_ids = tokenizer(filler, add_special_tokens=False).input_ids
        ids, self.key = passkey_prompt(tokenizer, filler_ids, length, depth, seed + length + int(depth * 100))
        self.case = f"{length}@{depth:g}"
        self.prompt = torch.tensor([ids])
        self.records, last = KvcalCache.record_prompt(bundle, model, self.prompt,
                                                      CompressionConfig.none().with_(fastgen=fastgen), tokenizer)
        self.first = last.argmax(-1)                                                   # [1]
        eos = model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])

    @torch.inference_mode()
    def answer(self, method: Method, new_tokens: int) -> str:
        """The greedy answer (`new_tokens` at most) of `method`'s cache, primed with the recorded prefill."""
        cache = method.make_cache(self.model, self.tokenizer)
        cache.prime(self.records, token_ids=self.prompt)
        tokens = [int(self.first)]
        while len(tokens) < new_tokens and tokens[-1] not in self.eos:
            out = self.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        cache.release()
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def retrieved(self, method: Method, new_tokens: int) -> bool:
        return self.key in self.answer(method, new_tokens)
