"""`kvcal calibrate`: measure a model and write its bundle.

    kvcal calibrate            # smollm2-135m, 8192 random tokens -> ./smollm2-135m.kvcal.safetensors
    kvcal calibrate --model qwen2.5-coder-1.5b --out qwen.kvcal.safetensors
    kvcal calibrate --no-search --removal-rate 0.05    # statistics only, one fixed FDC removal rate
    kvcal calibrate --model ./my-hf-folder --dataset ./texts.jsonl --json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvcal.cli._console import stderr, stdout
from kvcal.cli._errors import checked, interrupted
from kvcal.cli._options import (
    JsonOpt,
    ModelOpt,
    Output,
    QuietOpt,
    SeedOpt,
    ThreadsOpt,
    check_device_map,
    fail,
    from_options,
    parse_max_memory,
)
from kvcal.cli._progress import CalibrateProgress
from kvcal.cli._summary import calibration_summary, fp16_bytes_per_token
from kvcal.cli._threads import use_threads
from kvcal.eval import QualityTarget
from kvcal.profile.calibrate import QK_SOURCES, V_SOURCES, CalibrationConfig
from kvcal.profile.choose import planned_steps
from kvcal.profile.report import held_out_met
from kvcal.profile.rotation import QK_WEIGHTINGS


def calibrate(
    model: ModelOpt = CalibrationConfig.model,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Bundle path; the report (.report.md, .json, .png) "
                                             "goes next to it.", show_default="./<model>.kvcal.safetensors")]
    = None,
    seed: SeedOpt = CalibrationConfig.seed,
    random_tokens: Annotated[int, typer.Option(help="Random tokens for the rotation pass (FDC: >= 8192).")]
    = CalibrationConfig.random_tokens,
    text_tokens: Annotated[int, typer.Option(help="Calibration-text tokens.")] = CalibrationConfig.text_tokens,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = CalibrationConfig.seq_len,
    max_position: Annotated[int | None, typer.Option(help="Windows are spread over positions 0 to this.",
                                                     show_default="the model's maximum, at most 32768")] = None,
    dataset: Annotated[str, typer.Option(help="Packaged corpus (default, sharegpt, gsm8k, champ, pydoc) or a "
                                              ".txt/.jsonl file or folder.", metavar="DATASET")]
    = CalibrationConfig.dataset,
    removal_rate: Annotated[float, typer.Option(help="FDC Eq. 1 singular-value removal rate for every head; 0 keeps "
                                                     "all dims. Only with --no-search (the search chooses ranks).")]
    = CalibrationConfig.removal_rate,
    qk_source: Annotated[str, typer.Option(help=f"Pass the rotation comes from: {', '.join(QK_SOURCES)}.",
                                           metavar="PASS")]
    = CalibrationConfig.qk_source,
    qk_weighting: Annotated[str, typer.Option(help=f"Q/K row weighting: {', '.join(QK_WEIGHTINGS)}.",
                                              metavar="WEIGHTING")]
    = CalibrationConfig.qk_weighting,
    v_source: Annotated[str, typer.Option(help=f"V basis: {', '.join(V_SOURCES)}.", metavar="SOURCE")]
    = CalibrationConfig.v_source,
    dtype: Annotated[str, typer.Option(help="Model dtype of the statistics passes: bfloat16, float32, float16, or "
                                        "auto (bfloat16 on a GPU or a CPU with bf16 arithmetic, else float32).",
                                        metavar="DTYPE")]
    = CalibrationConfig.dtype,
    device_map: Annotated[str | None, typer.Option(help="Passed to transformers (e.g. auto) for big models.",
                                                   metavar="MAP")] = None,
    max_memory: Annotated[str | None, typer.Option(help="Per-device caps for --device-map, e.g. cpu=2GiB.",
                                                   metavar="CAPS")] = None,
    search: Annotated[bool, typer.Option("--search/--no-search", help="Choose tiers and ranks by measured quality "
                                         "(writes a report); --no-search writes statistics only.")]
    = CalibrationConfig.search,
    target_top1: Annotated[float, typer.Option(help="Quality target: top-1 agreement with dense.")]
    = QualityTarget.top1,
    target_ppl_ratio: Annotated[float, typer.Option(help="Quality target: perplexity ratio to dense.")]
    = QualityTarget.ppl_ratio,
    target_z: Annotated[float, typer.Option(help="Top-1 must hold at this many standard errors (0: as measured).")]
    = QualityTarget.z,
    target_predictions: Annotated[int, typer.Option(help="Top-1's bound is taken over at most this many predictions, "
                                                    "as a held-out evaluation of that size would judge it (0: over "
                                                    "every measured one).")]
    = QualityTarget.held_out_predictions,
    context: Annotated[int | None, typer.Option(help="Deployment context the search measures at (prompt + "
                                                "continuation tokens per window).",
                                                show_default="min(4096, the model's maximum)")]
    = CalibrationConfig.context,
    search_windows: Annotated[int, typer.Option(help="Held-out calibration windows per measured point.")]
    = CalibrationConfig.search_windows,
    search_prompt: Annotated[int | None, typer.Option(help="Prompt tokens per search window.",
                                                      show_default="context - search steps - 1")]
    = CalibrationConfig.search_prompt,
    search_steps: Annotated[int, typer.Option(help="Scored continuation tokens per search window.")]
    = CalibrationConfig.search_steps,
    key_percentile: Annotated[float, typer.Option(help="Static key tiers (K4sV4): per-channel key ranges keep this "
                                                  "percentile of calibration values in each tail.")]
    = CalibrationConfig.key_percentile,
    max_probes: Annotated[int, typer.Option(help="Decode probes on search text that set the budget (a bisection of "
                                            "the predicted frontier).")] = CalibrationConfig.max_probes,
    step_probes: Annotated[int, typer.Option(help="Where one step of the frontier is too coarse for the bisection: "
                                             "this many of the moves past its point measured alone, then taken "
                                             "cheapest in measured loss per byte first (0: never).")]
    = CalibrationConfig.step_probes,
    max_checks: Annotated[int, typer.Option(help="Checks on evaluation text, stepping the budget back on a miss.")]
    = CalibrationConfig.max_checks,
    max_gauges: Annotated[int, typer.Option(help="Coded probes on evaluation text that a point must pass before it is "
                                            "checked stepwise (0: check at once).")] = CalibrationConfig.max_gauges,
    accept_best: Annotated[bool, typer.Option("--accept-best", help="If no point checked on evaluation text meets "
                                              "the target, keep the best one and exit 0.")]
    = CalibrationConfig.accept_best,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing bundle (and its report) at "
                                            "--out.")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    threads: ThreadsOpt = "auto",
) -> None:
    """Random-token and calibration-text passes, quality searches (tiers, policies, ranks), then a validated bundle
    and its report."""
    options = dict(locals())           # the parsed options by name, as typer converted them
    chosen_threads = use_threads(threads)
    output = from_options(Output, options)
    try:
        cfg = from_options(CalibrationConfig, options, device_map=check_device_map(device_map),
                           max_memory=parse_max_memory(max_memory, device_map),
                           command=" ".join(["kvcal", *sys.argv[1:]]))
        result = _run(cfg, output)
    except KeyboardInterrupt as e:
        what, code = interrupted(e)
        stderr.print(f"[yellow]{what}[/]: finished windows are checkpointed; rerun the same command to resume")
        raise typer.Exit(code=code) from None
    except (ValueError, RuntimeError, OSError) as e:
        raise fail(str(e)) from None
    _report(result, cfg, output, chosen_threads)


def _run(cfg: CalibrationConfig, output: Output):
    """`kvcal.profile.calibrate.calibrate(cfg)` with its progress on screen."""
    from kvcal.profile.calibrate import calibrate as run

    displays = CalibrateProgress(stderr, planned_steps(cfg), output.quiet)
    try:
        result = run(cfg, progress=checked(displays.progress), status=checked(displays.status),
                     search_progress=checked(displays.search_progress))
        displays.search.finish()
    finally:
        displays.stop()
    return result


def _report(result, cfg: CalibrationConfig, output: Output, chosen_threads) -> None:
    """The summary (a table, or JSON with `--json`); exit 3 when the search missed its target and `--accept-best` was
    not given."""
    s = result.summary
    s["threads"] = chosen_threads.to_dict()
    search = result.bundle.calibration.get("search")
    if search and s.get("search", {}).get("held_out"):
        s["search"]["held_out"]["met"] = held_out_met(search["held_out"], search["target"], at_bounds=True)
        s["search"]["bytes_per_token"] = round(search["chosen"]["bytes_ratio"] * fp16_bytes_per_token(result.bundle))
    missed = bool(search) and not search["decision"]["met"] and not cfg.accept_best
    if output.json_out:
        print(json.dumps(s, indent=2))
    else:
        stdout.print(calibration_summary(s, result.bundle))
    if missed:
        raise fail(f"no point checked on evaluation text meets the target; {result.path} holds the best one checked: "
                   "pass `--accept-best` to accept it, or relax `--target-top1` / `--target-ppl-ratio`", code=3)
