"""Run every method of `kvcal bench` on the same inputs, in one process: quality, passkey retrieval, speed.

Protocol, per method (all against the same dense model, same token ids):

* **Quality** on held-out text (`load_corpus(dataset, "eval")`, documents disjoint from calibration and search):
  `windows` windows of `prompt` prompt tokens, then `steps` teacher-forced decode steps through the method's cache
  (kvcal.eval). KL(dense || method), top-1 agreement with dense and the continuation-perplexity ratio over
  windows x steps predictions. The dense reference logits and, for methods on the kvcal store, the dense prefill are
  computed once (`DecodeProbe`); other caches run their own prefill. The method's memory is read from the cache at
  the end of this run (prompt + steps tokens): bytes per token = bytes held / (windows x (prompt + steps)).
* **Passkey**: greedy retrieval of a 5-digit key hidden in pydoc text at each depth, for each length
  (`kvcal.eval.passkey`; methods on the kvcal store replay one recorded prefill per prompt, `PasskeyProbe`,
  which gives the same answers as `generate` and saves a prefill per method).
* **Speed** at each context length C (batch 1, CPU): prefill tokens/s of one prefill of C tokens through a fresh
  cache, then `speed_steps` + 1 teacher-forced decode steps; decode ms/step is the mean over the last `speed_steps`
  (the first step warms up). Lengths past the model's window are skipped, and the report says so.

Calibrated baselines (Palu's whitening, KVQuant's key ranges and codebooks) are fitted on first use on windows of the
corpus's calib split, never on the eval split measured here.

Matched memory: kvcal joint is measured first; its bytes ratio on the quality run is the budget of the eviction and
Palu baselines (kvcal.bench.methods). Seeds: windows come from `seed`, passkeys from `seed` too; nothing else is
random (the runtime's mixing rotation is seeded by its rank).

Steps of `run_bench`, each a function below: `prepare` (checks, inputs), `build_catalogue` (the methods),
`quality_phase`, `passkey_phase`, `speed_phase` (each over all methods, sharing a `Tally` of rows and progress), then
`assemble_report`. What one method's measurement does is `kvcal.bench.measure`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcal.bench import kvquant as KQ
from kvcal.bench import methods as M
from kvcal.bench.inputs import Inputs, load_inputs
from kvcal.bench.kvtuner import kvtuner_methods, layer_sensitivity
from kvcal.bench.lowrank import palu_factors
from kvcal.bench.measure import PasskeyProbe, measure_quality, measure_speed
from kvcal.bench.method import Method
from kvcal.bench.report import SCHEMA_VERSION, summarise
from kvcal.bench.settings import BenchSettings
from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe, QualityTarget, passkey
from kvcal.models import LoadedModel, fingerprint, weights_hash
from kvcal.models.sources import file_sha256
from kvcal.runtime.backends.cpu.build import cpu_name
from kvcal.runtime.bundle import Bundle
from kvcal.runtime.policies.fastgen import FastGenConfig

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]     # (what is running, units done, units total)


# --------------------------------------------------------------------------------------------- provenance


def environment(backend_name: str) -> dict:
    import transformers

    from kvcal import __version__

    return {"kvcal": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu": cpu_name(), "cpu_count": os.cpu_count() or 0, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(), "attention_backend": backend_name,
            # `kvcal bench` replaces this with why it runs that many (`--threads`, kvcal.cli._threads)
            "threads": f"{torch.get_num_threads()} (the caller's torch setting)"}


def bundle_target(bundle: Bundle) -> tuple[QualityTarget, str]:
    """The quality target the bundle's search used (`QualityTarget()` when it records none) and where it came from:
    "bundle" or "default"."""
    recorded = (bundle.calibration.get("search") or {}).get("target")
    return (QualityTarget.from_dict(recorded), "bundle") if recorded else (QualityTarget(), "default")


# --------------------------------------------------------------------------------------------- step 1: checks


@dataclass
class Run:
    """What every step of one bench run reads: the model, the bundle, the settings, the inputs, the target."""

    lm: LoadedModel
    bundle: Bundle
    settings: BenchSettings
    say: Callable[[str], None]                      # a status line
    backend_name: str                               # the attention backend the kvcal caches get here
    target: QualityTarget
    target_source: str                              # "bundle", "default" or "command line"
    inputs: Inputs


def prepare(lm: LoadedModel, bundle: Bundle, s: BenchSettings, say: Callable[[str], None]) -> Run:
    """Check that the backend can run and the bundle is the model's (ValueError, one line), then load the inputs."""
    model, adapter = lm.model, lm.adapter
    backend = s.serve.resolve(str(next(model.parameters()).device))
    bundle.check_model(fingerprint(model.config), weights_hash(model, adapter),
                       shape=(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim))
    torch.manual_seed(s.seed)
    target, source = bundle_target(bundle)
    if s.target_top1 is not None:       # judged against another target than the bundle was searched for
        target, source = dataclasses.replace(target, top1=s.target_top1), "command line"
    inputs = load_inputs(lm.tokenizer, s, adapter.max_positions)
    return Run(lm, bundle, s, say, backend.name(), target, source, inputs)


