"""The calibration report written next to a bundle: JSON (everything), Markdown (for people), PNG (quality vs bytes of
every configuration tried, the chosen one marked)."""

from __future__ import annotations

import json
from pathlib import Path

from kvcal.eval import QualityTarget, bound_in_words
from kvcal.runtime.policies.diffkv import EVERY_TOKEN_LOW

STAGE_COLORS = {"probe": "tab:blue", "step": "tab:purple", "gauge": "tab:orange", "confirm": "tab:green"}
STAGE_NAMES = {"probe": "budget probe, search text", "step": "one move alone, search text",
               "gauge": "gauge, evaluation text (coded)", "confirm": "check, evaluation text"}


def report_paths(bundle_path: Path) -> dict[str, Path]:
    stem = bundle_path.name.removesuffix(".safetensors")
    return {kind: bundle_path.with_name(f"{stem}.report.{kind}") for kind in ("json", "md", "png")}


# ---------------------------------------------------------------------------------------------- in words


def tier_in_words(spec: str) -> str:
    """'K8V4g16' -> '8-bit keys, 4-bit values with a scale per 16 channels'; 'K16V16' -> 'fp16 keys and values'."""
    from kvcal.runtime.storage.layout import TierFormat

    f = TierFormat.parse(spec)
    if f.k_bits >= 16 and f.v_bits >= 16:
        return f"fp{f.k_bits} keys and values"
    k = f"fp{f.k_bits}" if f.k_bits >= 16 else f"{f.k_bits}-bit"
    v = f"fp{f.v_bits}" if f.v_bits >= 16 else f"{f.v_bits}-bit"
    k_note = {"channel": " per channel", "static": " with calibrated per-channel scales"}.get(
        f.k_mode, f" with a scale per {f.k_group} channels" if f.k_group else "")
    v_note = f" with a scale per {f.v_group} channels" if f.v_group else ""
    return f"{k} keys{k_note}, {v} values{v_note}"


def _per_layer(where: str, layer_formats: tuple) -> list[str]:
    """((1, K4cV2), (3, K4cV2), (4, K2cV4)) -> ["K4cV2 in {where} 1, 3", "K2cV4 in {where} 4"]; (layer, KV head,
    format) triples name each as layer.head ("K4cV2 in {where} 1.0, 3.2")."""
    by_format: dict[str, list[str]] = {}
    for *at, fmt in layer_formats:
        by_format.setdefault(fmt.name, []).append(".".join(map(str, at)))
    return [f"{name} in {where} {', '.join(at)}" for name, at in by_format.items()]


def settings_in_words(settings: dict, *, head_dim: int | None = None, qk_rank_mean: float | None = None,
                      v_rank_mean: float | None = None) -> str:
    """What a search point (or a bundle's settings block) stores, in one sentence: tiers and thresholds, FastGen, ranks.
    `settings` is a settings block (`Bundle.settings`), read by its one codec (`CompressionConfig.from_dict`)."""
    from kvcal.runtime.config import CompressionConfig

    if "high" not in settings:        # `to_dict(searched=False)`: the block records the window only
        return "the runtime's default settings (the bundle was made without a search)"
    config = CompressionConfig.from_dict(settings)
    high, low, p = config.high.name, config.low.name, config.tiering
    if not p.tiered:
        parts = [f"every token as {high} ({tier_in_words(high)})"]
    else:
        kept = "" if p.alpha_high >= EVERY_TOKEN_LOW else f" and those with mean attention >= {p.alpha_high:g}/N"
        if config.exact_window:
            recent = f"the {p.window} newest tokens exact (16 bits, outside the pages)" + (
                f", {high} ({tier_in_words(high)}) for those with mean attention >= {p.alpha_high:g}/N" if kept else "")
        else:
            recent = f"{high} ({tier_in_words(high)}) for the {p.window} newest tokens{kept}"
        parts = [f"{recent}, {low} ({tier_in_words(low)}) for the others"]
        parts += _per_layer("the low tier of layers", config.low_layers)
        parts += _per_layer("the low tier of (layer.KV head)", config.low_heads)
        if config.page_tokens:
            parts.append(f"low-tier pages of {config.page_tokens} tokens")
        if p.alpha_low > 0:
            parts.append(f"tokens below {p.alpha_low:g}/N dropped")
    if config.sliding is not None:
        recent = f", the {config.sliding_recent} newest tokens at 16 bits" if config.sliding_recent else ""
        parts.append(f"sliding-window layers {config.sliding.name} ({tier_in_words(config.sliding.name)}){recent}")
    parts += _per_layer("sliding layers", config.sliding_layers)
    if config.smooth:
        parts.append("keys smoothed per rotated channel, the queries carrying the factors (bundle `qk.smoothing`)")
    if config.fastgen is not None:
        parts.append(f"FastGen per-head policies chosen at prefill (recovery {config.fastgen.recovery:g})")
    if head_dim is not None and qk_rank_mean is not None and v_rank_mean is not None:
        if qk_rank_mean >= head_dim and v_rank_mean >= head_dim:
            parts.append(f"K and V at full rank ({head_dim} dims)")
        else:
            parts.append(f"K keeps {qk_rank_mean:.1f} and V {v_rank_mean:.1f} of {head_dim} dims per head on average")
    elif config.qk_removal_rate or config.v_removal_rate:
        parts.append(f"ranks cut at FDC removal rates {config.qk_removal_rate:g} (K) and "
                     f"{config.v_removal_rate:g} (V)")
    else:
        parts.append("K and V at full rank")
    return "; ".join(parts)


