"""`kvcal bench`: kvcal against dense, quantization, eviction and low-rank baselines on one model, in one process.

    kvcal bench --bundle smollm2-135m.kvcal.safetensors --quick            # a few minutes on 2 CPU cores
    kvcal bench --model smollm2-135m --bundle b.kvcal.safetensors --out bench-smollm2 --json
    kvcal bench --bundle b.kvcal.safetensors --methods dense,kvcal,eviction --contexts 1024,4096
    kvcal bench --offload --quick                    # KVPR offloading only: OUT/offload.json, OUT/offload.md

Writes OUT/bench.json, OUT/bench.md, OUT/pareto.png and OUT/decode_time.png (kvcal.bench.report has the schema).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvcal.cli._console import stderr, stdout
from kvcal.cli._errors import checked, interrupted, plain
from kvcal.cli._options import (
    JsonOpt,
    ModelOpt,
    Output,
    QuietOpt,
    SeedOpt,
    ThreadsOpt,
    fail,
    from_options,
    option_values,
)
from kvcal.cli._suggest import resolve_bundle, shipped_bundle, shown_path
from kvcal.cli._threads import use_threads
from kvcal.models import DEFAULT_MODEL


class Backend(StrEnum):
    auto = "auto"
    torch = "torch"
    cpu = "cpu"
    cuda = "cuda"


def _ints(spec: str | None, name: str) -> tuple[int, ...] | None:
    if spec is None:
        return None
    try:
        return tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"`--{name} {spec}`: write comma-separated token counts, e.g. 1024,4096") from None


# `kvcal.bench.methods` builds the methods from a loaded model and bundle; the keys are spelled out here so that
# `--help` needs neither (tests/test_cli_ux.py checks this list against the methods a bench really builds)
METHOD_FAMILIES = ("dense", "quantization", "eviction", "low-rank", "seed", "kvcal")
METHOD_KEYS = ("dense", "hf-quanto-int4", "hf-quanto-int2", "hf-hqq-int4", "hf-fp8", "uniform-k8v8", "uniform-k4v4",
               "uniform-k2v2", "kivi-k8v4", "kivi-k4v4", "kivi-k4v2", "kivi-k2v2", "kvtuner-4bit", "kvtuner-3bit",
               "kvtuner-2.5bit", "turboquant-k4v4", "turboquant-k3v3", "turboquant-k4v2", "turboquant-k2v2",
               "turboquant-k2v2-w64", "kvquant-k4v4", "kvquant-k3v3", "kvquant-k2v2", "fdc-ranks", "diffkv-tiers",
               "fastgen", "kvcal-joint",
               "streamingllm", "h2o", "snapkv", "palu", "kvpress-snapkv", "kvpress-streamingllm",
               "kvpress-expected-attention", "kvpress-tova", "kvpress-knorm", "kvpress-adakv")
METHODS_HELP = (f"Comma-separated method keys or families to run; kvcal-joint always runs. Families: "
                f"{', '.join(METHOD_FAMILIES)}. Keys: {', '.join(METHOD_KEYS)}, and kvcal-aH-L for the threshold "
                "sweep.")


def bench(
    model: ModelOpt = DEFAULT_MODEL,
    bundle: Annotated[Path | None, typer.Option("--bundle", "-b", metavar="BUNDLE",
                                                help="The model's bundle (`kvcal calibrate`).  "
                                                     "[required unless --offload]")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output folder for the report and plots.",
                                             show_default="./bench-<model>")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Short run: 4 windows of 512 tokens, passkey and speed at "
                                        "1k only, a small sweep.")] = False,
    seed: SeedOpt = 0,
    backend: Annotated[Backend, typer.Option(help="kvcal attention backend.")] = Backend.auto,
    dtype: Annotated[str, typer.Option(help="Model dtype while measuring (float32: bf16 arithmetic alone flips "
                                            "about 2% of top-1).", metavar="DTYPE")] = "float32",
    dataset: Annotated[str, typer.Option(help="Corpus for held-out text (its eval split) and Palu's and "
                                              "KVQuant's calibration (calib split): packaged name or a .txt/.jsonl "
                                              "file or folder.",
                                         metavar="DATASET")]
    = "default",
    methods: Annotated[str | None, typer.Option(help=METHODS_HELP, metavar="KEYS", show_default="all")] = None,
    windows: Annotated[int | None, typer.Option(help="Held-out windows for quality.", show_default="8; 4 with --quick")]
    = None,
    prompt: Annotated[int | None, typer.Option(help="Prompt tokens per window.",
                                               show_default="1024; 512 with --quick")] = None,
    steps: Annotated[int | None, typer.Option(help="Teacher-forced steps per window.",
                                              show_default="64; 32 with --quick")] = None,
    contexts: Annotated[str | None, typer.Option(help="Speed: context lengths, comma-separated.", metavar="TOKENS",
                                                 show_default="1024,4096,16384; 1024 with --quick")] = None,
    passkey_lengths: Annotated[str | None, typer.Option(help="Passkey prompt lengths, comma-separated.",
                                                        metavar="TOKENS",
                                                        show_default="1024,4096,16384; 1024 with --quick")] = None,
    speed_steps: Annotated[int | None, typer.Option(help="Speed: decode steps averaged.",
                                                    show_default="16; 8 with --quick")] = None,
    target_top1: Annotated[float | None, typer.Option(help="Judge 'meets the target' at this top-1 instead of the "
                                                           "bundle's own target (e.g. a bundle calibrated with a "
                                                           "margin).", show_default="the bundle's")] = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    offload: Annotated[bool, typer.Option("--offload", help="Only the KVPR offloading section: modelled step time "
                                                            "at l = 0 / l* / full per layer, and a measured run "
                                                            "(writes OUT/offload.json and OUT/offload.md).")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the reports of an earlier bench in --out "
                                            "(a folder holding other files is refused).")] = False,
    threads: ThreadsOpt = "auto",
) -> None:
    """Compare kvcal with baselines on KV bytes, quality, passkey retrieval and CPU speed; write a report."""
    options = dict(locals())           # the parsed options by name, as typer converted them
    chosen_threads = use_threads(threads)
    files, output = from_options(BenchFiles, options), from_options(Output, options)
    if offload:
        return _offload(files, output, options)
    from kvcal.runtime.bundle import BundleError

    try:
        if bundle is None:
            raise ValueError(_needs_bundle(model))
        settings = _settings(options)
        settings.serve.resolve("cpu")       # a backend that cannot run fails before the model loads
        report, paths = _run(files, settings, output, chosen_threads)
    except KeyboardInterrupt as e:
        what, code = interrupted(e)
        stderr.print(f"[yellow]{what}[/]: nothing was written")
        raise typer.Exit(code=code) from None
    except (BundleError, ValueError, RuntimeError, OSError) as e:
        raise fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
    if output.json_out:
        print(json.dumps(report, indent=2, default=str))
        return
    _print_table(report)
    s = report["summary"]
    stdout.print(plain(s["verdict"]), highlight=False)
    if s["note"]:
        stdout.print(f"[yellow]where kvcal loses:[/] {plain(s['note'])}", highlight=False)
    stdout.print(f"threads {report['environment']['threads']}", highlight=False)
    stdout.print(f"report: {plain(str(paths['md']))} (JSON {paths['json'].name}, plots {paths['pareto_png'].name}, "
                 f"{paths['decode_png'].name})", highlight=False)


@dataclass(frozen=True)
class BenchFiles:
    """What `kvcal bench` loads and where it writes (the measuring options are `BenchSettings`)."""

    model: str = DEFAULT_MODEL
    bundle: Path | None = None          # required unless --offload
    out: Path | None = None             # report folder; None: ./bench-<model>
    dtype: str = "float32"              # the model's, while measuring
    overwrite: bool = False             # replace an earlier bench's reports in `out`


def _settings(options: dict):
    """`BenchSettings` from the parsed options: `--quick`'s presets under the options given, lists parsed."""
    from kvcal.bench import BenchSettings
    from kvcal.runtime.options import ServeOptions

    methods = options["methods"]
    derived = {"serve": ServeOptions(backend=options["backend"].value),
               "methods": tuple(x.strip() for x in methods.split(",") if x.strip()) if methods else None,
               "contexts": _ints(options["contexts"], "contexts"),
               "passkey_lengths": _ints(options["passkey_lengths"], "passkey-lengths"),
               "command": " ".join(["kvcal", *sys.argv[1:]])}
    return BenchSettings.preset(**{**option_values(BenchSettings, options), **derived})