# --------------------------------------------------------------------------------------------- step 2: methods


@dataclass
class Fits:
    """The calibrated baselines' fits, each computed on its first use (a baseline that is not run costs nothing), all
    on the same windows of the corpus's calib split."""

    run: Run
    done: dict = field(default_factory=dict)        # name -> fit, and "windows": the calibration windows

    def lazy(self, name: str, what: str, compute: Callable[[torch.Tensor], Any]) -> Callable[[], Any]:
        """A function returning `compute(calibration windows)`, computed on its first call only."""
        def get():
            if name not in self.done:
                s = self.run.settings
                self.run.say(f"{what} from {s.calib_windows} calibration windows")
                if "windows" not in self.done:
                    self.done["windows"] = token_windows(self.run.lm.tokenizer, load_corpus(s.dataset, "calib"),
                                                         s.calib_windows, s.prompt, s.seed + 5)
                self.done[name] = compute(self.done["windows"])
            return self.done[name]
        return get


@dataclass
class Catalogue:
    """Every method of the run. `everything` is the report's rows in order: `base`, the matched baselines built at a
    placeholder budget of 1.0 (rebuilt by `matched(ratio)` once kvcal joint's ratio is measured), `sweep`."""

    base: list[Method]
    sweep: list[Method]
    matched: Callable[[float], list[Method]]        # bytes ratio -> the eviction and low-rank baselines at it
    everything: list[Method]
    chosen: set[str]                                # keys `--methods` selects

    def base_method(self, key: str) -> Method:
        return next(m for m in self.base if m.key == key)

    def runnable(self, methods: list[Method]) -> list[Method]:
        return [m for m in methods if m.key in self.chosen and not m.unavailable]


def _check_wanted(wanted: tuple[str, ...] | None, everything: list[Method]) -> None:
    known = {x for m in everything for x in (m.key, m.family.lower(), m.series.lower())}
    unknown = [w for w in wanted or () if w.lower() not in known]
    if unknown:
        raise ValueError(f"`--methods`: unknown `{unknown[0]}`; choose among {', '.join(m.key for m in everything)}"
                         " or a family (dense, quantization, eviction, low-rank, seed, kvcal)")


