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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvcal.cli._options import JsonOpt, ModelOpt, QuietOpt, SeedOpt, fail, parse_max_memory, stderr, stdout
from kvcal.models import DEFAULT_MODEL
from kvcal.profile.calibrate import QK_SOURCES, V_SOURCES, CalibrationConfig
from kvcal.profile.rotation import DEFAULT_QK_WEIGHTING, QK_WEIGHTINGS


def calibrate(
    model: ModelOpt = DEFAULT_MODEL,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Bundle path (default ./<model>.kvcal.safetensors).")]
    = None,
    seed: SeedOpt = 0,
    random_tokens: Annotated[int, typer.Option(help="Random tokens for the rotation pass (FDC: >= 8192).")] = 8192,
    text_tokens: Annotated[int, typer.Option(help="Calibration-text tokens.")] = 8192,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = 1024,
    max_position: Annotated[int | None, typer.Option(help="Windows are spread over positions [0, this).")] = None,
    dataset: Annotated[str, typer.Option(help="Packaged corpus (default, sharegpt, gsm8k, champ, pydoc) or a "
                                              ".txt/.jsonl file or folder.")] = "default",
    removal_rate: Annotated[float, typer.Option(help="FDC Eq. 1 singular-value removal rate for every head; 0 keeps "
                                                   "all dims. Only with --no-search (the search chooses ranks).")]
    = 0.0,
    qk_source: Annotated[str, typer.Option(help=f"Pass the rotation comes from: {', '.join(QK_SOURCES)}.")]
    = "both",
    qk_weighting: Annotated[str, typer.Option(help=f"Q/K row weighting: {', '.join(QK_WEIGHTINGS)}.")]
    = DEFAULT_QK_WEIGHTING,
    v_source: Annotated[str, typer.Option(help=f"V basis: {', '.join(V_SOURCES)}.")] = "activations-text",
    dtype: Annotated[str, typer.Option(help="Model dtype: bfloat16, float32 or float16.")] = "bfloat16",
    device_map: Annotated[str | None, typer.Option(help="Passed to transformers (e.g. auto) for big models.")] = None,
    max_memory: Annotated[str | None, typer.Option(help="Per-device caps for device_map, e.g. cpu=2GiB.")] = None,
    search: Annotated[bool, typer.Option("--search/--no-search", help="Choose tiers and ranks by measured quality "
                                         "(writes a report); --no-search writes statistics only.")] = True,
    target_top1: Annotated[float, typer.Option(help="Quality target: top-1 agreement with dense.")] = 0.97,
    target_ppl_ratio: Annotated[float, typer.Option(help="Quality target: perplexity ratio to dense.")] = 1.02,
    target_z: Annotated[float, typer.Option(help="Top-1 must hold at this many standard errors (0: as measured).")]
    = 1.5,
    search_windows: Annotated[int, typer.Option(help="Held-out calibration windows per measured point.")] = 16,
    search_prompt: Annotated[int, typer.Option(help="Prompt tokens per search window.")] = 512,
    search_steps: Annotated[int, typer.Option(help="Teacher-forced steps per search window.")] = 32,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Random-token and calibration-text passes, quality searches (tiers, policies, ranks), then a validated bundle
    and its report."""
    from kvcal.profile.calibrate import calibrate as run

    try:
        cfg = CalibrationConfig(model=model, out=out, seed=seed, random_tokens=random_tokens, text_tokens=text_tokens,
                                seq_len=seq_len, max_position=max_position, dataset=dataset,
                                removal_rate=removal_rate, qk_source=qk_source, qk_weighting=qk_weighting,
                                v_source=v_source, dtype=dtype, device_map=device_map,
                                max_memory=parse_max_memory(max_memory), search=search, target_top1=target_top1,
                                target_ppl_ratio=target_ppl_ratio, target_z=target_z, search_windows=search_windows,
                                search_prompt=search_prompt, search_steps=search_steps,
                                command=" ".join(["kvcal", *sys.argv[1:]]))
        bars = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TextColumn("windows"),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=stderr,
                        disable=quiet, transient=False)
        tasks: dict[str, int] = {}

        def progress(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bars.add_task(name, total=total, completed=done)
            bars.update(tasks[name], completed=done)

        def status(msg: str) -> None:
            if not quiet:
                stderr.print(f"[dim]{msg}[/]")

        with bars:
            result = run(cfg, progress=progress, status=status)
    except KeyboardInterrupt:
        stderr.print("[yellow]interrupted[/]: finished windows are checkpointed; rerun the same command to resume")
        raise typer.Exit(code=130) from None
    except (ValueError, RuntimeError, OSError) as e:
        raise fail(str(e)) from None

    s = result.summary
    if json_out:
        print(json.dumps(s, indent=2))
        return
    t = Table(title=f"kvcal calibrate: {s['model']}", show_header=False)
    t.add_row("bundle", s["bundle"])
    t.add_row("wall time", f"{s['wall_seconds']:.1f} s (load {s['load_seconds']:.1f} s, passes "
                           f"{s['pass_seconds']:.1f} s, search {s['search_seconds']:.1f} s)")
    t.add_row("tokens", f"{s['tokens']['random']} random + {s['tokens']['text']} text")
    t.add_row("peak RSS", f"{s['peak_rss_mib']:.0f} MiB")
    for kind in ("qk", "v"):
        hist = "  ".join(f"{k}: {v}" for k, v in s["ranks"][kind].items())
        t.add_row(f"{kind} ranks (heads)", f"{hist}   energy kept {s['energy_kept'][kind]:.3f}")
    ti = s["token_independence"]
    t.add_row("token independence", f"δ̄/ε̄ = {ti['ratio']:.3%} (δ̄ {ti['delta']:.2e}, ε̄ {ti['epsilon']:.2e}); "
                                    f"subspace overlap d/2 {ti['overlap_half']:.3f}")
    if "search" in s:
        c = s["search"]["chosen"]
        t.add_row("chosen", f"{json.dumps(c['settings'], sort_keys=True)}")
        t.add_row("search windows", f"{c['bytes_ratio']:.3f} of fp16 bytes ({1 / c['bytes_ratio']:.2f}x), top-1 "
                                    f"{c['top1']:.3f}, ppl ratio {c['ppl_ratio']:.3f}")
        h = s["search"]["held_out"]
        t.add_row("held-out text", f"{h['bytes_ratio']:.3f} of fp16 bytes, top-1 {h['top1']:.3f}, ppl ratio "
                                   f"{h['ppl_ratio']:.3f} ({h['predictions']} predictions)")
        for name, p in s["search"]["families"].items():
            t.add_row(name, "none met the target" if p is None else f"{p['bytes_ratio']:.3f} of fp16 bytes "
                            f"({p['label']})")
        t.add_row("report", s["report"]["md"])
    stdout.print(t)