def bytes_in_words(ratio: float, fp16_bytes_per_token: int) -> str:
    """0.484, 23040 -> '11,151 bytes per token against 23,040 in fp16: 0.484 of fp16, 2.06x compression'."""
    return (f"{ratio * fp16_bytes_per_token:,.0f} bytes per token against {fp16_bytes_per_token:,} in fp16: "
            f"{ratio:.3f} of fp16, {1 / ratio:.2f}x compression")


def held_out_met(held_out: dict, target: dict, at_bounds: bool = False) -> bool:
    """Whether a configuration meets the quality target on evaluation text: at the target's own bounds (`at_bounds`,
    `target["z"]`: what the calibration's confirmation and `kvcal bench` ask), or as measured (`QualityTarget.met`
    at z = 0: what bundles made before the quality model were decided by, still reported for them).
    held_out: {top1, ppl_ratio, predictions, top1_windows, ...}; target: {top1, ppl_ratio, z, held_out_predictions}
    (the report's JSON)."""
    rule = QualityTarget.from_dict(target)
    return (rule if at_bounds else rule.with_(z=0.0)).met(held_out)


def write_report(bundle_path: Path, report: dict, *, overwrite: bool = False) -> dict[str, Path]:
    """Write the report next to the bundle (`write_file`: never through a link, an existing file replaced only with
    `overwrite`); adds `held_out.met` (see `held_out_met`)."""
    from kvcal.runtime.files import write_file

    paths = report_paths(bundle_path)
    if report.get("held_out"):
        report["held_out"]["met"] = held_out_met(report["held_out"], report["search"]["target"], at_bounds=True)
    write_file(paths["json"], json.dumps(report, indent=2, default=str), overwrite=overwrite)
    write_file(paths["md"], _markdown(report, paths["png"].name), overwrite=overwrite)
    write_file(paths["png"], lambda tmp: _plot(report, tmp), overwrite=overwrite)
    return paths


def _fmt_point(p: dict) -> str:
    return (f"| {STAGE_NAMES.get(p['stage'], p['stage'])} | {p['label']} | {p['predicted_loss']:.4g} | "
            f"{p['bytes_ratio']:.3f} | {1 / p['bytes_ratio']:.2f}x | {p['top1']:.3f} | {p['ppl_ratio']:.3f} | "
            f"{p['kl']:.4f} | {'yes' if p['feasible'] else 'no'} |")