def build_catalogue(run: Run) -> tuple[Catalogue, Fits]:
    """The methods `kvcal.bench.methods` and friends build for this model and bundle, checked against `--methods`."""
    model, adapter, s, bundle = run.lm.model, run.lm.adapter, run.settings, run.bundle
    fits = Fits(run)
    palu = fits.lazy("palu", "Palu: whitened SVD of W_K / W_V", lambda w: palu_factors(model, adapter, w))
    kvquant = fits.lazy("kvquant", "KVQuant: per-channel key ranges and nuq codebooks",
                        lambda w: KQ.kvquant_calibration(model, adapter, w, seed=s.seed))
    sensitivity = fits.lazy("kvtuner", "KVTuner-style: attention-error sensitivity",
                            lambda w: layer_sensitivity(model, adapter, w, M.KIVI_WINDOW, M.KIVI_GROUP))
    base = (M.cache_methods(model) + M.store_methods(bundle, s.serve)
            + KQ.kvquant_methods(model, adapter, kvquant, s.calib_windows, s.calib_windows * s.prompt)
            + kvtuner_methods(model, adapter, bundle, sensitivity, M.KIVI_WINDOW, M.KIVI_GROUP, s.serve))
    sweep = M.sweep_methods(bundle, next(m for m in base if m.key == "kvcal-joint"), s.quick)
    shortest_prompt = min([s.prompt, *run.inputs.passkey_lengths, *run.inputs.speed_ids])

    def matched(ratio: float) -> list[Method]:
        return M.matched_methods(model, adapter, ratio, palu, bundle, s.serve, shortest_prompt)

    everything = base + matched(1.0) + sweep
    _check_wanted(s.methods, everything)
    chosen = {m.key for m in M.select(everything, s.methods)}
    return Catalogue(base, sweep, matched, everything, chosen), fits


# --------------------------------------------------------------------------------------------- step 3: the phases


def _row(m: Method) -> dict:
    return {"key": m.key, "name": m.name, "family": m.family, "series": m.series, "description": m.description,
            "settings": m.settings, "available": not m.unavailable, "unavailable_reason": m.unavailable,
            "note": m.note, "memory": None, "quality": None, "passkey": None, "speed": [], "seconds": 0.0}


class Tally:
    """The report's method rows, the seconds spent on each method, and the progress count the phases share."""

    def __init__(self, methods: list[Method], total: int, progress: Progress | None):
        self.rows = {m.key: _row(m) for m in methods}
        self.seconds: dict[str, float] = {}
        self.done, self.total, self.progress = 0, total, progress

    def running(self, label: str) -> None:
        if self.progress:
            self.progress(label, self.done, self.total)

    def tick(self, label: str, units: int = 1) -> None:
        self.done += units
        self.running(label)

    def timed(self, method: Method, t0: float) -> None:
        self.seconds[method.key] = self.seconds.get(method.key, 0.0) + time.perf_counter() - t0


def _quality(run: Run, probe: DecodeProbe, method: Method, tally: Tally) -> None:
    tally.running(f"{method.name}: quality")
    t0 = time.perf_counter()
    row = tally.rows[method.key]
    row["quality"], row["memory"] = measure_quality(method, probe, run.lm.model, run.lm.tokenizer, run.target)
    tally.timed(method, t0)
    q, mem = row["quality"], row["memory"]
    run.say(f"  {method.name:28} {mem['ratio_to_fp16']:.3f} of fp16  top-1 {q['top1']:.3f}  KL {q['kl']:.4f}  "
            f"ppl {q['ppl_ratio']:.3f}  ({tally.seconds[method.key]:.0f} s)")
    tally.tick(f"{method.name}: quality")


def quality_phase(run: Run, catalogue: Catalogue, tally: Tally) -> tuple[float, list[Method]]:
    """Quality and memory on held-out text: dense, then kvcal joint, whose bytes ratio budgets the matched baselines,
    then every other method. Returns (that ratio, the methods the later phases run, in report order)."""
    s, windows = run.settings, run.inputs.windows
    tally.running("recording the dense prefill")
    run.say(f"recording the dense prefill of {s.windows} x {s.prompt} held-out tokens")
    probe = DecodeProbe(run.lm.model, run.bundle, windows[:, :s.prompt], windows[:, s.prompt:],
                        tokenizer=run.lm.tokenizer, fastgen=FastGenConfig())
    _quality(run, probe, catalogue.base_method("dense"), tally)
    _quality(run, probe, catalogue.base_method("kvcal-joint"), tally)
    ratio = tally.rows["kvcal-joint"]["memory"]["ratio_to_fp16"]
    matched = catalogue.matched(ratio)
    for m in matched:               # the rows were made from placeholders budgeted at 1.0: say the real budget
        tally.rows[m.key].update(description=m.description, settings=m.settings)
    runnable = catalogue.runnable(catalogue.base + matched + catalogue.sweep)
    for m in runnable:
        if tally.rows[m.key]["quality"] is None:
            _quality(run, probe, m, tally)
    return ratio, runnable          # the probe's recorded prefill is freed before the passkey prompts are recorded


