"""`kvcal inspect BUNDLE`: provenance and per-layer/per-head ranks and energy kept.

    kvcal inspect smollm2-135m.kvcal.safetensors
    kvcal inspect smollm2-135m.kvcal.safetensors --json | jq .heads[0]
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from kvcal.bundle import Bundle, BundleError, load_bundle
from kvcal.cli._errors import terminal_safe
from kvcal.cli._options import BundleArg, JsonOpt, fail, stdout
from kvcal.profile.ranks import energy_kept


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
        "policy": bundle.policy,
        "kv_elements_kept": (bundle.qk_rank.sum() + bundle.v_rank.sum()).item() / (2 * L * H * d),
        "heads": heads,
    }


def inspect(
    bundle: BundleArg,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Also check the bundle against this model.")]
    = None,
    json_out: JsonOpt = False,
) -> None:
    """Print a bundle's provenance and its per-layer, per-head ranks."""
    try:
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
    cal = info["calibration"]
    prov = Table(title=f"bundle {bundle}", show_header=False)
    prov.add_row("model", f"{b.model.name} ({b.model.family}, {b.model.num_layers} layers, {b.model.num_kv_heads} KV "
                          f"heads, head dim {b.model.head_dim}); fingerprint {b.model.fingerprint}")
    prov.add_row("created", f"{b.created} by kvcal {b.kvcal_version}")
    prov.add_row("rotation", f"{b.qk_source}, weighting {b.qk_weighting}; V basis {b.v_source}")
    if cal:
        ds = cal.get("dataset", {})
        prov.add_row("calibration", f"seed {cal.get('seed')}, {cal.get('random_tokens')} random tokens, "
                                    f"{cal.get('text_tokens')} text tokens from {ds.get('name')} "
                                    f"(sha256 {str(ds.get('sha256'))[:12]}), windows of {cal.get('seq_len')}, "
                                    f"positions [0, {cal.get('positions', {}).get('max_position')})")
        prov.add_row("removal rate", str(cal.get("removal_rate")))
        ti = cal.get("token_independence")
        if ti:
            prov.add_row("token independence", f"δ̄/ε̄ {ti['ratio']:.3%}, subspace overlap d/2 {ti['overlap_half']:.3f}")
    prov.add_row("KV elements kept", f"{info['kv_elements_kept']:.3f} of full rank")
    stdout.print(prov)
    t = Table(title="per layer / KV head")
    for col in ("layer", "head", "type", "qk rank", "qk energy", "v rank", "v energy"):
        t.add_column(col, justify="right")
    for row in info["heads"]:
        t.add_row(str(row["layer"]), str(row["kv_head"]), row["layer_type"].replace("_attention", ""),
                  str(row["qk_rank"]), f"{row['qk_energy_kept']:.3f}", str(row["v_rank"]),
                  f"{row['v_energy_kept']:.3f}")
    stdout.print(t)