def _run(files: BenchFiles, settings, output: Output, chosen_threads) -> tuple[dict, dict]:
    """Load the bundle and the model, run the bench with bars on stderr, write the report: (report, its paths)."""
    from kvcal.bench import run_bench, write_report
    from kvcal.models import load_model
    from kvcal.runtime.bundle import load_bundle

    bundle = resolve_bundle(files.bundle)
    out_dir = _check_out(files, offload=False)
    b = load_bundle(bundle)
    lm = load_model(files.model, dtype=files.dtype)
    bars = Progress(TextColumn("{task.description:<42}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=stderr, disable=output.quiet, transient=False)
    task = bars.add_task("loading", total=None)

    def progress(label: str, done: int, total: int) -> None:
        bars.update(task, description=label[:42], completed=done, total=total)

    def status(msg: str) -> None:
        if not output.quiet:
            bars.console.print(f"[dim]{plain(msg)}[/]", highlight=False)

    with bars:
        report = run_bench(lm, b, settings, bundle_path=bundle, progress=checked(progress), status=checked(status))
    report["environment"]["threads"] = str(chosen_threads)        # why this many (torch_threads: how many)
    return report, write_report(report, out_dir, overwrite=files.overwrite)


def _needs_bundle(model: str) -> str:
    """The error for a bench without `--bundle`: the model's existing bundle when there is one (the shipped one in
    `artifacts/`), since calibrating a new one takes tens of minutes."""
    found = shipped_bundle(model)
    if found is not None:
        return (f"`kvcal bench` needs `--bundle` (the model's bundle); add `--bundle {shown_path(found)}`, the "
                f"existing bundle of {model}, or create another with `kvcal calibrate --model {model}`")
    return f"`kvcal bench` needs `--bundle` (the model's bundle); create one with `kvcal calibrate --model {model}`"


def _check_out(files: BenchFiles, *, offload: bool) -> Path:
    """The report folder (default `./bench-<model>`), checked before the model loads (`check_report_folder`)."""
    from kvcal.bench.offload import OUTPUTS as OFFLOAD_OUTPUTS
    from kvcal.bench.report import output_paths
    from kvcal.models import resolve_model
    from kvcal.safe_paths import check_report_folder

    out_dir = files.out or Path(f"bench-{resolve_model(files.model).name}")
    bench = [p.name for p in output_paths(out_dir).values()]
    names, known = (OFFLOAD_OUTPUTS, bench) if offload else (bench, OFFLOAD_OUTPUTS)
    check_report_folder(out_dir, names, overwrite=files.overwrite, known=known)
    return out_dir


def _offload(files: BenchFiles, output: Output, options: dict) -> None:
    """`kvcal bench --offload` (kvcal.bench.offload): no bundle needed; with one, its compressed bytes are modelled.
    `options`: the parsed options, for `OffloadSettings` (--quick, --seed, --contexts)."""
    from kvcal.bench.offload import OffloadSettings, run_offload, to_markdown, write_offload_report
    from kvcal.models import load_model
    from kvcal.runtime.bundle import BundleError, load_bundle

    status = ((lambda msg: None) if output.quiet
              else (lambda msg: stderr.print(f"[dim]{plain(msg)}[/]", highlight=False)))
    try:
        bundle = resolve_bundle(files.bundle) if files.bundle is not None else None
        out_dir = _check_out(files, offload=True)
        b = load_bundle(bundle) if bundle is not None else None
        lm = load_model(files.model, dtype=files.dtype)
        settings = OffloadSettings.preset(options["quick"], **{**option_values(OffloadSettings, options),
                                                               "contexts": _ints(options["contexts"], "contexts")})
        report = run_offload(lm, settings, bundle=b, status=status)
        paths = write_offload_report(report, out_dir, overwrite=files.overwrite)
    except (BundleError, ValueError, RuntimeError, OSError) as e:
        raise fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
    if output.json_out:
        print(json.dumps(report, indent=2, default=str))
        return
    stdout.print(plain(to_markdown(report)), highlight=False, emoji=False, soft_wrap=True)   # it names the model
    stdout.print(f"report: {plain(str(paths['md']))} (JSON {paths['json'].name})", highlight=False)


def _print_table(r: dict) -> None:
    ctx = r["settings"]["speed"]["contexts"]
    t = Table(title=f"kvcal bench: {plain(r['model']['name'])} ({r['wall_seconds']:.0f} s)")
    t.add_column("method", no_wrap=True)
    for col in ("B/token", "of fp16", "KL", "top-1", "ppl ratio", "meets", "passkey"):
        t.add_column(col, justify="right")
    for c in ctx:
        t.add_column(f"decode ms @{c}", justify="right")
    for row in r["methods"]:
        if not row["available"]:
            t.add_row(row["name"], "[dim]unavailable[/]", *[""] * (6 + len(ctx)))
            continue
        if row["quality"] is None:
            continue
        q, m, pk = row["quality"], row["memory"], row["passkey"]
        speeds = {s["context"]: s for s in row["speed"]}
        style = "bold" if row["key"] == "kvcal-joint" else None
        t.add_row(row["name"], f"{m['bytes_per_token']:,.0f}", f"{m['ratio_to_fp16']:.3f}", f"{max(q['kl'], 0.0):.4f}",
                  f"{q['top1']:.3f}", f"{q['ppl_ratio']:.3f}", "yes" if q["meets_target"] else "no",
                  f"{pk['accuracy']:.2f}" if pk else "",
                  *[f"{speeds[c]['decode_ms_per_step']:.1f}" if c in speeds else "" for c in ctx], style=style)
    # piped output has no terminal width: do not squeeze the table into 80 columns
    (stdout if stdout.is_terminal else Console(width=200)).print(t)
    for s in r["skipped"]:
        stdout.print(f"[dim]skipped {s['what']} at {s['length']}: {plain(s['reason'])}[/]", highlight=False)