def _store_passkeys(run: Run, store: list[Method], tally: Tally) -> dict[str, dict[str, bool]]:
    """Methods on the kvcal store: one recorded prefill per prompt, replayed into each (`PasskeyProbe`)."""
    s, lm = run.settings, run.lm
    hits: dict[str, dict[str, bool]] = {m.key: {} for m in store}
    for n, depth in run.inputs.cases:
        t0 = time.perf_counter()
        pk = PasskeyProbe(lm.model, run.bundle, lm.tokenizer, run.inputs.filler, n, depth, s.seed, FastGenConfig())
        share = (time.perf_counter() - t0) / max(len(store), 1)
        for m in store:
            tally.running(f"{m.name}: passkey {pk.case}")
            t0 = time.perf_counter()
            hits[m.key][pk.case] = pk.retrieved(m, s.passkey_tokens)
            tally.timed(m, t0 - share)
            tally.tick(f"{m.name}: passkey {pk.case}")
        del pk
    return hits


def _cache_passkeys(run: Run, others: list[Method], tally: Tally) -> dict[str, dict[str, bool]]:
    """Other caches: `passkey`, each prompt with its own prefill."""
    s, model, tok = run.settings, run.lm.model, run.lm.tokenizer
    hits = {}
    for m in others:
        tally.running(f"{m.name}: passkey")
        t0 = time.perf_counter()
        make = lambda m=m: m.make_cache(model, tok, reserve=s.passkey_tokens)   # noqa: E731
        hits[m.key] = passkey(model, tok, run.inputs.filler, run.inputs.passkey_lengths, list(s.passkey_depths), make,
                              seed=s.seed, new_tokens=s.passkey_tokens)["cases"]
        tally.timed(m, t0)
        tally.tick(f"{m.name}: passkey", len(run.inputs.cases))
    return hits


def passkey_phase(run: Run, runnable: list[Method], tally: Tally) -> None:
    """Greedy passkey retrieval of every method at each (length, depth) case."""
    cases = run.inputs.cases
    if not cases:
        return
    run.say(f"passkey: {len(cases)} prompts ({', '.join(f'{n}@{d:g}' for n, d in cases)})")
    hits = _store_passkeys(run, [m for m in runnable if m.replays], tally)
    hits.update(_cache_passkeys(run, [m for m in runnable if not m.replays], tally))
    for m in runnable:
        h = hits[m.key]
        tally.rows[m.key]["passkey"] = {"accuracy": sum(h.values()) / len(h), "cases": h}


def speed_phase(run: Run, runnable: list[Method], tally: Tally) -> None:
    """Prefill and decode speed of every method at each context length."""
    for m in runnable:
        for c, ids in run.inputs.speed_ids.items():
            tally.running(f"{m.name}: speed @ {c}")
            t0 = time.perf_counter()
            tally.rows[m.key]["speed"].append(measure_speed(m, run.lm.model, run.lm.tokenizer, ids, c,
                                                            run.settings.speed_steps))
            tally.timed(m, t0)
            tally.tick(f"{m.name}: speed @ {c}")


# --------------------------------------------------------------------------------------------- step 4: the report


