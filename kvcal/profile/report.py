"""The calibration report written next to a bundle: JSON (everything), Markdown (for people), PNG (quality vs bytes of
every configuration tried, the chosen one marked)."""

from __future__ import annotations

import json
from pathlib import Path

STAGE_COLORS = {"precision": "tab:gray", "tiers": "tab:blue", "ranks": "tab:orange", "policies": "tab:green",
                "family": "tab:purple"}


def report_paths(bundle_path: Path) -> dict[str, Path]:
    stem = bundle_path.name.removesuffix(".safetensors")
    return {kind: bundle_path.with_name(f"{stem}.report.{kind}") for kind in ("json", "md", "png")}


def write_report(bundle_path: Path, report: dict) -> dict[str, Path]:
    paths = report_paths(bundle_path)
    paths["json"].write_text(json.dumps(report, indent=2, default=str))
    paths["md"].write_text(_markdown(report, paths["png"].name))
    _plot(report, paths["png"])
    return paths


def _fmt_point(p: dict) -> str:
    return (f"| {p['stage']} | {p['label']} | {p['bytes_ratio']:.3f} | {1 / p['bytes_ratio']:.2f}x | {p['top1']:.3f} | "
            f"{p['ppl_ratio']:.3f} | {p['kl']:.4f} | {'yes' if p['feasible'] else 'no'} |")


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
        f"dense, measured by the runtime on {s['probe']['windows']} held-out calibration windows of "
        f"{s['probe']['prompt']} prompt tokens + {s['probe']['steps']} teacher-forced steps "
        f"({s['probe']['windows'] * s['probe']['steps']} predictions per point). Bytes are KV bytes held in the page "
        "arena at the end of a window (metadata and page fragmentation included) over an fp16 dense cache of the "
        "same tokens.",
        "",
        "## Chosen configuration",
        "",
        f"`{json.dumps(s['chosen']['settings'], sort_keys=True)}`: {s['chosen']['bytes_ratio']:.3f} of fp16 bytes "
        f"({1 / s['chosen']['bytes_ratio']:.2f}x fewer), top-1 {s['chosen']['top1']:.3f}, perplexity ratio "
        f"{s['chosen']['ppl_ratio']:.3f} on the search windows.",
        "",
    ]
    h = r.get("held_out")
    if h:
        met = h["top1"] >= t["top1"] and h["ppl_ratio"] <= t["ppl_ratio"]
        lines += [
            f"On held-out evaluation text (documents disjoint from calibration and search; {h['predictions']} "
            f"predictions after {h['prompt_tokens']}-token prompts): bytes {h['memory']['ratio_to_fp16']:.3f} of "
            f"fp16, top-1 {h['top1']:.3f}, perplexity ratio {h['ppl_ratio']:.3f}, KL {h['kl']:.4f}. "
            f"Target {'met' if met else 'NOT met'} on held-out text.",
            "",
        ]
    lines += ["## Families (each searched alone, cheapest point meeting the target)", "",
              "| family | configuration | bytes / fp16 | compression | top-1 | ppl ratio | KL | meets target |",
              "|---|---|---|---|---|---|---|---|"]
    for name, p in s["families"].items():
        if p is None:
            lines.append(f"| {name} | none met the target | | | | | | no |")
        else:
            lines.append(_fmt_point({**p, "stage": name}))
    lines += ["", f"![quality vs bytes]({png})", "", "## Every point measured, in search order", "",
              "| stage | configuration | bytes / fp16 | compression | top-1 | ppl ratio | KL | feasible |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [_fmt_point(p) for p in s["path"]]
    lines += ["", "## Provenance", "", "```json", json.dumps(r["provenance"], indent=2, default=str), "```", ""]
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = r["search"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for stage, color in STAGE_COLORS.items():
        pts = [p for p in s["path"] if p["stage"] == stage]
        if not pts:
            continue
        ok = [p for p in pts if p["feasible"]]
        bad = [p for p in pts if not p["feasible"]]
        if ok:
            ax.scatter([p["bytes_ratio"] for p in ok], [p["top1"] for p in ok], color=color, label=f"{stage} (meets)")
        if bad:
            ax.scatter([p["bytes_ratio"] for p in bad], [p["top1"] for p in bad], facecolors="none", edgecolors=color,
                       label=f"{stage} (misses)")
    c = s["chosen"]
    ax.scatter([c["bytes_ratio"]], [c["top1"]], marker="*", s=300, color="red", label="chosen", zorder=5)
    ax.axhline(s["target"]["top1"], color="red", linestyle="--", linewidth=1,
               label=f"target top-1 {s['target']['top1']} (a point must clear it at its Wilson bound, "
                     f"z = {s['target'].get('z', 0):g}, and meet the perplexity ratio)")
    ax.set_xlabel("KV bytes held / fp16 dense bytes (lower is better)")
    ax.set_ylabel("top-1 agreement with dense")
    ax.set_title(f"kvcal calibration: {r['model']} (search windows)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.9)    # best: the corners hold points often
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
