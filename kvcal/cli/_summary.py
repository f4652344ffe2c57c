"""What `kvcal calibrate`, `kvcal inspect` and `kvcal export` print for people: what is stored, bytes per token,
quality, whether the target was met on evaluation text, then provenance. Plain data in, rich renderables out, and
`print_plain` to print them as plain lines."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from kvcal.cli._errors import plain
from kvcal.eval.target import bound_in_words
from kvcal.profile.report import bytes_in_words, held_out_met, settings_in_words
from kvcal.runtime.bundle import Bundle
from kvcal.runtime.config import CompressionConfig


def fp16_bytes_per_token(bundle: Bundle) -> int:
    """K and V of one token in every layer and KV head, in fp16."""
    L, H, d = bundle.shape
    return 2 * L * H * d * 2


def print_plain(renderable: RenderableType, console: Console | None = None) -> None:
    """Print `renderable` line by line without the spaces rich pads table cells with up to the column's (and so the
    terminal's) width: copied or piped output, and diffs of it, should hold only what was written."""
    if console is None:
        from kvcal.cli._console import stdout as console
    for line in console.render_lines(renderable, pad=False):
        while line and not line[-1].control and not line[-1].text.rstrip():
            line.pop()
        if line:
            line[-1] = Segment(line[-1].text.rstrip(), line[-1].style, line[-1].control)
        console.print(Text.assemble(*((seg.text, seg.style) for seg in line if not seg.control)), soft_wrap=True,
                      highlight=False)