def _model_block(lm: LoadedModel) -> dict:
    model, a = lm.model, lm.adapter
    return {"name": lm.name, "family": a.family, "fingerprint": fingerprint(model.config),
            "weights_hash": weights_hash(model, a), "dtype": str(model.dtype).removeprefix("torch."),
            "num_layers": a.num_layers, "num_kv_heads": a.num_kv_heads, "num_q_heads": a.num_q_heads,
            "head_dim": a.head_dim, "max_positions": a.max_positions,
            "fp16_bytes_per_token": sum(not a.is_sliding(i) for i in range(a.num_layers))
            * a.num_kv_heads * a.head_dim * 2 * 2}


def _bundle_block(run: Run, bundle_path: Path | None) -> dict:
    b = run.bundle
    return {"path": str(bundle_path) if bundle_path else None,
            "sha256": file_sha256(bundle_path) if bundle_path and Path(bundle_path).is_file() else None,
            "created": b.created, "kvcal_version": b.kvcal_version, "policy": b.settings,
            "target": {**asdict(run.target), "source": run.target_source}}


def _settings_block(run: Run, ratio: float, fits: Fits) -> dict:
    s, inputs = run.settings, run.inputs
    return {"quality": {"dataset": inputs.corpus.name, "dataset_sha256": inputs.corpus.sha256,
                        "windows": s.windows, "prompt": s.prompt, "steps": s.steps,
                        "windows_sha256": hashlib.sha256(inputs.windows.numpy().tobytes()).hexdigest()},
            "passkey": {"lengths": inputs.passkey_lengths, "depths": list(s.passkey_depths),
                        "new_tokens": s.passkey_tokens, "filler": "pydoc"},
            "speed": {"contexts": list(inputs.speed_ids), "decode_steps": s.speed_steps, "batch": 1},
            "matched_ratio": ratio, "backend": s.serve.backend,
            "palu_calibration_tokens": fits.done["palu"].calibration_tokens if "palu" in fits.done else 0}


def assemble_report(run: Run, catalogue: Catalogue, tally: Tally, fits: Fits, ratio: float,
                    bundle_path: Path | None) -> dict:
    """The report (kvcal.bench.report's schema) with its summary; `wall_seconds` is left for the caller."""
    for key, seconds in tally.seconds.items():
        tally.rows[key]["seconds"] = round(seconds, 2)
    s = run.settings
    report = {
        "schema_version": SCHEMA_VERSION,
        "kind": "kvcal-bench",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": s.command or "kvcal bench",
        "seed": s.seed,
        "quick": s.quick,
        "wall_seconds": 0.0,
        "model": _model_block(run.lm),
        "bundle": _bundle_block(run, bundle_path),
        "environment": environment(run.backend_name),
        "settings": _settings_block(run, ratio, fits),
        "skipped": run.inputs.skipped,
        "methods": [tally.rows[m.key] for m in catalogue.everything],
    }
    report["summary"] = summarise(report)
    return report


# --------------------------------------------------------------------------------------------- the run


def run_bench(lm: LoadedModel, bundle: Bundle, settings: BenchSettings, *, bundle_path: Path | None = None,
              progress: Progress | None = None, status: Callable[[str], None] | None = None) -> dict:
    """Measure every method and return the report (see kvcal.bench.report for its schema).

    Steps: check and load the inputs (`prepare`), build the methods (`build_catalogue`), then three phases over all
    methods on the same inputs (quality, passkey, speed) and the report (`assemble_report`)."""
    t_start = time.perf_counter()
    run = prepare(lm, bundle, settings, status or (lambda msg: logger.info("%s", msg)))
    catalogue, fits = build_catalogue(run)
    n_run = len(catalogue.runnable(catalogue.everything))
    tally = Tally(catalogue.everything, n_run * run.inputs.units, progress)
    ratio, runnable = quality_phase(run, catalogue, tally)
    passkey_phase(run, runnable, tally)
    speed_phase(run, runnable, tally)
    report = assemble_report(run, catalogue, tally, fits, ratio, bundle_path)
    report["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    return report
