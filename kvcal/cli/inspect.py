"""`kvcal inspect BUNDLE`: what a bundle stores and what it measured, its provenance, and its reduced ranks.

    kvcal inspect smollm2-135m.kvcal.safetensors
    kvcal inspect smollm2-135m.kvcal.safetensors --heads            # every layer and KV head
    kvcal inspect smollm2-135m.kvcal.safetensors --json | jq .heads[0]
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from kvcal.cli._console import stdout
from kvcal.cli._errors import terminal_safe
from kvcal.cli._options import BundleArg, JsonOpt, ThreadsOpt, fail
from kvcal.cli._suggest import resolve_bundle
from kvcal.cli._summary import bundle_summary, print_plain
from kvcal.cli._threads import use_threads
from kvcal.profile.ranks import energy_kept
from kvcal.runtime.bundle import Bundle, BundleError, load_bundle


def describe(bundle: Bundle) -> dict:
    """Everything `inspect` shows, as plain data."""
    L, H, d = bundle.shape
    qk_e = energy_kept(bundle.qk_spectrum, bundle.qk_rank)
    v_e = energy_kept(bundle.v_spectrum, bundle.v_rank)
    heads = [
        {"layer": layer, "kv_head": h, "layer_type": bundle.model.layer_types[layer],
         "qk_rank": int(bundle.qk_rank[layer, h]), "qk_energy_kept": round(float(qk_e[layer, h]), 5),
         "v_rank": int(bundle.v_rank[layer, h]), "v_energy_kept": round(float(v_e[layer, h]), 5)}
        for layer in range(L) for h in range(H)
    ]
    cal = dict(bundle.calibration)
    return {
        "model": bundle.model.__dict__,
        "kvcal_version": bundle.kvcal_version,
        "created": bundle.created,
        "qk_source": bundle.qk_source,
        "qk_weighting": bundle.qk_weighting,
        "v_source": bundle.v_source,
        "calibration": cal,
        "policy": bundle.settings,
        "kv_elements_kept": (bundle.qk_rank.sum() + bundle.v_rank.sum()).item() / (2 * L * H * d),
        "heads": heads,
    }


def inspect(
    bundle: BundleArg,
    model: Annotated[str | None, typer.Option("--model", "-m", metavar="MODEL",
                                              help="Also check the bundle against this model.")] = None,
    heads: Annotated[bool, typer.Option("--heads", help="List every layer and KV head, not only those whose ranks "
                                                        "are below the head dim.")] = False,
    json_out: JsonOpt = False,
    threads: ThreadsOpt = "auto",
) -> None:
    """Print what a bundle stores, its bytes per token and measured quality, its provenance, and its reduced ranks."""
    use_threads(threads)
    try:
        bundle = resolve_bundle(bundle)
        shape = config = None
        if model is not None:
            from kvcal.models import adapter_for, read_config, resolve_model

            config = read_config(resolve_model(model).folder)
            a = adapter_for(config)
            shape = (a.num_layers, a.num_kv_heads, a.head_dim)
        b = load_bundle(bundle, shape=shape)          # a bundle of another shape is refused before its tensors load
        if config is not None:
            from kvcal.models import fingerprint

            b.check_model(fingerprint(config), name=model, shape=shape)
    except (BundleError, ValueError, OSError) as e:
        raise fail(str(e)) from None
    info = describe(b)
    if json_out:
        print(json.dumps(info, indent=2, default=str))
        return
    # metadata is file content: show it as text, never as rich markup or terminal escape sequences
    b, info = terminal_safe(b), terminal_safe(info)
    print_plain(bundle_summary(b, terminal_safe(str(bundle))))
    d = b.model.head_dim
    rows = [r for r in info["heads"] if heads or r["qk_rank"] < d or r["v_rank"] < d]
    full = len(info["heads"]) - len(rows)
    if not rows:
        stdout.print(f"ranks: every layer and KV head keeps all {d} dims of K and V (--heads lists them)",
                     highlight=False)
        return
    stdout.print(f"KV elements kept: {info['kv_elements_kept']:.3f} of full rank", highlight=False)
    t = Table(title="per layer / KV head" + (f" ({full} more at full rank; --heads lists them)" if full else ""))
    for col in ("layer", "head", "type", "qk rank", "qk energy", "v rank", "v energy"):
        t.add_column(col, justify="right")
    for row in rows:
        t.add_row(str(row["layer"]), str(row["kv_head"]), row["layer_type"].replace("_attention", ""),
                  str(row["qk_rank"]), f"{row['qk_energy_kept']:.3f}", str(row["v_rank"]),
                  f"{row['v_energy_kept']:.3f}")
    print_plain(t)
