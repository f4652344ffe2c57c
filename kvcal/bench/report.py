"""`kvcal bench` outputs: the JSON report (schema below, checked by `validate`), Markdown, and two PNG plots.

Files in the output folder: `bench.json`, `bench.md`, `pareto.png` (quality vs bytes, each method a series, the
Pareto front drawn through the best points), `decode_time.png` (decode ms/step and prefill tokens/s vs context).

JSON schema, version 4 (`SCHEMA_VERSION`; 2 added `memory.fixed_bytes`, 3 `environment.threads`, 4
`bundle.target.held_out_predictions`). Numbers are JSON numbers; `null` where a value does not apply.

    schema_version int, kind "kvcal-bench", created str, command str, seed int, quick bool, wall_seconds number
    model        {name, family, fingerprint, weights_hash, dtype: str; num_layers, num_kv_heads, num_q_heads,
                  head_dim, max_positions, fp16_bytes_per_token: int}
    bundle       {path, sha256: str|null; created, kvcal_version: str; policy: dict;
                  target: {top1, ppl_ratio, z: number, held_out_predictions: int,
                           source: "bundle"|"default"|"command line"}}
    environment  {kvcal, torch, transformers, python, platform, machine, cpu, attention_backend: str;
                  cpu_count, torch_threads: int; cuda: bool;
                  threads: str}   (why torch_threads: "1 (auto: 1.0 of 2 cores busy)", "2 (--threads 2)", ...)
    settings     {quality: {dataset, dataset_sha256, windows_sha256: str; windows, prompt, steps: int},
                  passkey: {lengths: [int], depths: [number], new_tokens: int, filler: str},
                  speed: {contexts: [int], decode_steps, batch: int}, matched_ratio: number, backend: str,
                  palu_calibration_tokens: int}
    skipped      [{what: "speed"|"passkey", length: int, reason: str}]
    methods      [{key, name, family, series, description: str; settings: dict; available: bool;
                   unavailable_reason, note: str|null;
                   memory: {bytes_per_token, ratio_to_fp16: number; total_bytes, fp16_bytes, tokens,
                            fixed_bytes: int}|null,   (fixed_bytes: per-model constants such as codebooks and
                            calibrated scales, not in total_bytes or the ratio)
                   quality: {kl, top1, ppl_ratio, ppl, ppl_dense, decode_ms_per_step: number; predictions: int;
                             meets_target: bool; tiers: dict}|null,
                   passkey: {accuracy: number, cases: {"<length>@<depth>": bool}}|null,
                   speed: [{context: int; prefill_tokens_per_s, decode_ms_per_step, bytes_per_token,
                            ratio_to_fp16: number}],
                   seconds: number}]
    summary      {target: dict, basis: "target"|"joint-quality"|"closest"|"none", kvcal_joint: dict|null,
                  best_baseline: dict|null, best_kvcal: dict|null, bytes_joint_over_baseline: number|null,
                  kvcal_ahead: bool|null, verdict: str, note: str}
    outputs      {json, md, pareto_png, decode_png: str}       (added when the files are written)

`family` is one of dense, quantization, eviction, low-rank, seed, kvcal. A "single-family baseline" is any available
method outside dense and kvcal. The summary compares kvcal joint with the cheapest single-family baseline at equal
quality, where equal quality means meeting the bundle's quality target as calibrate's search decides it
(`QualityTarget.met`: top-1 agreement's Wilson lower bound at z, over at most `held_out_predictions`, >= target and
perplexity ratio <= target, as measured on the bench's held-out text). If no baseline meets it, the baselines at least
as good as kvcal joint on both measures are used ("joint-quality"); if none is, the baseline closest in quality
("closest").
"""

from __future__ import annotations

import json
from numbers import Real
from pathlib import Path

from kvcal.eval.target import bound_in_words
from kvcal.runtime.config import CompressionConfig

SCHEMA_VERSION = 4
FAMILIES = ("dense", "quantization", "eviction", "low-rank", "seed", "kvcal")
BASELINE_FAMILIES = ("quantization", "eviction", "low-rank", "seed")

