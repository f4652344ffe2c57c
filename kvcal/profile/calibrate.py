"""`kvcal calibrate`: random-token pass -> calibration-text pass -> rotations, bases, ranks -> bundle.

Each pass (kvcal.profile.passes) streams Gram statistics (kvcal.profile.capture) and checkpoints them after every
window into `<out>.ckpt/`, keyed by everything that determines them; a rerun with the same settings resumes where the
last one stopped, and a finished run deletes its checkpoints. The bundle is written atomically.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcal.data import load_corpus, position_offsets, random_token_windows, token_windows
from kvcal.data.corpora import check_enough_tokens
from kvcal.eval import QualityTarget
from kvcal.models import (
    DEFAULT_MODEL,
    DTYPES,
    LoadedModel,
    adapter_for,
    fingerprint,
    load_model,
    load_tokenizer,
    read_config,
    resolve_dtype,
    resolve_model,
    tokenizer_hash,
    weights_hash,
)
from kvcal.profile.capture import CollectorSet, GramCollector
from kvcal.profile.checkpoint import Checkpoint
from kvcal.profile.choose import _brief, choose_settings
from kvcal.profile.fastgen_stats import FastGenStatsCollector
from kvcal.profile.key_ranges import (
    DEFAULT_PERCENTILE,
    DEFAULT_WINDOWS,
    spread_windows,
    tail_rows,
)
from kvcal.profile.passes import FirstWindows, Progress, QueryKeyTap, key_range_pass, run_pass
from kvcal.profile.ranks import energy_kept, ranks_for
from kvcal.profile.report import report_paths
from kvcal.profile.reproducible import pass_threads, strict_blas
from kvcal.profile.rotation import (
    DEFAULT_QK_WEIGHTING,
    QK_WEIGHTINGS,
    eig_basis,
    qk_gram,
    token_independence,
    weight_svd_basis,
)
from kvcal.profile.smoothing import STRENGTH as SMOOTHING_STRENGTH
from kvcal.runtime.bundle import Bundle, ModelInfo, save_bundle
from kvcal.runtime.cache import torch_threads
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.files import remove_stale_temps, wait_for_test_barrier
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.policies.fastgen import token_classes
from kvcal.safe_paths import check_bundle_out

logger = logging.getLogger(__name__)

QK_SOURCES = ("random-tokens", "text", "both")
V_SOURCES = ("activations-text", "activations-random", "weight-svd")


@dataclass
class CalibrationConfig:
    model: str = DEFAULT_MODEL
    out: Path | None = None             # default: ./<model name>.kvcal.safetensors
    seed: int = 0
    random_tokens: int = 8192           # FDC §5.1: at least 8K random tokens for a stable R
    text_tokens: int = 8192             # calibration text, same count as the random pass (FDC Table 2 protocol)
    seq_len: int = 1024                 # tokens per window; windows are spread over positions (see data/random_tokens)
    max_position: int | None = None     # windows cover [0, max_position); default min(model max, 32768)
    dataset: str = "default"            # packaged corpus name(s) or a .txt/.jsonl file or folder
    removal_rate: float = 0.0           # FDC Eq. 1 for every head, without the search; 0 keeps every dimension
    qk_source: str = "both"             # random tokens + text: best measured logit error (docs/calibration.md)
    qk_weighting: str = DEFAULT_QK_WEIGHTING
    v_source: str = "activations-text"  # measured better than weight-svd (docs/calibration.md)
    dtype: str = "auto"                 # of the statistics passes; auto: bf16 where computed natively (resolve_dtype)
    device_map: str | None = None
    max_memory: dict | None = None
    command: str | None = None          # the command line, recorded in the report
    search: bool = True                 # False: statistics only (full ranks, the runtime's default settings)
    target_top1: float = QualityTarget.top1          # quality target of the searches (see QualityTarget)
    target_ppl_ratio: float = QualityTarget.ppl_ratio
    target_z: float = QualityTarget.z
    target_predictions: int = QualityTarget.held_out_predictions     # the held-out evaluation's size (QualityTarget)
    context: int | None = None          # deployment context the search measures at; default min(4096, model max)
    search_windows: int = 4             # windows of held-out calibration text per measured point (docs/calibration.md)
    search_prompt: int | None = None    # prompt tokens per window; default context - search_steps - 1
    search_dtype: str = "float32"       # of every measured continuation (prompts prefill in the loaded dtype): a bf16
                                        # continuation's rounding would be charged to compression (docs/calibration.md)
    search_steps: int = 256             # teacher-forced continuation per window (windows x steps predictions): long
                                        # enough that Algorithm 1's downgrades during decode are represented
    eval_windows: int = 4               # final, stepwise check of the chosen configuration on evaluation text
    eval_steps: int | None = None       # scored continuation tokens per evaluation window; default search_steps
    max_probes: int = 6                 # decode probes on search text that set the budget (a bisection)
    step_probes: int = 8                # the hull's next moves past the bisection's point, each measured alone
    max_checks: int = 3                 # checks on evaluation text (stepping the budget back), before giving up
    max_gauges: int = 4                 # coded probes on evaluation text that a point passes before its check
    accept_best: bool = False           # no checked point meets the target: keep the best one anyway (exit 0)
    window: int | None = None           # recent tokens always at 16 bits; default: the allocation's (allocate.WINDOW)
    fastgen_windows: int = 2            # calibration windows profiled for FastGen statistics
    key_percentile: float = DEFAULT_PERCENTILE   # static key ranges clip each tail at 100 - this percent
    key_range_windows: int = DEFAULT_WINDOWS     # calibration windows of the static key range pass
    overwrite: bool = False             # replace an existing bundle (and its report) at `out`

    def __post_init__(self):
        if self.qk_source not in QK_SOURCES:
            raise ValueError(f"`--qk-source {self.qk_source}` is not one of {', '.join(QK_SOURCES)}")
        if self.v_source not in V_SOURCES:
            raise ValueError(f"`--v-source {self.v_source}` is not one of {', '.join(V_SOURCES)}")
        if self.qk_weighting not in QK_WEIGHTINGS:
            raise ValueError(f"`--qk-weighting {self.qk_weighting}` is not one of {', '.join(QK_WEIGHTINGS)}")
        if not 0.0 <= self.removal_rate < 1.0:
            raise ValueError(f"`--removal-rate {self.removal_rate}` must be in [0, 1)")
        if self.seq_len < 2:
            raise ValueError(f"`--seq-len {self.seq_len}` must be at least 2")
        if self.max_position is not None and self.max_position < 2:
            raise ValueError(f"`--max-position {self.max_position}` must be at least 2")
        tail_rows(1, self.key_percentile)                                       # its range check
        for name in ("search_windows", "search_prompt", "search_steps", "eval_windows", "eval_steps",
                     "max_checks", "max_probes", "key_range_windows"):  # search_prompt None: derived from the context
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"`--{name.replace('_', '-')} {getattr(self, name)}` must be at least 1")
        if self.search and self.removal_rate > 0:
            raise ValueError(f"`--removal-rate {self.removal_rate}` fixes the ranks, but the search chooses them by "
                             "measured quality: add `--no-search` to use a fixed rate, or drop `--removal-rate`")
        if self.context is not None and self.context < 2:
            raise ValueError(f"`--context {self.context}` must be at least 2")
        if self.search_dtype not in DTYPES:
            raise ValueError(f"`search_dtype={self.search_dtype}` is not one of {', '.join(DTYPES)}")
        if not (0 < self.target_top1 <= 1 and 1 <= self.target_ppl_ratio < math.inf):     # NaN fails every test
            raise ValueError(f"quality target needs 0 < top-1 <= 1 and perplexity ratio >= 1 (got "
                             f"{self.target_top1}, {self.target_ppl_ratio})")
        if self.step_probes < 0:
            raise ValueError(f"`--step-probes {self.step_probes}` must be at least 0 (0: the bisection's point alone)")
        if self.max_gauges < 0:
            raise ValueError(f"`--max-gauges {self.max_gauges}` must be at least 0 (0: check without gauging)")
        if self.target_predictions < 0:
            raise ValueError(f"`--target-predictions {self.target_predictions}` must be at least 0 (0: the bound over "
                             f"every measured prediction), e.g. {QualityTarget.held_out_predictions}, the default")
        if not 0 <= self.target_z < math.inf:
            raise ValueError(f"`--target-z {self.target_z:g}` must be a finite number >= 0 (standard errors; 0: as "
                             f"measured), e.g. {QualityTarget.z:g}, the default")


@dataclass
class CalibrationResult:
    bundle: Bundle
    path: Path
    summary: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- passes


# (stage, label, point): a step of choosing the settings starts (point None) or ends (kvcal.profile.choose.Progress)
SearchProgress = Callable[[str, str, Any], None]


def _checkpoint_key(cfg: CalibrationConfig, model_fp: str, w_hash: str, extra: dict) -> str:
    relevant = {k: v for k, v in asdict(cfg).items() if k in ("seed", "random_tokens", "text_tokens", "seq_len",
                                                              "dataset", "dtype")}
    blob = json.dumps([relevant, model_fp, w_hash, extra], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- main


def search_shape(cfg: CalibrationConfig, max_positions: int) -> tuple[int, int]:
    """(prompt tokens per search window, the context it measures at): a window is prompt + continuation + 1 tokens
    long, the deployment context, by default min(4096, the model's maximum)."""
    if cfg.context is not None and cfg.context > max_positions:
        raise ValueError(f"`--context {cfg.context}` is beyond the model's {max_positions} positions; pass at most "
                         f"{max_positions}")
    context = cfg.context or min(4096, max_positions)
    prompt = cfg.search_prompt or context - max(cfg.search_steps, cfg.eval_steps or 0) - 1
    if prompt < 1:
        raise ValueError(f"`--context {context}` leaves no prompt before {cfg.search_steps} continuation tokens; "
                         "raise `--context` or lower `--search-steps`")
    return prompt, prompt + cfg.search_steps + 1


def _normalised(g: torch.Tensor) -> torch.Tensor:
    return g / torch.diagonal(g, dim1=-2, dim2=-1).sum(-1)[..., None, None].clamp(min=1e-300)


def _check_inputs(cfg: CalibrationConfig, lm: LoadedModel | None):
    """Everything that can be wrong with the output path, the dataset or the options fails here, in about a second,
    before the model's weights are read and long before any pass runs. Returns (out, calibration corpus, search
    prompt tokens, max position, window length, calibration text windows [n, seq_len])."""
    source = lm.source if lm is not None else resolve_model(cfg.model)
    out = Path(cfg.out) if cfg.out else Path(f"{source.name}.kvcal.safetensors")
    dataset_path = Path(cfg.dataset).expanduser()
    inputs = [source.folder, *([source.origin] if Path(source.origin).exists() else []),
              *([dataset_path] if dataset_path.exists() else [])]
    check_bundle_out(out, overwrite=cfg.overwrite, inputs=inputs,
                     also_written=report_paths(out).values() if cfg.search else ())
    Checkpoint.check_folder(out.with_name(out.name + ".ckpt"))
    remove_stale_temps(out)
    corpus = load_corpus(cfg.dataset, "calib")      # the dataset's files: readable, decodable, with text
    splits = {name: load_corpus(cfg.dataset, name) for name in ("search", "eval")} if cfg.search else {}
    fixes = {"calib": "lower `--text-tokens`", "search": "lower `--context`, `--search-windows` or "
             "`--search-steps`", "eval": "lower `--context`"}
    a = lm.adapter if lm is not None else adapter_for(read_config(source.folder))
    if cfg.seq_len > a.max_positions and cfg.seq_len != CalibrationConfig.seq_len:   # the default is cut to fit
        raise ValueError(f"`--seq-len {cfg.seq_len}` is beyond the model's {a.max_positions} positions "
                         f"(max_position_embeddings in its config.json); pass `--seq-len {a.max_positions}` or less")
    P, _ = search_shape(cfg, a.max_positions) if cfg.search else (0, 0)
    needs = {"calib": cfg.text_tokens, "search": cfg.search_windows * (P + cfg.search_steps + 1),
             "eval": cfg.eval_windows * (P + (cfg.eval_steps or cfg.search_steps) + 1)}
    for name, c in {"calib": corpus, **splits}.items():       # a quick count first, before transformers loads
        check_enough_tokens(Path(source.folder) / "tokenizer.json", c, needs[name], fixes[name])
    tokenizer = lm.tokenizer if lm is not None else load_tokenizer(source.folder)
    if cfg.max_position is not None and cfg.max_position > a.max_positions:
        raise ValueError(f"`--max-position {cfg.max_position}` is beyond the model's {a.max_positions} positions; "
                         f"pass at most {a.max_positions}")
    max_position = cfg.max_position or min(a.max_positions, 32768)
    seq_len = min(cfg.seq_len, max_position)
    if cfg.random_tokens < seq_len or cfg.text_tokens < seq_len:      # here, as the window is known only now
        raise ValueError(f"`--random-tokens` and `--text-tokens` must be at least one window ({seq_len} tokens); "
                         "raise them or lower `--seq-len`")
    n_text = -(-cfg.text_tokens // seq_len)
    text_ids = token_windows(tokenizer, corpus, n_text, seq_len, cfg.seed, fix=fixes["calib"])
    if cfg.search:       # the search and the held-out check need their own splits: check them now too
        token_windows(tokenizer, splits["search"], cfg.search_windows, P + cfg.search_steps + 1, cfg.seed + 1,
                      fix=fixes["search"])
        token_windows(tokenizer, splits["eval"], cfg.eval_windows, P + (cfg.eval_steps or cfg.search_steps) + 1,
                      cfg.seed + 2, fix=fixes["eval"])
    return out, corpus, P, max_position, seq_len, text_ids


@dataclass
class Passes:
    """What the statistics passes give the bundle: token windows, their offsets and the collectors' results."""

    random_ids: torch.Tensor            # [n, seq_len]
    text_ids: torch.Tensor              # [n, seq_len]
    random_offsets: list[int]
    text_offsets: list[int]
    random_stats: GramCollector
    text_stats: GramCollector
    fastgen_stats: FastGenStatsCollector
    seconds: float
    key_windows: list[int]              # text windows of the key-range statistics (spread_windows)
    key_captured: list[dict] | None     # their queries and keys, from the text pass (QueryKeyTap.captured)
    threads: int                        # the passes' thread count (reproducible.pass_threads)


def run_passes(cfg: CalibrationConfig, lm: LoadedModel, text_ids: torch.Tensor, seq_len: int, max_position: int,
               checkpoint: Checkpoint, progress: Progress | None) -> Passes:
    """The random-token pass and the calibration-text pass, whose first windows also give the FastGen statistics
    (module docstring), at one thread where the model's products would give other bits at the thread count asked for
    (`reproducible.pass_threads`)."""
    t = time.perf_counter()
    threads = pass_threads(lm.model, seq_len)
    with torch_threads(threads):
        return _passes(cfg, lm, text_ids, seq_len, max_position, checkpoint, progress, t, threads)


def _passes(cfg: CalibrationConfig, lm: LoadedModel, text_ids: torch.Tensor, seq_len: int, max_position: int,
            checkpoint: Checkpoint, progress: Progress | None, t: float, threads: int) -> Passes:
    a = lm.adapter
    random_ids = random_token_windows(lm.tokenizer, lm.model.config.vocab_size, cfg.random_tokens, seq_len, cfg.seed)
    # both passes see the same positions, so their rotations differ only by what the tokens are
    random_offsets = position_offsets(len(random_ids), seq_len, max_position)
    text_offsets = position_offsets(len(text_ids), seq_len, max_position)
    random_stats = run_pass(lm, "random-tokens", random_ids, random_offsets, GramCollector(a), checkpoint, progress)
    # the text pass keeps the key-range windows' queries and keys: those statistics need the rotation it helps make
    key_windows = spread_windows(len(text_ids), cfg.key_range_windows)
    tap = QueryKeyTap(key_windows)
    # and its first windows give the FastGen statistics, which need whole attention maps (`FirstWindows`)
    text = CollectorSet(grams=GramCollector(a), fastgen=FirstWindows(
        FastGenStatsCollector(a, *token_classes(lm.tokenizer)), cfg.fastgen_windows))
    run_pass(lm, "calibration-text", text_ids, text_offsets, text, checkpoint, progress, tap)
    text_stats, fastgen_stats = text.named["grams"], text.named["fastgen"].collector
    return Passes(random_ids, text_ids, random_offsets, text_offsets, random_stats, text_stats, fastgen_stats,
                  time.perf_counter() - t, key_windows, tap.captured(key_windows), threads)


def make_bundle(cfg: CalibrationConfig, lm: LoadedModel, passes: Passes, corpus, max_position: int,
                checkpoint: Checkpoint, progress: Progress | None, say: Callable[[str], None]) -> Bundle:
    """The bundle of the passes' statistics: rotations, bases, ranks at `cfg.removal_rate`, static key ranges and
    smoothing (after the eigendecomposition, from the text pass's captured windows), FastGen statistics, the
    unsearched settings."""
    a, text_ids, text_offsets = lm.adapter, passes.text_ids, passes.text_offsets
    say("eigendecomposing Gram matrices")
    (rotation, qk_spectrum), (v_basis, v_spectrum), independence = _bases(cfg, lm, passes.random_stats,
                                                                          passes.text_stats)
    picked = passes.key_windows
    key_ids = text_ids[picked]
    key_range_key = checkpoint.key + json.dumps([cfg.qk_source, cfg.qk_weighting, cfg.key_percentile, picked,
                                                 "query-absmax"])
    key_checkpoint = Checkpoint(checkpoint.folder, hashlib.sha256(key_range_key.encode()).hexdigest()[:16])
    with torch_threads(passes.threads):             # where it runs a pass of its own
        range_low, range_high, smoothing = key_range_pass(lm, rotation.float(), key_ids,
                                                          [text_offsets[i] for i in picked], cfg.key_percentile,
                                                          key_checkpoint, progress, passes.key_captured)
    passes.key_captured = None                      # hundreds of MB of queries
    checkpoint.resumed.update(key_checkpoint.resumed)
    unsearched = CompressionConfig().with_tiering(window=cfg.window or TieringConfig.window)
    calibration = {
        "seed": cfg.seed,
        "random_tokens": int(passes.random_ids.numel()),
        "random_windows": len(passes.random_ids),
        "text_tokens": int(text_ids.numel()),
        "text_windows": len(text_ids),
        "seq_len": int(text_ids.shape[1]),
        "positions": {"max_position": max_position, "random_offsets": passes.random_offsets,
                      "text_offsets": text_offsets},
        "random_ids_sha256": hashlib.sha256(passes.random_ids.numpy().tobytes()).hexdigest(),
        "dataset": {"spec": cfg.dataset, "name": corpus.name, "documents": len(corpus), "sha256": corpus.sha256,
                    "windows_sha256": hashlib.sha256(text_ids.numpy().tobytes()).hexdigest()},
        "removal_rate": cfg.removal_rate,
        "dtype": resolve_dtype(cfg.dtype),
        "token_independence": independence,
        "key_ranges": {"percentile": cfg.key_percentile, "windows": len(key_ids), "rows": int(key_ids.numel()),
                       "tail_rows": tail_rows(int(key_ids.numel()), cfg.key_percentile),
                       "basis": "columns of qk.rotation, post-RoPE, no mixing",
                       "text_offsets": [text_offsets[i] for i in picked]},
        "smoothing": {"strength": SMOOTHING_STRENGTH, "windows": len(key_ids),
                      "basis": "columns of qk.rotation, post-RoPE, no mixing; max over the group's query heads"},
    }
    fastgen = passes.fastgen_stats
    return Bundle(
        model=ModelInfo(name=lm.name, fingerprint=fingerprint(lm.model.config), weights_hash=weights_hash(lm.model, a),
                        tokenizer_hash=tokenizer_hash(lm.tokenizer), family=a.family, num_layers=a.num_layers,
                        num_kv_heads=a.num_kv_heads, num_q_heads=a.num_q_heads, head_dim=a.head_dim,
                        layer_types=list(a.layer_types)),
        qk_rotation=rotation.float(), qk_spectrum=qk_spectrum.float(), qk_rank=ranks_for(qk_spectrum, cfg.removal_rate),
        v_basis=v_basis.float(), v_spectrum=v_spectrum.float(),
        v_rank=ranks_for(v_spectrum, cfg.removal_rate, unsearched.value_group),
        qk_source=cfg.qk_source, qk_weighting=cfg.qk_weighting, v_source=cfg.v_source,
        calibration=calibration,
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        extras={"k.absmax": passes.text_stats.k_absmax.clone(), "v.absmax": passes.text_stats.v_absmax.clone(),
                "fastgen.recovery": fastgen.recovery.float().nan_to_num(-1.0),
                "fastgen.kept_fraction": fastgen.kept_fraction.float().nan_to_num(-1.0),
                "k.range_low": range_low, "k.range_high": range_high, "qk.smoothing": smoothing},
        settings=unsearched.to_dict(searched=False),
    )


def summarize(cfg: CalibrationConfig, lm: LoadedModel, bundle: Bundle, out: Path, passes: Passes, report: dict | None,
              seconds: dict[str, float], resumed: dict) -> dict[str, Any]:
    """The run's summary (what `--json` prints); `seconds`: wall, search. Also records the timings in the bundle."""
    d = lm.adapter.head_dim
    summary = {
        "bundle": str(out),
        "model": lm.name,
        "wall_seconds": round(seconds["wall"], 2),
        "load_seconds": round(lm.load_seconds, 2),
        "pass_seconds": round(passes.seconds, 2),
        "pass_threads": passes.threads,
        "search_seconds": round(seconds["search"], 2),
        "tokens": {"random": int(passes.random_ids.numel()), "text": int(passes.text_ids.numel())},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "ranks": {"qk": _histogram(bundle.qk_rank, d), "v": _histogram(bundle.v_rank, d)},
        "energy_kept": {"qk": energy_kept(bundle.qk_spectrum, bundle.qk_rank).mean().item(),
                        "v": energy_kept(bundle.v_spectrum, bundle.v_rank).mean().item()},
        "token_independence": bundle.calibration["token_independence"],
        "policy": bundle.settings,
        "resumed": resumed,
    }
    if report is not None:
        summary["search"] = {"chosen": report["search"]["chosen"], "held_out": _brief(report["held_out"]),
                             "points": len(report["search"]["path"]), "context": report["search"]["probe"]["context"],
                             "decision": report["search"]["decision"], "seconds": report["search"]["seconds"]}
    bundle.calibration["summary"] = {k: summary[k] for k in ("wall_seconds", "load_seconds", "pass_seconds",
                                                             "search_seconds", "peak_rss_mib")}
    return summary


def calibrate(cfg: CalibrationConfig, *, lm: LoadedModel | None = None, progress: Progress | None = None,
              status: Callable[[str], None] | None = None,
              search_progress: SearchProgress | None = None) -> CalibrationResult:
    """Run the passes and write the bundle: check inputs -> load -> passes -> bundle -> choose the settings (quality
    model, allocation, budget, confirmation: kvcal.profile.choose) -> save. `lm` skips loading (tests, notebooks);
    `progress`/`status`/`search_progress` report."""
    t0 = time.perf_counter()
    blas = strict_blas()                    # before any matrix product: MKL fixes its mode at its first call
    say = status or (lambda msg: logger.info("%s", msg))
    out, corpus, P, max_position, seq_len, text_ids = _check_inputs(cfg, lm)
    if lm is None:
        say(f"loading {cfg.model}")
        lm = load_model(cfg.model, dtype=resolve_dtype(cfg.dtype), device_map=cfg.device_map,
                        max_memory=cfg.max_memory)
    key = _checkpoint_key(cfg, fingerprint(lm.model.config), weights_hash(lm.model, lm.adapter),
                          {"corpus": corpus.sha256, "max_position": max_position})
    checkpoint = Checkpoint(out.with_name(out.name + ".ckpt"), key)
    passes = run_passes(cfg, lm, text_ids, seq_len, max_position, checkpoint, progress)
    bundle = make_bundle(cfg, lm, passes, corpus, max_position, checkpoint, progress, say)
    bundle.calibration["blas"] = blas
    bundle.calibration["pass_threads"] = passes.threads
    report = None
    t_search = time.perf_counter()
    if cfg.search:
        search_key = key + json.dumps([cfg.search_windows, P, cfg.search_steps, cfg.window, cfg.search_dtype,
                                       str(lm.model.dtype), "coded-probe"])
        search_checkpoint = Checkpoint(checkpoint.folder, hashlib.sha256(search_key.encode()).hexdigest()[:16])
        report = choose_settings(lm, bundle, cfg, search_checkpoint, say, search_progress, prompt=P)
        checkpoint.resumed.update(search_checkpoint.resumed)
    seconds = {"search": time.perf_counter() - t_search, "wall": time.perf_counter() - t0}
    summary = summarize(cfg, lm, bundle, out, passes, report, seconds, checkpoint.resumed)
    wait_for_test_barrier()
    save_bundle(bundle, out, overwrite=cfg.overwrite)
    if report is not None:
        from kvcal.profile.report import write_report

        report.update(model=lm.name, bundle=str(out), created=bundle.created,
                      kvcal_version=_version(), command=cfg.command or "kvcal calibrate",
                      provenance={k: v for k, v in bundle.calibration.items() if k != "search"})
        summary["report"] = {k: str(v) for k, v in write_report(out, report, overwrite=cfg.overwrite).items()}
    checkpoint.clear()
    return CalibrationResult(bundle, out, summary)


def statistics_bundle(lm: LoadedModel, **options) -> Bundle:
    """The bundle of the statistics passes alone (`--no-search`), for code that needs a loaded model's rotations and
    bases (experiments, notebooks); its file goes to a temporary folder, removed after. `options`: CalibrationConfig
    fields."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg = CalibrationConfig(out=Path(tmp) / "b.kvcal.safetensors", search=False, **options)
        return calibrate(cfg, lm=lm).bundle


def _bases(cfg: CalibrationConfig, lm: LoadedModel, random_stats: GramCollector, text_stats: GramCollector):
    """((rotation, spectrum) of Q/K, (basis, spectrum) of V, token independence) from the passes' statistics, by
    `qk_source` and `v_source`."""
    r_random, s_random = eig_basis(qk_gram(random_stats, cfg.qk_weighting))
    r_text, s_text = eig_basis(qk_gram(text_stats, cfg.qk_weighting))
    if cfg.qk_source == "random-tokens":
        qk = r_random, s_random
    elif cfg.qk_source == "text":
        qk = r_text, s_text
    else:
        qk = eig_basis(_normalised(qk_gram(random_stats, cfg.qk_weighting))
                       + _normalised(qk_gram(text_stats, cfg.qk_weighting)))
    if cfg.v_source == "activations-text":
        v = eig_basis(text_stats.vv)
    elif cfg.v_source == "activations-random":
        v = eig_basis(random_stats.vv)
    else:
        v = weight_svd_basis(lm.model, lm.adapter)
    return qk, v, token_independence(r_random, r_text)


def _version() -> str:
    from kvcal import __version__

    return __version__


def _histogram(rank: torch.Tensor, d: int) -> dict[str, int]:
    """rank [L, H] -> {'<=d/4': n, '<=d/2': n, '<=3d/4': n, '<d': n, '=d': n}"""
    r = rank.flatten()
    edges = [(f"<={d // 4}", r <= d // 4), (f"<={d // 2}", (r > d // 4) & (r <= d // 2)),
             (f"<={3 * d // 4}", (r > d // 2) & (r <= 3 * d // 4)), (f"<{d}", (r > 3 * d // 4) & (r < d)),
             (f"={d}", r == d)]
    return {name: int(mask.sum()) for name, mask in edges}