def key_value_table() -> Table:
    """The layout of every command's summary: a bold name, then its value; no box, no header."""
    t = Table(show_header=False, box=None, padding=(0, 1), pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    return t


def _quality(p: dict) -> str:
    return f"top-1 {p['top1']:.3f}, perplexity ratio {p['ppl_ratio']:.3f} ({p['predictions']} predictions)"


def verdict(held_out: dict, target: dict) -> Text:
    """The loud line: was the target met on evaluation text?"""
    rule = f"top-1 >= {target['top1']:g} and perplexity ratio <= {target['ppl_ratio']:g}"
    if held_out_met(held_out, target, at_bounds=True):
        return Text.assemble(("TARGET MET", "bold green"), f" on evaluation text ({rule}).")
    if held_out_met(held_out, target):
        margin = min(round(target["top1"] + 0.01, 3), 0.999)    # docs/bench.md, "gemma3-270m at 4k"
        return Text.assemble(("TARGET NOT MET", "bold red"), f" on evaluation text ({rule}) at the bounds that "
                             "calibrate and `kvcal bench` ask for: met as measured; not at its bounds. For a margin, "
                             f"calibrate with `--target-top1 {margin:g}`.")
    return Text.assemble(("TARGET NOT MET", "bold red"), f" on evaluation text ({rule}): top-1 "
                         f"{held_out['top1']:.3f}, perplexity ratio {held_out['ppl_ratio']:.3f}. The bundle is "
                         "written; the report lists every point measured.")


def _rank_means(bundle: Bundle) -> dict:
    return {"head_dim": bundle.shape[2], "qk_rank_mean": bundle.qk_rank.float().mean().item(),
            "v_rank_mean": bundle.v_rank.float().mean().item()}


def defaults_in_words(bundle: Bundle, **ranks) -> str:
    """What a bundle made without a search is served with: its settings block records only the window, and the
    runtime reads the rest as `CompressionConfig`'s defaults (`CompressionConfig.from_dict`), named here."""
    config = CompressionConfig.from_dict(bundle.settings)
    words = settings_in_words(config.to_dict(), **ranks)
    if not config.tiering.tiered:           # the tiers exist but no token moves to the low one: name them anyway
        words += (f"; tiers {config.high.name} / {config.low.name} with a window of {config.tiering.window} tokens, "
                  "unused without thresholds")
    return f"the runtime's defaults, as no search chose settings: {words}"


def search_rows(t: Table, bundle: Bundle, search: dict) -> None:
    """stored / size / quality rows of a searched bundle (`search` as kept in calibration metadata)."""
    chosen, held = search["chosen"], search.get("held_out")
    t.add_row("stored", settings_in_words(chosen["settings"], **_rank_means(bundle)))
    if not chosen.get("feasible", True):
        t.add_row("", Text("no configuration met the target on search text: this is the most precise one measured",
                           style="yellow"))
    t.add_row("size", bytes_in_words(chosen["bytes_ratio"], fp16_bytes_per_token(bundle)))
    if chosen.get("stage") == "confirm":      # chosen by the quality model: its row is the check on evaluation text
        probed = [p for p in search.get("path", []) if p["stage"] == "probe" and p["label"] == chosen["label"]]
        t.add_row("quality", f"evaluation text: {_quality(chosen)}")
        if probed:
            t.add_row("", f"search text: {_quality(probed[-1])}")
        return
    t.add_row("quality", f"search text: {_quality(chosen)}")
    if held:
        t.add_row("", f"evaluation text: {_quality(held)}")


def calibration_summary(s: dict, bundle: Bundle) -> RenderableType:
    """The end of `kvcal calibrate` (s: CalibrationResult.summary)."""
    # the model's name and the bundle's path come from the command line and the model's folder: `plain`, as markup,
    # like every other cell (a `[/b]` in a path is text, an escape sequence is shown as \x1b)
    head = Text.from_markup(f"[bold]kvcal calibrate[/bold]: {plain(s['model'])} -> [bold]{plain(s['bundle'])}[/bold]")
    t = key_value_table()
    search = bundle.calibration.get("search")
    parts: list[RenderableType] = [head]
    if search:
        search_rows(t, bundle, search)
        path = search.get("path", [])
        probes, checks = (sum(p["stage"] == stage for p in path) for stage in ("probe", "confirm"))
        t.add_row("measured", f"{probes} probe{'s' * (probes != 1)} on search text, {checks} "
                              f"check{'s' * (checks != 1)} on evaluation text; seconds: "
                              + ", ".join(f"{k} {v:g}" for k, v in s["search"]["seconds"].items()))
    else:
        t.add_row("stored", f"statistics only (--no-search), ranks from --removal-rate; "
                            f"{defaults_in_words(bundle, **_rank_means(bundle))}")
    t.add_row("time", f"{s['wall_seconds']:.0f} s (load {s['load_seconds']:.1f} s, passes {s['pass_seconds']:.1f} s, "
                      f"search {s['search_seconds']:.1f} s); peak RSS {s['peak_rss_mib']:.0f} MiB"
                      + (f"; passes at {s['pass_threads']} thread (the model's products give other bits at more)"
                         if s.get("pass_threads") == 1 and s.get("threads", {}).get("count", 1) > 1 else "")
                      + (f"; threads {s['threads']['text']}" if s.get("threads") else ""))
    t.add_row("statistics", f"{s['tokens']['random']} random + {s['tokens']['text']} text tokens; energy kept qk "
                            f"{s['energy_kept']['qk']:.3f}, v {s['energy_kept']['v']:.3f}")
    ti = s["token_independence"]
    t.add_row("token independence", f"δ̄/ε̄ = {ti['ratio']:.3%}; subspace overlap at d/2 {ti['overlap_half']:.3f}")
    if s.get("resumed"):
        t.add_row("resumed", ", ".join(f"{k}: {v}" for k, v in s["resumed"].items()))
    if "report" in s:
        t.add_row("report", f"{plain(s['report']['md'])} (and .json, .png next to it)")
    t.add_row("next", f"kvcal inspect {plain(s['bundle'])}; kvcal bench --bundle {plain(s['bundle'])} --quick")
    parts.append(t)
    if search and search.get("held_out"):
        parts.append(verdict(search["held_out"], search["target"]))
    return Group(*parts)


def bundle_summary(bundle: Bundle, path: str) -> RenderableType:
    """The head of `kvcal inspect`: settings, bytes per token, measured quality, then provenance."""
    m, cal = bundle.model, bundle.calibration
    # markup, like the table's cells: the caller passes metadata escaped (`terminal_safe`), so brackets stay literal
    head = Text.from_markup(f"[bold]bundle {path}[/bold]: {m.name} ({m.family}, {m.num_layers} layers, "
                            f"{m.num_kv_heads} KV heads, head dim {m.head_dim})", overflow="fold")
    t = key_value_table()
    search = cal.get("search")
    if search:
        search_rows(t, bundle, search)
        target = search["target"]
        t.add_row("target", f"top-1 >= {target['top1']:g} (at its {bound_in_words(target)}, in the search) and "
                            f"perplexity ratio <= {target['ppl_ratio']:g}")
    else:
        t.add_row("stored", defaults_in_words(bundle, **_rank_means(bundle)))
        t.add_row("size", "not measured (made with `kvcal calibrate --no-search`)")
    t.add_row("created", f"{bundle.created} by kvcal {bundle.kvcal_version}")
    if cal:
        ds = cal.get("dataset", {})
        t.add_row("calibration", f"seed {cal.get('seed')}, {cal.get('random_tokens')} random + "
                                 f"{cal.get('text_tokens')} text tokens from {ds.get('name')} (sha256 "
                                 f"{str(ds.get('sha256'))[:12]}), windows of {cal.get('seq_len')} over positions "
                                 f"[0, {cal.get('positions', {}).get('max_position')}), removal rate "
                                 f"{cal.get('removal_rate')}")
        times = cal.get("summary")
        if times:
            t.add_row("took", f"{times['wall_seconds']:.0f} s (passes {times['pass_seconds']:.0f} s, search "
                              f"{times['search_seconds']:.0f} s); peak RSS {times['peak_rss_mib']:.0f} MiB")
    t.add_row("rotation", f"{bundle.qk_source}, weighting {bundle.qk_weighting}; V basis {bundle.v_source}")
    ti = cal.get("token_independence") if cal else None
    if ti:
        t.add_row("token independence", f"δ̄/ε̄ {ti['ratio']:.3%}, subspace overlap d/2 {ti['overlap_half']:.3f}")
    t.add_row("model", f"fingerprint {m.fingerprint}, weights {m.weights_hash[:12]}, tokenizer "
                       f"{m.tokenizer_hash[:12]}")
    parts: list[RenderableType] = [head, t]
    if search and search.get("held_out"):
        parts.append(verdict(search["held_out"], search["target"]))
    return Group(*parts)