_NUM = Real
_OPT_STR = (str, type(None))
_OPT_DICT = (dict, type(None))
SCHEMA = {
    "": {"schema_version": int, "kind": str, "created": str, "command": str, "seed": int, "quick": bool,
         "wall_seconds": _NUM, "model": dict, "bundle": dict, "environment": dict, "settings": dict, "skipped": list,
         "methods": list, "summary": dict},
    "model": {"name": str, "family": str, "fingerprint": str, "weights_hash": str, "dtype": str, "num_layers": int,
              "num_kv_heads": int, "num_q_heads": int, "head_dim": int, "max_positions": int,
              "fp16_bytes_per_token": int},
    "bundle": {"path": _OPT_STR, "sha256": _OPT_STR, "created": str, "kvcal_version": str, "policy": dict,
               "target": dict},
    "bundle.target": {"top1": _NUM, "ppl_ratio": _NUM, "z": _NUM, "held_out_predictions": int, "source": str},
    "environment": {"kvcal": str, "torch": str, "transformers": str, "python": str, "platform": str, "machine": str,
                    "cpu": str, "cpu_count": int, "torch_threads": int, "cuda": bool, "attention_backend": str,
                    "threads": str},
    "settings": {"quality": dict, "passkey": dict, "speed": dict, "matched_ratio": _NUM, "backend": str,
                 "palu_calibration_tokens": int},
    "settings.quality": {"dataset": str, "dataset_sha256": str, "windows_sha256": str, "windows": int, "prompt": int,
                         "steps": int},
    "settings.passkey": {"lengths": list, "depths": list, "new_tokens": int, "filler": str},
    "settings.speed": {"contexts": list, "decode_steps": int, "batch": int},
    "skipped[]": {"what": str, "length": int, "reason": str},
    "methods[]": {"key": str, "name": str, "family": str, "series": str, "description": str, "settings": dict,
                  "available": bool, "unavailable_reason": _OPT_STR, "note": _OPT_STR, "memory": _OPT_DICT,
                  "quality": _OPT_DICT, "passkey": _OPT_DICT, "speed": list, "seconds": _NUM},
    "methods[].memory": {"bytes_per_token": _NUM, "ratio_to_fp16": _NUM, "total_bytes": int, "fp16_bytes": int,
                         "tokens": int, "fixed_bytes": int},
    "methods[].quality": {"kl": _NUM, "top1": _NUM, "ppl_ratio": _NUM, "ppl": _NUM, "ppl_dense": _NUM,
                          "decode_ms_per_step": _NUM, "predictions": int, "meets_target": bool, "tiers": dict},
    "methods[].passkey": {"accuracy": _NUM, "cases": dict},
    "methods[].speed[]": {"context": int, "prefill_tokens_per_s": _NUM, "decode_ms_per_step": _NUM,
                          "bytes_per_token": _NUM, "ratio_to_fp16": _NUM},
    "summary": {"target": dict, "basis": str, "kvcal_joint": _OPT_DICT, "best_baseline": _OPT_DICT,
                "best_kvcal": _OPT_DICT, "bytes_joint_over_baseline": (Real, type(None)),
                "kvcal_ahead": (bool, type(None)), "verdict": str, "note": str},
    "outputs": {"json": str, "md": str, "pareto_png": str, "decode_png": str},
}


def _check(obj, spec: dict, where: str, problems: list[str]) -> None:
    if not isinstance(obj, dict):
        problems.append(f"`{where or 'report'}` is {type(obj).__name__}, expected an object")
        return
    for key, types in spec.items():
        if key not in obj:
            problems.append(f"`{where + '.' if where else ''}{key}` missing")
            continue
        value, ok = obj[key], types if isinstance(types, tuple) else (types,)
        # bool is an int in Python: keep them apart
        if isinstance(value, bool) and bool not in ok or not isinstance(value, ok):
            problems.append(f"`{where + '.' if where else ''}{key}` is {type(value).__name__}, expected "
                            f"{' or '.join(t.__name__ for t in ok)}")
    for key in obj:
        if key not in spec and not (where == "" and key == "outputs"):
            problems.append(f"unexpected key `{where + '.' if where else ''}{key}`")


