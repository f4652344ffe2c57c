"""`kvcal export BUNDLE`: write a bundle in forms other serving stacks read (docs/export.md).

    kvcal export smollm2-135m.kvcal.safetensors --format vllm-fp8 --model smollm2-135m --out fp8-scales
    kvcal export smollm2-135m.kvcal.safetensors --format vllm-fp8 --strategy head --with-weights --out smollm2-fp8kv
    kvcal export smollm2-135m.kvcal.safetensors --format manifest --out smollm2-manifest --json
    kvcal export smollm2-135m.kvcal.safetensors --format hf-lowrank-v --model smollm2-135m --out smollm2-lowrank-v
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Group
from rich.text import Text

from kvcal.cli._errors import plain
from kvcal.cli._options import BundleArg, JsonOpt, ThreadsOpt, fail, from_options
from kvcal.cli._suggest import resolve_bundle
from kvcal.cli._summary import key_value_table, print_plain
from kvcal.cli._threads import use_threads
from kvcal.export import DEFAULT_MARGIN, EXPORT_LIST


class ExportFormat(StrEnum):
    vllm_fp8 = "vllm-fp8"
    manifest = "manifest"
    hf_lowrank_v = "hf-lowrank-v"


class Strategy(StrEnum):
    tensor = "tensor"
    head = "head"


def _model_inputs(model: str | None) -> list[Path]:
    """The files a `--model` spec reads: its Hugging Face folder (and the .gguf it was converted from)."""
    if model is None:
        return []
    from kvcal.models import resolve_model

    source = resolve_model(model)
    return [source.folder, *([Path(source.origin)] if Path(source.origin).exists() else [])]


def export(
    bundle: BundleArg,
    fmt: Annotated[ExportFormat, typer.Option("--format", "-f", help="vllm-fp8: FP8 KV-cache scales for vLLM; "
                                                 "manifest: bases + page layout for custom runtimes; hf-lowrank-v: "
                                                 "V's rank truncation folded into a transformers checkpoint.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder (written atomically).")],
    model: Annotated[str | None, typer.Option("--model", "-m", metavar="MODEL",
                                              help="The bundle's model (packaged name, .gguf or HF folder); required "
                                                   "except for manifest, where it adds a check.")]
    = None,
    strategy: Annotated[Strategy, typer.Option(help="vllm-fp8: one scale per layer (tensor) or per KV head (head, "
                                               "vLLM's Flash Attention backend only).")] = Strategy.tensor,
    margin: Annotated[float, typer.Option(help="vllm-fp8: scale = margin * calibration max / 448.")] = DEFAULT_MARGIN,
    with_weights: Annotated[bool, typer.Option("--with-weights", help="vllm-fp8: write a complete model folder "
                                               "(weights hard-linked) that `vllm serve` loads as is.")] = False,
    dtype: Annotated[str, typer.Option(help="hf-lowrank-v: dtype to load and save the model in.", metavar="DTYPE")]
    = "bfloat16",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier export at --out (a folder "
                                            "holding other files is refused).")] = False,
    json_out: JsonOpt = False,
    threads: ThreadsOpt = "auto",
) -> None:
    """Export a bundle for vLLM (FP8 scales), for custom runtimes (manifest), or as a folded transformers checkpoint."""
    options = dict(locals())           # the parsed options by name, as typer converted them
    use_threads(threads)
    from kvcal.runtime.bundle import BundleError

    try:
        chosen = from_options(ExportOptions, options)
        b, result = _export(chosen)
    except (BundleError, ValueError, TypeError, OSError) as e:
        raise fail(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if json_out:
        print(json.dumps({"format": result.format, "out": str(result.out), "files": result.files,
                          "summary": result.summary}, indent=2, default=str))
        return
    _print_result(b, result)


@dataclass(frozen=True)
class ExportOptions:
    """What `kvcal export` writes, and how (the options named after the format apply to that format only)."""

    bundle: Path
    fmt: ExportFormat
    out: Path                               # written atomically
    model: str | None = None                # required except for manifest, where it adds a check
    strategy: Strategy = Strategy.tensor    # vllm-fp8
    margin: float = DEFAULT_MARGIN          # vllm-fp8
    with_weights: bool = False              # vllm-fp8
    dtype: str = "bfloat16"                 # hf-lowrank-v
    overwrite: bool = False                 # replace an earlier export at `out`


def _export(o: ExportOptions):
    """(the bundle, the export's result), after the checks that come before any model loads."""
    from kvcal.export import export_hf_lowrank_v, export_manifest, export_vllm_fp8
    from kvcal.runtime.bundle import load_bundle
    from kvcal.runtime.files import check_folder
    from kvcal.safe_paths import check_out_folder

    if o.model is None and o.fmt is not ExportFormat.manifest:
        raise ValueError(f"`--format {o.fmt.value}` needs `--model` (the model the bundle was calibrated for)")
    bundle = resolve_bundle(o.bundle)
    # before the model loads: `--out` may not be (or hold) the bundle, the model's folder, or the working directory,
    # nor a folder of files that no earlier export listed as its own
    check_out_folder(o.out, inputs=[bundle, *_model_inputs(o.model)])
    check_folder(o.out, overwrite=o.overwrite, listing=EXPORT_LIST)
    b = load_bundle(bundle)
    if o.fmt is ExportFormat.vllm_fp8:
        result = export_vllm_fp8(b, o.model, o.out, strategy=o.strategy.value, margin=o.margin,
                                 with_weights=o.with_weights, overwrite=o.overwrite)
    elif o.fmt is ExportFormat.manifest:
        result = export_manifest(b, o.out, model=o.model, overwrite=o.overwrite)
    else:
        result = export_hf_lowrank_v(b, o.model, o.out, dtype=o.dtype, overwrite=o.overwrite)
    return b, result


def _print_result(b, result) -> None:
    """The layout of `calibrate` and `inspect`: a head line, then names and values; names and paths come from files
    and the command line, so they are shown as plain text, never as markup."""
    head = Text.from_markup(f"[bold]kvcal export {result.format}[/bold]: {plain(b.model.name)}")
    t = key_value_table()

    def row(name: str, value: str) -> None:
        t.add_row(name, plain(value))

    row("out", str(result.out))
    row("files", ", ".join(result.files) if len(result.files) <= 8 else f"{len(result.files)} files")
    s = result.summary
    if result.format == "vllm-fp8":
        row("scheme", f"compressed-tensors kv_cache_scheme, strategy {s['strategy']}, margin {s['margin']}")
        row("k_scale", f"{s['k_scale_range'][0]:.3g} .. {s['k_scale_range'][1]:.3g}")
        row("v_scale", f"{s['v_scale_range'][0]:.3g} .. {s['v_scale_range'][1]:.3g}")
        row("use", f"vllm serve {result.out} --kv-cache-dtype fp8" if s["with_weights"] else
            "merge into the model folder (docs/export.md), then --kv-cache-dtype fp8")
    elif result.format == "manifest":
        c = s["config"]
        row("tiers", f"high {c['high']['name']}, low {c['low']['name']}, pages of {c['page_bytes']} B")
        row("compressed layers", str(s["compressed_layers"]))
    else:
        row("folded layers", ", ".join(map(str, s["folded_layers"])) or "none")
        row("use", f"AutoModelForCausalLM.from_pretrained('{result.out}')")
    print_plain(Group(head, t))
