"""Run every method of `kvcal bench` on the same inputs, in one process: quality, passkey retrieval, speed.

Protocol, per method (all against the same dense model, same token ids):

* **Quality** on held-out text (`load_corpus(dataset, "eval")`, documents disjoint from calibration and search):
  `windows` windows of `prompt` prompt tokens, then `steps` teacher-forced decode steps through the method's cache
  (kvcal.profile.quality). KL(dense || method), top-1 agreement with dense and the continuation-perplexity ratio over
  windows x steps predictions. The dense reference logits and, for methods on the kvcal store, the dense prefill are
  computed once (`DecodeProbe`); other caches run their own prefill. The method's memory is read from the cache at
  the end of this run (prompt + steps tokens): bytes per token = bytes held / (windows x (prompt + steps)).
* **Passkey**: greedy retrieval of a 5-digit key hidden in pydoc text at each depth, for each length
  (`kvcal.profile.quality.passkey`; methods on the kvcal store replay one recorded prefill per prompt, `PasskeyProbe`,
  which gives the same answers as `generate` and saves a prefill per method).
* **Speed** at each context length C (batch 1, CPU): prefill tokens/s of one prefill of C tokens through a fresh
  cache, then `speed_steps` + 1 teacher-forced decode steps; decode ms/step is the mean over the last `speed_steps`
  (the first step warms up). Lengths past the model's window are skipped, and the report says so.

Calibrated baselines (Palu's whitening, KVQuant's key ranges and codebooks) are fitted on first use on windows of the
corpus's calib split, never on the eval split measured here.

Matched memory: kvcal joint is measured first; its bytes ratio on the quality run is the budget of the eviction and
Palu baselines (kvcal.bench.methods). Seeds: windows come from `seed`, passkeys from `seed` too; nothing else is
random (the runtime's mixing rotation is seeded by its rank).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvcal.bench import kvquant as KQ
from kvcal.bench import methods as M
from kvcal.bench.kvtuner import kvtuner_methods, layer_sensitivity
from kvcal.bench.report import SCHEMA_VERSION, summarise
from kvcal.data import load_corpus, token_windows
from kvcal.models import LoadedModel, fingerprint, weights_hash
from kvcal.models.sources import file_sha256
from kvcal.profile.quality import DecodeProbe, QualityTarget, passkey
from kvcal.runtime.bundle import Bundle
from kvcal.runtime.fastgen import FastGenConfig

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]     # (what is running, units done, units total)


@dataclass
class BenchSettings:
    quick: bool = False
    seed: int = 0
    backend: str = "auto"                 # kvcal attention backend (auto, torch, cuda)
    dataset: str = "default"              # corpus for held-out quality text (eval split) and Palu's whitening (calib)
    windows: int = 8                      # held-out windows for quality
    prompt: int = 1024                    # prompt tokens per window
    steps: int = 64                       # teacher-forced decode steps per window (windows x steps predictions)
    passkey_lengths: tuple[int, ...] = (1024, 4096, 16384)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    passkey_tokens: int = 8               # greedy tokens generated for the answer
    contexts: tuple[int, ...] = (1024, 4096, 16384)   # speed: context lengths
    speed_steps: int = 16                 # speed: decode steps averaged per context
    calib_windows: int = 4                # calibration windows (of `prompt` tokens): Palu, KVTuner-style sensitivity
    methods: tuple[str, ...] | None = None   # keys / families / series to run (None: all); kvcal joint always runs
    target_top1: float | None = None      # top-1 of the quality target (None: the bundle's, `bundle_target`)
    command: str | None = None            # the command line, recorded in the report

    QUICK = {"windows": 4, "prompt": 512, "steps": 32, "passkey_lengths": (1024,), "contexts": (1024,),
             "speed_steps": 8, "calib_windows": 2}

    @classmethod
    def preset(cls, quick: bool = False, **overrides) -> BenchSettings:
        """Full settings, or `--quick` ones (a few minutes for a 135M model on 2 cores); `overrides` win."""
        base = dict(cls.QUICK) if quick else {}
        return cls(quick=quick, **{**base, **{k: v for k, v in overrides.items() if v is not None}})

    def __post_init__(self):
        for name in ("windows", "prompt", "steps", "passkey_tokens", "speed_steps", "calib_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}={getattr(self, name)}` must be >= 1")
        if any(c < 1 for c in (*self.contexts, *self.passkey_lengths)):
            raise ValueError("context and passkey lengths must be >= 1")
        if any(not 0 <= x <= 1 for x in self.passkey_depths):
            raise ValueError(f"passkey depths {self.passkey_depths} must lie in [0, 1]")
        if self.target_top1 is not None and not 0 < self.target_top1 <= 1:
            raise ValueError(f"`--target-top1 {self.target_top1:g}` must lie in (0, 1]")


# --------------------------------------------------------------------------------------------- measuring


def _release(cache) -> None:
    if hasattr(cache, "release"):
        cache.release()


def _memory(mem: dict, tokens: int) -> dict:
    """A row's memory (report schema) from a cache's `memory()` over `tokens` tokens."""
    return {"bytes_per_token": mem["total_bytes"] / tokens, "ratio_to_fp16": mem["ratio_to_fp16"],
            "total_bytes": int(mem["total_bytes"]), "fp16_bytes": int(mem["fp16_bytes"]), "tokens": int(tokens),
            "fixed_bytes": int(mem.get("fixed_bytes", 0))}


@torch.inference_mode()
def measure_quality(method: M.Method, probe: DecodeProbe, model, tokenizer,
                    target: QualityTarget) -> tuple[dict, dict]:
    """(quality, memory) of `method` on the probe's windows: store methods replay the probe's recorded prefill,
    other caches run their own. "Meets the target" is `target.met`, the rule calibrate's search applies."""
    from kvcal.profile.quality import compare_logits, teacher_force

    B, P = probe.prompt.shape
    steps = probe.continuation.shape[1] - 1
    cfg = method.config
    if method.replays and (cfg.fastgen is None or (cfg.fastgen.r_local, cfg.fastgen.r_frequent)
                            == (probe.fastgen.r_local, probe.fastgen.r_frequent)):
        fid = probe.measure(cfg, method.bundle)
        mem = fid.memory
    else:
        cache = method.make_cache(model, tokenizer, reserve=steps)
        model(input_ids=probe.prompt, cache=cache, use_cache=True, logits_to_keep=1)
        got, seconds = teacher_force(model, cache, probe.continuation)
        fid = compare_logits(probe.ref, got, probe.continuation[:, 1:], P, seconds, cache)
        mem = cache.memory()
        _release(cache)
    tokens = B * (P + steps)
    memory = _memory(mem, tokens)
    quality = {"kl": fid.kl, "top1": fid.top1, "ppl_ratio": fid.ppl_ratio, "ppl": fid.ppl, "ppl_dense": fid.ppl_dense,
               "predictions": fid.predictions, "decode_ms_per_step": fid.decode_ms_per_step,
               "meets_target": target.met(fid),
               "tiers": fid.tiers}
    return quality, memory