def _markdown(r: dict, png: str) -> str:
    s = r["search"]
    t = s["target"]
    lines = [
        f"# kvcal calibration report: {r['model']}",
        "",
        f"Bundle `{r['bundle']}`, created {r['created']} by kvcal {r['kvcal_version']}. "
        f"Command: `{r['command']}`.",
        "",
        f"Quality target: top-1 agreement >= {t['top1']} and continuation-perplexity ratio <= {t['ppl_ratio']} vs "
        f"dense, on {s['probe']['windows']} held-out calibration windows of "
        f"{s['probe']['prompt']} prompt tokens + {s['probe']['steps']} teacher-forced steps "
        f"({s['probe']['windows'] * s['probe']['steps']} predictions per point). Checks on evaluation text are the "
        "runtime's own stepwise decode, and their bytes are KV bytes held in the page arena at the end of a window "
        "(metadata and page fragmentation included) over an fp16 dense cache of the same tokens; budget probes on "
        "search text run the model over the K/V as the allocation codes them, and their bytes are modelled "
        "(codes and scales, no page slack).",
        "",
        "## Chosen configuration",
        "",
        f"`{json.dumps(s['chosen']['settings'], sort_keys=True)}`: {s['chosen']['bytes_ratio']:.3f} of fp16 bytes "
        f"({1 / s['chosen']['bytes_ratio']:.2f}x fewer), top-1 {s['chosen']['top1']:.3f}, perplexity ratio "
        f"{s['chosen']['ppl_ratio']:.3f} on evaluation text.",
        "",
        f"Stored: {settings_in_words(s['chosen']['settings'])}.",
        "",
    ]
    h = r.get("held_out")
    if h:
        met = held_out_met(h, t, at_bounds=True)
        lines += [
            f"On held-out evaluation text (documents disjoint from calibration and search; {h['predictions']} "
            f"predictions after {h['prompt_tokens']}-token prompts): bytes {h['memory']['ratio_to_fp16']:.3f} of "
            f"fp16, top-1 {h['top1']:.3f}, perplexity ratio {h['ppl_ratio']:.3f}, KL {h['kl']:.4f}. "
            f"Target {'met' if met else 'NOT met'} on held-out text at its bounds.",
            "",
        ]
    q = s["quality_model"]
    lines += ["## How it was chosen", "",
              f"One dense prefill per search window and the continuation's forward and backward pass through it "
              f"({s['probe']['prompt']} + {s['probe']['steps']} tokens) predicted the loss of every format per "
              f"layer, keys and values apart; the {len(q['hull'])} allocations on the bytes-loss frontier run from "
              f"{q['hull'][0]['held_bytes'] / 1e6:.2f} to {q['hull'][-1]['held_bytes'] / 1e6:.2f} MB at the "
              "deployment context. Coded probes bisected that "
              "frontier for the cheapest point meeting the target at its bounds"
              + (f"; past hull point {q['path']['from']}, one step of the frontier too coarse to resolve, its "
                 f"{len(q['path']['points'])} moves made a path cheapest in loss per byte first ("
                 f"{sum(p['stage'] == 'step' for p in s['path'])} measured alone, the others priced by the table at "
                 "their median ratio to it), and the bisection went on along it"
                 if q.get("path", {}).get("points") else "")
              + "; the runtime's stepwise decode on evaluation text confirmed it (docs/calibration.md). Seconds: "
              + ", ".join(f"{k} {v:g}" for k, v in s["seconds"].items()) + ".", ""]
    lines += ["", f"![quality vs bytes]({png})", "", "## Every measurement, in order", "",
              "| measured | point | predicted loss | bytes / fp16 | compression | top-1 | ppl ratio | KL | "
              "meets at bounds |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [_fmt_point(p) for p in s["path"]]
    lines += ["", "## Provenance", "", "```json", json.dumps(r["provenance"], indent=2, default=str), "```", ""]
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = r["search"]
    fig, (ax, hull_ax) = plt.subplots(1, 2, figsize=(13, 5))
    hull = s["quality_model"]["hull"]
    hull_ax.plot([h["held_bytes"] / 1e6 for h in hull], [h["predicted_loss"] for h in hull], ".-", color="tab:gray",
                 label="frontier (predicted)")
    for stage, color in STAGE_COLORS.items():
        pts = [p for p in s["path"] if p["stage"] == stage]
        hull_ax.scatter([p["held_bytes"] / 1e6 for p in pts], [p["predicted_loss"] for p in pts],
                        color=color, zorder=4, label=STAGE_NAMES[stage])
    moves = s["quality_model"].get("path", {}).get("points", [])
    if moves:
        line = [hull[s["quality_model"]["path"]["from"]], *moves]
        hull_ax.plot([h["held_bytes"] / 1e6 for h in line], [h["predicted_loss"] for h in line], ".-",
                     color="tab:purple", label="path by measured moves")
    hull_ax.set_yscale("symlog", linthresh=1e-3)
    hull_ax.set_xlabel("bytes of the allocated formats at the recorded context (MB)")
    hull_ax.set_ylabel("predicted loss increase (nats, summed)")
    hull_ax.set_title("quality model: the predicted frontier")
    hull_ax.grid(alpha=0.3)
    hull_ax.legend(fontsize=8)
    for stage, color in STAGE_COLORS.items():
        pts = [p for p in s["path"] if p["stage"] == stage]
        if not pts:
            continue
        ok = [p for p in pts if p["feasible"]]
        bad = [p for p in pts if not p["feasible"]]
        if ok:
            ax.scatter([p["bytes_ratio"] for p in ok], [p["top1"] for p in ok], color=color,
                       label=f"{STAGE_NAMES[stage]} (meets)")
        if bad:
            ax.scatter([p["bytes_ratio"] for p in bad], [p["top1"] for p in bad], facecolors="none", edgecolors=color,
                       label=f"{STAGE_NAMES[stage]} (misses)")
    c = s["chosen"]
    ax.scatter([c["bytes_ratio"]], [c["top1"]], marker="*", s=300, color="red", label="chosen", zorder=5)
    ax.axhline(s["target"]["top1"], color="red", linestyle="--", linewidth=1,
               label=f"target top-1 {s['target']['top1']} (a point must clear it at its "
                     f"{bound_in_words(s['target'])}, and meet the perplexity ratio)")
    ax.set_xlabel("KV bytes held / fp16 dense bytes (lower is better)")
    ax.set_ylabel("top-1 agreement with dense")
    ax.set_title(f"kvcal calibration: {r['model']}")
    ax.grid(alpha=0.3)
    # below the axes: inside, a legend hides the points near the target line, where the decision is made
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png", bbox_inches="tight")   # `path`: a temporary name, no suffix
    plt.close(fig)