def validate(report: dict) -> list[str]:
    """Every way `report` departs from the schema, as short phrases; empty when it conforms."""
    problems: list[str] = []
    _check(report, SCHEMA[""], "", problems)
    if not isinstance(report, dict):
        return problems
    part = lambda obj, key: obj.get(key) if isinstance(obj, dict) else None          # noqa: E731
    for name in ("model", "bundle", "environment", "settings", "summary", "outputs"):
        if isinstance(report.get(name), dict):
            _check(report[name], SCHEMA[name], name, problems)
    if isinstance(part(report.get("bundle"), "target"), dict):
        _check(report["bundle"]["target"], SCHEMA["bundle.target"], "bundle.target", problems)
    for name in ("quality", "passkey", "speed"):
        if isinstance(part(report.get("settings"), name), dict):
            _check(report["settings"][name], SCHEMA[f"settings.{name}"], f"settings.{name}", problems)
    for i, s in enumerate(report.get("skipped") or []):
        _check(s, SCHEMA["skipped[]"], f"skipped[{i}]", problems)
    for i, m in enumerate(report.get("methods") or []):
        where = f"methods[{i}]"
        _check(m, SCHEMA["methods[]"], where, problems)
        if not isinstance(m, dict):
            continue
        if m.get("family") not in FAMILIES:
            problems.append(f"`{where}.family` is {m.get('family')!r}, expected one of {', '.join(FAMILIES)}")
        for name in ("memory", "quality", "passkey"):
            if isinstance(m.get(name), dict):
                _check(m[name], SCHEMA[f"methods[].{name}"], f"{where}.{name}", problems)
        for j, sp in enumerate(m.get("speed") or []):
            _check(sp, SCHEMA["methods[].speed[]"], f"{where}.speed[{j}]", problems)
    if report.get("schema_version") != SCHEMA_VERSION:
        problems.append(f"`schema_version` is {report.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    return problems


# --------------------------------------------------------------------------------------------- summary


def _brief(row: dict | None) -> dict | None:
    if row is None:
        return None
    q, m = row["quality"], row["memory"]
    return {"key": row["key"], "name": row["name"], "bytes_per_token": m["bytes_per_token"],
            "ratio_to_fp16": m["ratio_to_fp16"], "top1": q["top1"], "ppl_ratio": q["ppl_ratio"], "kl": q["kl"],
            "meets_target": q["meets_target"]}


def summarise(report: dict) -> dict:
    """kvcal joint vs the cheapest single-family baseline at equal quality (see the module docstring)."""
    target = report["bundle"]["target"]
    measured = [r for r in report["methods"] if r["quality"] is not None]
    joint = next((r for r in measured if r["key"] == "kvcal-joint"), None)
    baselines = [r for r in measured if r["family"] in BASELINE_FAMILIES]
    kvcal_ok = [r for r in measured if r["family"] == "kvcal" and r["quality"]["meets_target"]]
    best_kvcal = min(kvcal_ok, key=lambda r: r["memory"]["bytes_per_token"]) if kvcal_ok else None
    bpt = lambda r: r["memory"]["bytes_per_token"]          # noqa: E731
    # reports written before bench applied QualityTarget.met decided on the point estimate, i.e. z = 0
    goal = (f"top-1 >= {target['top1']:g} at its {bound_in_words(target)} and perplexity ratio <= "
            f"{target['ppl_ratio']:g}")
    out = {"target": target, "basis": "none", "kvcal_joint": _brief(joint), "best_baseline": None,
           "best_kvcal": _brief(best_kvcal), "bytes_joint_over_baseline": None, "kvcal_ahead": None,
           "verdict": "", "note": ""}
    if joint is None or not baselines:
        out["verdict"] = "nothing to compare: kvcal joint or every single-family baseline is missing from this run"
        return out
    jq = joint["quality"]
    meeting = [r for r in baselines if r["quality"]["meets_target"]]
    as_good = [r for r in baselines if r["quality"]["top1"] >= jq["top1"] and r["quality"]["ppl_ratio"]
               <= jq["ppl_ratio"]]
    if meeting:
        best, basis = min(meeting, key=bpt), "target"
    elif as_good:
        best, basis = min(as_good, key=bpt), "joint-quality"
    else:
        best, basis = max(baselines, key=lambda r: (r["quality"]["top1"], -r["quality"]["ppl_ratio"])), "closest"
    x = bpt(joint) / bpt(best)
    ahead = bool(bpt(joint) < bpt(best) and (jq["meets_target"] or basis != "target"))
    out.update(basis=basis, best_baseline=_brief(best), bytes_joint_over_baseline=x, kvcal_ahead=ahead)
    j_txt = (f"kvcal joint holds {bpt(joint):,.0f} B/token ({joint['memory']['ratio_to_fp16']:.3f} of fp16; top-1 "
             f"{jq['top1']:.3f}, perplexity ratio {jq['ppl_ratio']:.3f})")
    b_txt = (f"{best['name']} at {bpt(best):,.0f} B/token ({best['memory']['ratio_to_fp16']:.3f} of fp16; top-1 "
             f"{best['quality']['top1']:.3f}, perplexity ratio {best['quality']['ppl_ratio']:.3f})")
    if basis == "target":
        lead = f"At the quality target ({goal}), the cheapest single-family baseline is {b_txt}; {j_txt}"
        if not jq["meets_target"]:
            lead += ", and misses the target on this text"
    elif basis == "joint-quality":
        lead = (f"No single-family baseline meets the target ({goal}); the cheapest one at least as good as kvcal "
                f"joint is {b_txt}; {j_txt}")
    else:
        lead = (f"No single-family baseline meets the target ({goal}) or matches kvcal joint's quality; the closest "
                f"is {b_txt}; {j_txt}")
    if abs(x - 1) < 0.005:
        rel = "kvcal joint holds the same bytes per token as the baseline"
    else:
        rel = (f"kvcal joint holds {x:.2f}x the baseline's bytes per token ({abs(1 - x):.1%} "
               f"{'fewer' if x < 1 else 'more'})")
    out["verdict"] = f"{lead}. {rel}."
    if best_kvcal is not None and best_kvcal["key"] != "kvcal-joint" and bpt(best_kvcal) < bpt(joint):
        out["verdict"] += (f" The cheapest kvcal point meeting the target on this text is {best_kvcal['name']} at "
                           f"{bpt(best_kvcal):,.0f} B/token.")
    out["note"] = _where_it_loses(report, joint, best) if not ahead else ""
    return out


def _where_it_loses(report: dict, joint: dict, best: dict) -> str:
    """Facts behind a loss: what kvcal joint holds and what the winning baseline does differently."""
    q = joint["quality"]
    parts = [f"kvcal joint is not ahead of {best['name']} in this run."]
    if not q["meets_target"]:
        parts.append(f"It misses the target itself (top-1 {q['top1']:.3f}, perplexity ratio {q['ppl_ratio']:.3f} "
                     f"over {q['predictions']} predictions): the settings the bundle's search chose on its search "
                     "windows do not meet the target on this held-out text.")
    t = q.get("tiers") or {}
    if t:
        parts.append(f"Its token-heads are {t.get('high', 0):.1%} high tier, {t.get('low', 0):.1%} low tier and "
                     f"{t.get('pruned', 0):.1%} pruned.")
    sq = report["settings"]["quality"]
    config = CompressionConfig.from_dict(report["bundle"]["policy"] or {})
    window, n = config.tiering.window, sq["prompt"] + sq["steps"]
    tracked = ("every stored token carries 8 B of score and position" if config.low_tracked else
               "high-tier tokens carry 8 B of score and position (the low tier, which nothing prunes, none)")
    parts.append(f"Fixed costs at {n} tokens per sequence: the {window}-token window ({window / n:.1%} of tokens) is "
                 f"held at the high tier; {tracked}; pages are allocated whole, so each (sequence, layer, KV head, "
                 "tier) may hold one partly empty page.")
    fam = best["family"]
    ratio = joint["memory"]["ratio_to_fp16"] / best["memory"]["ratio_to_fp16"]
    if ratio < 1:
        parts.append(f"It holds {ratio:.2f}x {best['name']}'s bytes: the loss is quality, not bytes.")
    elif fam == "eviction":
        parts.append(f"{best['name']} spends the same bytes on fewer tokens at full fp16 precision; at this prompt "
                     "length dropping tokens costs less quality than quantizing all of them.")
    elif fam == "quantization":
        parts.append(f"{best['name']} keeps every token at one precision with no per-token score/position, so its "
                     "bytes per token are lower at the same quality.")
    elif fam == "low-rank":
        parts.append(f"{best['name']} stores rank-reduced fp16 latents with no per-token metadata.")
    else:
        parts.append(f"{best['name']} is one of kvcal's own families alone: combining the families did not pay "
                     "for itself here.")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------- writing


def output_paths(out_dir: Path) -> dict[str, Path]:
    return {"json": out_dir / "bench.json", "md": out_dir / "bench.md", "pareto_png": out_dir / "pareto.png",
            "decode_png": out_dir / "decode_time.png"}


def write_report(report: dict, out_dir: str | Path, *, overwrite: bool = False) -> dict[str, Path]:
    """Write the JSON, Markdown and both plots into `out_dir`; adds `outputs` to `report`. Each file goes through
    `write_file`: never through a link, and an existing one is replaced only with `overwrite`."""
    from kvcal.runtime.files import write_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = output_paths(out_dir)
    report["outputs"] = {k: str(v) for k, v in paths.items()}
    problems = validate(report)
    if problems:
        raise RuntimeError(f"bench report does not match its schema: {problems[0]}"
                           + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    write_file(paths["pareto_png"], lambda tmp: _plot_pareto(report, tmp), overwrite=overwrite)
    write_file(paths["decode_png"], lambda tmp: _plot_speed(report, tmp), overwrite=overwrite)
    write_file(paths["md"], markdown(report), overwrite=overwrite)
    write_file(paths["json"], json.dumps(report, indent=2, default=str), overwrite=overwrite)
    return paths


def _f(x, fmt: str, empty: str = "") -> str:
    return empty if x is None else format(x, fmt)


def _speed_at(row: dict, context: int) -> dict | None:
    return next((s for s in row["speed"] if s["context"] == context), None)


def markdown(r: dict) -> str:
    s, m, b, env = r["summary"], r["model"], r["bundle"], r["environment"]
    sq, sp, ss = r["settings"]["quality"], r["settings"]["passkey"], r["settings"]["speed"]
    t = b["target"]
    lines = [
        f"# kvcal bench: {m['name']}",
        "",
        f"Command: `{r['command']}` ({'quick' if r['quick'] else 'full'} run, seed {r['seed']}, "
        f"{r['wall_seconds']:.0f} s). Created {r['created']}.",
        "",
        "## Result",
        "",
        s["verdict"],
        "",
    ]
    if s["note"]:
        lines += [f"Where kvcal loses: {s['note']}", ""]
    lines += [
        f"Quality: KL(dense || method), top-1 agreement with dense and continuation-perplexity ratio over "
        f"{sq['windows']} held-out windows of {sq['prompt']} prompt tokens + {sq['steps']} teacher-forced steps "
        f"({sq['windows'] * sq['steps']} predictions; `{sq['dataset']}`, documents disjoint from calibration). "
        f"Target (from the {t['source']}): top-1 >= {t['top1']:g} (its {bound_in_words(t)}), "
        f"perplexity ratio <= {t['ppl_ratio']:g}. "
        f"Bytes: every byte the cache holds at the end of the quality run (pages, metadata and fragmentation for "
        f"the kvcal store; K/V and per-token positions/scores for the others) per token, and over an fp16 dense "
        f"cache of the same tokens ({m['fp16_bytes_per_token']:,} B/token). Eviction and Palu baselines are "
        f"budgeted to kvcal joint's ratio, {r['settings']['matched_ratio']:.3f}.",
        "",
    ]
    ctx = ss["contexts"]
    head = ["method", "family", "B/token", "of fp16", "KL", "top-1", "ppl ratio", "meets", "passkey"]
    head += [f"prefill tok/s @{c}" for c in ctx] + [f"decode ms @{c}" for c in ctx]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in r["methods"]:
        if row["quality"] is None:
            continue
        q, mem, pk = row["quality"] or {}, row["memory"] or {}, row["passkey"]
        kl = q.get("kl")
        cells = [row["name"], row["family"], _f(mem.get("bytes_per_token"), ",.0f"),
                 _f(mem.get("ratio_to_fp16"), ".3f"), _f(None if kl is None else max(kl, 0.0), ".4f"),
                 _f(q.get("top1"), ".3f"), _f(q.get("ppl_ratio"), ".3f"),
                 "yes" if q.get("meets_target") else "no", _f(pk and pk["accuracy"], ".2f")]
        speeds = [_speed_at(row, c) for c in ctx]
        cells += [_f(x and x["prefill_tokens_per_s"], ".0f") for x in speeds]
        cells += [_f(x and x["decode_ms_per_step"], ".1f") for x in speeds]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    missing = [row for row in r["methods"] if not row["available"]]
    unselected = [row["name"] for row in r["methods"] if row["available"] and row["quality"] is None]
    if missing or unselected or r["skipped"]:
        lines += ["Not run:", ""]
        lines += [f"- {row['name']}: unavailable: {row['unavailable_reason']}" for row in missing]
        if unselected:
            lines.append(f"- not selected by `--methods`: {', '.join(unselected)}")
        lines += [f"- {x['what']} at {x['length']} tokens: {x['reason']}" for x in r["skipped"]]
        lines.append("")
    lines += ["![quality vs bytes](pareto.png)", "", "![decode time vs context](decode_time.png)", "",
              "## Methods", "",
              "| method | what it stores | settings | note |", "|---|---|---|---|"]
    for row in r["methods"]:
        lines.append(f"| {row['name']} | {row['description']} | `{json.dumps(row['settings'], sort_keys=True)}` | "
                     f"{row['note'] or ''} |")
    lines += ["", f"Passkey: lengths {sp['lengths']}, depths {sp['depths']}, {sp['new_tokens']} greedy tokens, "
              f"{sp['filler']} filler. Speed: batch {ss['batch']}, one prefill per context, decode ms/step = mean of "
              f"{ss['decode_steps']} steps after one warm-up step, on {env['cpu_count']} CPU cores, torch threads "
              f"{env.get('threads', env['torch_threads'])}.", "",
              "## Reproducibility", "",
              f"- model `{m['name']}` ({m['family']}, {m['dtype']}), fingerprint `{m['fingerprint']}`, weights hash "
              f"`{m['weights_hash']}`",
              f"- bundle `{b['path']}`, sha256 `{b['sha256']}`, created {b['created']} by kvcal "
              f"{b['kvcal_version']}; policy `{json.dumps(b['policy'], sort_keys=True)}`",
              f"- held-out windows sha256 `{sq['windows_sha256']}` (corpus sha256 `{sq['dataset_sha256']}`), "
              f"seed {r['seed']}",
              f"- kvcal {env['kvcal']}, torch {env['torch']}, transformers {env['transformers']}, Python "
              f"{env['python']}; attention backend {env['attention_backend']}",
              f"- {env['platform']}, {env['cpu']} ({env['cpu_count']} cores)", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- plots

_MARKERS = "osD^v<>PX*hp8d"


def _series_style(names: list[str]) -> dict[str, tuple]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {n: (cmap(i % 20), _MARKERS[i % len(_MARKERS)]) for i, n in enumerate(names)}


def _short(name: str) -> str:
    for cut in (" per-token", " only", " low rank", "HF QuantizedCache "):
        name = name.replace(cut, "")
    return name


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten on both (fewer bytes, higher quality), sorted by bytes."""
    front, best = [], float("-inf")
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return front


def _plot_pareto(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in r["methods"] if row["quality"] is not None]
    series = list(dict.fromkeys(row["series"] for row in rows))
    style = _series_style(series)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    metrics = (("top1", "top-1 agreement with dense (higher is better)", False),
               ("kl", "KL(dense || method), nats (lower is better; < 1e-6 shown at 1e-6)", True))
    for ax, (key, label, log) in zip(axes, metrics):
        for name in series:
            pts = [row for row in rows if row["series"] == name]
            color, marker = style[name]
            ax.scatter([p["memory"]["ratio_to_fp16"] for p in pts], [max(p["quality"][key], 1e-6) if log else
                       p["quality"][key] for p in pts], color=color, marker=marker, s=60 if name.startswith("kvcal")
                       else 40, label=name, edgecolors="black", linewidths=0.4, zorder=3)
        sign = -1 if log else 1
        front = _pareto([(row["memory"]["ratio_to_fp16"], sign * max(row["quality"][key], 1e-6) if log else
                          row["quality"][key]) for row in rows])
        ax.step([x for x, _ in front], [sign * y for _, y in front], where="post", color="gray", linestyle="--",
                linewidth=1, label="Pareto front", zorder=2)
        if key == "top1":
            crowded = {n for n in series if sum(row["series"] == n for row in rows) > 1} - {"kvcal sweep"}
            for p in rows:
                if p["series"] in crowded:           # the legend names single-point series
                    ax.annotate(_short(p["name"]), (p["memory"]["ratio_to_fp16"], p["quality"]["top1"]),
                                textcoords="offset points", xytext=(4, 3), fontsize=6, alpha=0.8)
            ax.axhline(r["bundle"]["target"]["top1"], color="red", linestyle=":", linewidth=1,
                       label=f"target top-1 {r['bundle']['target']['top1']:g}")
        if log:
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV bytes held / fp16 dense bytes (log scale, lower is better)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=True)
    sq = r["settings"]["quality"]
    fig.suptitle(f"kvcal bench: {r['model']['name']}, quality vs bytes ({sq['windows']} held-out windows x "
                 f"{sq['steps']} steps after {sq['prompt']}-token prompts)")
    fig.tight_layout(rect=(0, 0, 0.82, 0.95))
    fig.savefig(path, dpi=120, format="png")       # `path` is a temporary name: the format is not in its suffix
    plt.close(fig)


def _plot_speed(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in r["methods"] if row["speed"]]
    series = _series_style(list(dict.fromkeys(row["series"] for row in r["methods"] if row["quality"])))
    colors = [matplotlib.colormaps[c](i) for c in ("tab20", "tab20b") for i in range(20)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, key, label in ((axes[0], "decode_ms_per_step", "decode time per step, ms (lower is better)"),
                           (axes[1], "prefill_tokens_per_s", "prefill throughput, tokens/s (higher is better)")):
        for i, row in enumerate(rows):
            color, marker = colors[i % len(colors)], series.get(row["series"], ("black", "o"))[1]
            pts = sorted(row["speed"], key=lambda s: s["context"])
            ax.plot([p["context"] for p in pts], [p[key] for p in pts], marker=marker, color=color,
                    linestyle="-" if len(pts) > 1 else "none", label=row["name"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length, tokens (log scale)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    skipped = [str(s["length"]) for s in r["skipped"] if s["what"] == "speed"]
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7, frameon=True)
    env = r["environment"]
    fig.suptitle(f"kvcal bench: {r['model']['name']}, batch 1 on {env['cpu_count']} CPU cores ({env['cpu']})"
                 + (f"; skipped contexts: {', '.join(skipped)} (see the report)" if skipped else ""),
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.82, 0.95))
    fig.savefig(path, dpi=120, format="png")       # `path` is a temporary name: the format is not in its suffix
    plt.close(fig)