@torch.inference_mode()
def measure_speed(method: M.Method, model, tokenizer, ids: torch.Tensor, context: int, steps: int) -> dict:
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
    mem = _memory(cache.memory(), context + steps + 1)
    _release(cache)
    return {"context": context, "prefill_tokens_per_s": context / prefill,
            "decode_ms_per_step": 1000 * sum(times[1:]) / steps, "bytes_per_token": mem["bytes_per_token"],
            "ratio_to_fp16": mem["ratio_to_fp16"]}


class PasskeyProbe:
    """`passkey` for many methods on the kvcal store, paying each prompt's prefill once.

    kvcal's prefill attends on the uncompressed K/V whatever the settings, so the first answer token and the
    prefill's inputs are the same for every store method: record them once per prompt (as `DecodeProbe` does), then
    replay the prefill into a fresh cache per method (`KvcalCache.prime`) and decode greedily, stopping at EOS as
    `generate` does. Prompts, keys and seeds are those of `kvcal.profile.quality.passkey`.
    """

    @torch.inference_mode()
    def __init__(self, model, bundle, tokenizer, filler: str, length: int, depth: float, seed: int,
                 fastgen: FastGenConfig):
        from kvcal.profile.quality import passkey_prompt
        from kvcal.runtime.cache import CompressionConfig
        from kvcal.runtime.hf import KvcalCache

        self.model, self.tokenizer = model, tokenizer
        filler_ids = tokenizer(filler, add_special_tokens=False).input_ids
        ids, self.key = passkey_prompt(tokenizer, filler_ids, length, depth, seed + length + int(depth * 100))
        self.case = f"{length}@{depth:g}"
        self.prompt = torch.tensor([ids])
        recording = KvcalCache.from_bundle(bundle, model, CompressionConfig.none().with_(fastgen=fastgen),
                                           tokenizer=tokenizer)
        recording.record = True
        out = model(input_ids=self.prompt, cache=recording, use_cache=True, logits_to_keep=1)
        self.first = out.logits[:, -1].argmax(-1)                                      # [1]
        self.records = dict(recording.kv.recorder)
        for i, layer in enumerate(recording.layers):
            if recording.sliding[i]:
                self.records[i] = (layer.keys, layer.values, layer.cumulative_length)
        recording.release()
        eos = model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])

    @torch.inference_mode()
    def answer(self, method: M.Method, new_tokens: int) -> str:
        """The greedy answer (`new_tokens` at most) of `method`'s cache, primed with the recorded prefill."""
        from kvcal.runtime.hf import KvcalCache

        cache = KvcalCache.from_bundle(method.bundle, self.model, method.config, tokenizer=self.tokenizer)
        cache.prime(self.records, token_ids=self.prompt)
        tokens = [int(self.first)]
        while len(tokens) < new_tokens and tokens[-1] not in self.eos:
            out = self.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        cache.release()
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def retrieved(self, method: M.Method, new_tokens: int) -> bool:
        return self.key in self.answer(method, new_tokens)


# --------------------------------------------------------------------------------------------- provenance


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(backend_name: str) -> dict:
    import transformers

    from kvcal import __version__

    return {"kvcal": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu": _cpu_name(), "cpu_count": os.cpu_count() or 0, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(), "attention_backend": backend_name,
            # `kvcal bench` replaces this with why it runs that many (`--threads`, kvcal.cli._threads)
            "threads": f"{torch.get_num_threads()} (the caller's torch setting)"}


def bundle_target(bundle: Bundle) -> tuple[QualityTarget, str]:
    """The quality target the bundle's search used (`QualityTarget()` when it records none) and where it came from:
    "bundle" or "default"."""
    recorded = (bundle.calibration.get("search") or {}).get("target")
    return (QualityTarget(**recorded), "bundle") if recorded else (QualityTarget(), "default")


# --------------------------------------------------------------------------------------------- the run


def run_bench(lm: LoadedModel, bundle: Bundle, settings: BenchSettings, *, bundle_path: Path | None = None,
              progress: Progress | None = None, status: Callable[[str], None] | None = None) -> dict:
    """Measure every method and return the report (see kvcal.bench.report for its schema).

    Three phases over all methods, each on the same inputs: quality (dense first, then kvcal joint, whose bytes
    ratio budgets the matched baselines), passkey, speed."""
    from kvcal.runtime.attention import select_backend

    t_start = time.perf_counter()
    say = status or (lambda msg: logger.info("%s", msg))
    model, tok, adapter = lm.model, lm.tokenizer, lm.adapter
    device = str(next(model.parameters()).device)
    backend = select_backend(settings.backend, device)          # ValueError, one line, if it cannot run
    bundle.check_model(fingerprint(model.config), weights_hash(model, adapter),
                       shape=(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim))
    torch.manual_seed(settings.seed)
    s = settings
    target, target_source = bundle_target(bundle)
    if s.target_top1 is not None:       # judged against another target than the bundle was searched for
        target, target_source = dataclasses.replace(target, top1=s.target_top1), "command line"
    max_pos = adapter.max_positions
    if s.prompt + s.steps + 1 > max_pos:
        raise ValueError(f"`--prompt {s.prompt}` + `--steps {s.steps}` exceeds the model's window ({max_pos} "
                         "positions); lower them")

    # ---- inputs
    eval_corpus = load_corpus(s.dataset, "eval")
    windows = token_windows(tok, eval_corpus, s.windows, s.prompt + s.steps + 1, s.seed)
    skipped, speed_ids = [], {}
    for c in s.contexts:
        if c + s.speed_steps + 1 > max_pos:
            skipped.append({"what": "speed", "length": c, "reason": f"context {c} + {s.speed_steps + 1} decode "
                            f"steps exceeds the model's window ({max_pos} positions)"})
            continue
        try:
            speed_ids[c] = token_windows(tok, eval_corpus, 1, c + s.speed_steps + 1, s.seed + 3)
        except ValueError as e:
            skipped.append({"what": "speed", "length": c, "reason": str(e)})
    pk_lengths = []
    for n in s.passkey_lengths:
        if n + s.passkey_tokens > max_pos:
            skipped.append({"what": "passkey", "length": n, "reason": f"passkey length {n} + {s.passkey_tokens} "
                            f"answer tokens exceeds the model's window ({max_pos} positions)"})
        else:
            pk_lengths.append(n)
    cases = [(n, depth) for n in pk_lengths for depth in s.passkey_depths]
    shortest_prompt = min([s.prompt, *pk_lengths, *speed_ids])
    filler = "\n\n".join(load_corpus("pydoc", "all").documents) if cases else ""

    # ---- methods
    calibrated: dict = {}

    def on_first_use(name: str, what: str, compute: Callable[[torch.Tensor], Any]) -> Callable[[], Any]:
        """A function returning `compute(calibration windows)`, computed on its first call only (a baseline that
        is not run costs nothing); every baseline calibrates on the same windows of the corpus's calib split."""
        def get():
            if name not in calibrated:
                say(f"{what} from {s.calib_windows} calibration windows")
                if "windows" not in calibrated:
                    calibrated["windows"] = token_windows(tok, load_corpus(s.dataset, "calib"), s.calib_windows,
                                                          s.prompt, s.seed + 5)
                calibrated[name] = compute(calibrated["windows"])
            return calibrated[name]
        return get

    def palu(windows):
        from kvcal.bench.lowrank import palu_factors as whitened_svd

        return whitened_svd(model, adapter, windows)

    palu_factors = on_first_use("palu", "Palu: whitened SVD of W_K / W_V", palu)
    kvquant = on_first_use("kvquant", "KVQuant: per-channel key ranges and nuq codebooks",
                           lambda w: KQ.kvquant_calibration(model, adapter, w, seed=s.seed))
    sensitivity = on_first_use("kvtuner", "KVTuner-style: attention-error sensitivity",
                               lambda w: layer_sensitivity(model, adapter, w, M.KIVI_WINDOW, M.KIVI_GROUP))
    base = (M.cache_methods(model) + M.store_methods(bundle, s.backend)
            + KQ.kvquant_methods(model, adapter, kvquant, s.calib_windows, s.calib_windows * s.prompt)
            + kvtuner_methods(model, adapter, bundle, sensitivity, M.KIVI_WINDOW, M.KIVI_GROUP, s.backend))
    joint = next(m for m in base if m.key == "kvcal-joint")
    sweep = M.sweep_methods(bundle, joint, s.quick)
    everything = base + M.matched_methods(model, adapter, 1.0, palu_factors, bundle, s.backend, shortest_prompt) + sweep
    if s.methods:
        known = {x for m in everything for x in (m.key, m.family.lower(), m.series.lower())}
        unknown = [w for w in s.methods if w.lower() not in known]
        if unknown:
            raise ValueError(f"`--methods`: unknown `{unknown[0]}`; choose among {', '.join(m.key for m in everything)}"
                             " or a family (dense, quantization, eviction, low-rank, seed, kvcal)")
    chosen = {m.key for m in M.select(everything, s.methods)}
    n_run = sum(m.key in chosen and not m.unavailable for m in everything)
    total, done = n_run * (1 + len(cases) + len(speed_ids)), 0

    def tick(label: str, units: int = 1) -> None:
        nonlocal done
        done += units
        if progress:
            progress(label, done, total)

    rows: dict[str, dict] = {}
    for m in everything:
        rows[m.key] = {"key": m.key, "name": m.name, "family": m.family, "series": m.series,
                       "description": m.description, "settings": m.settings, "available": not m.unavailable,
                       "unavailable_reason": m.unavailable, "note": m.note, "memory": None, "quality": None,
                       "passkey": None, "speed": [], "seconds": 0.0}
    timed: dict[str, float] = {}

    def timing(method: M.Method, t0: float) -> None:
        timed[method.key] = timed.get(method.key, 0.0) + time.perf_counter() - t0

    # ---- phase 1: quality (and memory) on held-out text
    if progress:
        progress("recording the dense prefill", 0, total)
    say(f"recording the dense prefill of {s.windows} x {s.prompt} held-out tokens")
    probe = DecodeProbe(model, bundle, windows[:, :s.prompt], windows[:, s.prompt:], tokenizer=tok,
                        fastgen=FastGenConfig())

    def quality(method: M.Method) -> None:
        if progress:
            progress(f"{method.name}: quality", done, total)
        t0 = time.perf_counter()
        row = rows[method.key]
        row["quality"], row["memory"] = measure_quality(method, probe, model, tok, target)
        timing(method, t0)
        q, mem = row["quality"], row["memory"]
        say(f"  {method.name:28} {mem['ratio_to_fp16']:.3f} of fp16  top-1 {q['top1']:.3f}  KL {q['kl']:.4f}  "
            f"ppl {q['ppl_ratio']:.3f}  ({timed[method.key]:.0f} s)")
        tick(f"{method.name}: quality")

    quality(next(m for m in base if m.key == "dense"))
    quality(joint)
    ratio = rows["kvcal-joint"]["memory"]["ratio_to_fp16"]
    matched = M.matched_methods(model, adapter, ratio, palu_factors, bundle, s.backend, shortest_prompt)
    for m in matched:               # the rows were made from placeholders budgeted at 1.0: say the real budget
        rows[m.key].update(description=m.description, settings=m.settings)
    runnable = [m for m in base + matched + sweep if m.key in chosen and not m.unavailable]
    for m in runnable:
        if rows[m.key]["quality"] is None:
            quality(m)
    probe = None          # frees the recorded prefill before the passkey prompts are recorded

    # ---- phase 2: passkey retrieval
    if cases:
        say(f"passkey: {len(cases)} prompts ({', '.join(f'{n}@{d:g}' for n, d in cases)})")
        hits: dict[str, dict[str, bool]] = {m.key: {} for m in runnable}
        store = [m for m in runnable if m.replays]
        for n, depth in cases:
            t0 = time.perf_counter()
            pk = PasskeyProbe(model, bundle, tok, filler, n, depth, s.seed, FastGenConfig())
            share = (time.perf_counter() - t0) / max(len(store), 1)
            for m in store:
                if progress:
                    progress(f"{m.name}: passkey {pk.case}", done, total)
                t0 = time.perf_counter()
                hits[m.key][pk.case] = pk.retrieved(m, s.passkey_tokens)
                timing(m, t0 - share)
                tick(f"{m.name}: passkey {pk.case}")
            del pk
        for m in runnable:
            if m.replays:
                continue
            if progress:
                progress(f"{m.name}: passkey", done, total)
            t0 = time.perf_counter()
            make = lambda m=m: m.make_cache(model, tok, reserve=s.passkey_tokens)   # noqa: E731
            hits[m.key] = passkey(model, tok, filler, pk_lengths, list(s.passkey_depths), make, seed=s.seed,
                                  new_tokens=s.passkey_tokens)["cases"]
            timing(m, t0)
            tick(f"{m.name}: passkey", len(cases))
        for key, h in hits.items():
            rows[key]["passkey"] = {"accuracy": sum(h.values()) / len(h), "cases": h}

    # ---- phase 3: speed
    for m in runnable:
        for c, ids in speed_ids.items():
            if progress:
                progress(f"{m.name}: speed @ {c}", done, total)
            t0 = time.perf_counter()
            rows[m.key]["speed"].append(measure_speed(m, model, tok, ids, c, s.speed_steps))
            timing(m, t0)
            tick(f"{m.name}: speed @ {c}")
    for key, seconds in timed.items():
        rows[key]["seconds"] = round(seconds, 2)

    report = {
        "schema_version": SCHEMA_VERSION,
        "kind": "kvcal-bench",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": s.command or "kvcal bench",
        "seed": s.seed,
        "quick": s.quick,
        "wall_seconds": 0.0,
        "model": {"name": lm.name, "family": adapter.family, "fingerprint": fingerprint(model.config),
                  "weights_hash": weights_hash(model, adapter), "dtype": str(model.dtype).removeprefix("torch."),
                  "num_layers": adapter.num_layers, "num_kv_heads": adapter.num_kv_heads,
                  "num_q_heads": adapter.num_q_heads, "head_dim": adapter.head_dim, "max_positions": max_pos,
                  "fp16_bytes_per_token": sum(not adapter.is_sliding(i) for i in range(adapter.num_layers))
                  * adapter.num_kv_heads * adapter.head_dim * 2 * 2},
        "bundle": {"path": str(bundle_path) if bundle_path else None,
                   "sha256": file_sha256(bundle_path) if bundle_path and Path(bundle_path).is_file() else None,
                   "created": bundle.created, "kvcal_version": bundle.kvcal_version, "policy": bundle.settings,
                   "target": {**asdict(target), "source": target_source}},
        "environment": environment(backend.name()),
        "settings": {"quality": {"dataset": eval_corpus.name, "dataset_sha256": eval_corpus.sha256,
                                 "windows": s.windows, "prompt": s.prompt, "steps": s.steps,
                                 "windows_sha256": hashlib.sha256(windows.numpy().tobytes()).hexdigest()},
                     "passkey": {"lengths": pk_lengths, "depths": list(s.passkey_depths),
                                 "new_tokens": s.passkey_tokens, "filler": "pydoc"},
                     "speed": {"contexts": list(speed_ids), "decode_steps": s.speed_steps, "batch": 1},
                     "matched_ratio": ratio, "backend": s.backend,
                     "palu_calibration_tokens": (calibrated["palu"].calibration_tokens
                                                 if "palu" in calibrated else 0)},
        "skipped": skipped,
        "methods": [rows[m.key] for m in everything],
    }
    report["summary"] = summarise(report)
    report["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    return report
