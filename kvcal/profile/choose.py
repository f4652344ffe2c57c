"""Choosing the settings: quality model -> allocation -> budget -> confirmation (after the statistics passes).

1. `record_search` (kvcal.profile.recording): per search window, the dense prefill and the continuation's forward
   and backward pass through it give the quality model's predicted loss of every catalogue format per (layer, KV
   head, K|V) (kvcal.profile.quality_model) and the coded probe's inputs;
2. `frontier` (kvcal.profile.allocate): the per-layer allocations that are cheapest for their predicted loss;
3. `bisect` (kvcal.profile.budget): at most `max_probes` coded probes on the search windows (kvcal.profile.
   coded_probe: the model over the K/V as the allocation codes them, without the runtime's per-token policy steps)
   find the cheapest of them that meets the target at its bounds; where one move of the hull past it is too large
   a step to resolve (`budget.coarse`), the hull's moves past it are measured alone (the first `step_probes`; the
   rest priced by the table at the measured moves' median ratio to it), a path takes them cheapest in measured loss
   per byte first (`allocate.measured_path`), and the bisection goes on along that path;
4. `confirm`: stepwise checks by the runtime itself on evaluation text, stepping back by the measured gap on a miss;
   each point is gauged first by the coded probe on the same evaluation windows (`recorded_prompts` reuses the
   check's recorded prefills, and the tokens each layer holds are captured in its reference's forward), so a point
   the evaluation text defeats costs a gauge, not a check; the gauges left after a step back bisect the points it
   stepped over.

The number of measurements is known before the first one (`planned_steps`), so the progress bar shows one ETA.
Every measurement is checkpointed by its settings, so an interrupted run resumes without measuring again.

    report = choose_settings(lm, bundle, cfg, checkpoint, say, progress, prompt=P)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from kvcal.data import load_corpus, token_windows
from kvcal.eval import DecodeProbe, QualityTarget
from kvcal.models import DTYPES
from kvcal.profile.allocate import Allocation, Step, base_settings, frontier, hull_steps, measured_path, to_config
from kvcal.profile.budget import Probe, bisect, coarse, confirm
from kvcal.profile.coded_probe import CodedProbe
from kvcal.profile.heap import release_memory
from kvcal.profile.quality_model import ALPHAS, HIGH, bundle_levels
from kvcal.profile.ranks import ranks_of
from kvcal.profile.recording import HeldTokens, record_search, recorded_prompts
from kvcal.runtime.storage.bases import served_bases

# The stages of choosing, in order, and what each measures (the progress bar's names for them)
STAGES = {"record": "quality model", "probe": "budget probes", "step": "moves alone", "gauge": "evaluation, coded",
          "confirm": "evaluation text"}
# (stage, label, point): a step of a stage in `STAGES` starts (point None) or a measurement ended (point: its row);
# ("plan", label, {stage: steps}): a stage's planned count, revised once known
Progress = Callable[[str, str, dict | None], None]


def planned_steps(cfg) -> dict[str, int]:
    """Steps of each stage, known before the first: recording windows, probes, moves, gauges and checks (at most)."""
    return {"record": cfg.search_windows, "probe": 2 * cfg.max_probes if cfg.step_probes else cfg.max_probes,
            "step": cfg.step_probes, "gauge": cfg.max_gauges, "confirm": cfg.max_checks}


def path_probes(moves: int, most: int) -> int:
    """Probes that bisect a path of `moves` points (a bisection's count, at most `most`)."""
    return min(math.ceil(math.log2(moves + 1)), most)


def _row(stage: str, index: int | None, label: str, config, fid: dict, met: bool, seconds: float, allocation) -> dict:
    """A measured point as the report lists it (`index`: its place among the candidates bisected; None for a
    move measured alone)."""
    return {"stage": stage, "index": index, "label": label, "settings": config.to_dict(),
            "predicted_loss": allocation.predicted, "held_bytes": allocation.held_bytes,
            "bytes_ratio": fid["memory"]["ratio_to_fp16"], "top1": fid["top1"],
            "kl": fid["kl"], "ppl_ratio": fid["ppl_ratio"], "predictions": fid["predictions"],
            "top1_windows": fid.get("top1_windows", []), "feasible": met, "seconds": round(seconds, 1)}


def _record(lm, windows: torch.Tensor, P: int, served, base, step: Progress, prefill_dtype: torch.dtype | None):
    """The search's recording of windows [n, P + M + 1] (kvcal.profile.recording), one progress step per window,
    the prompts prefilled in `prefill_dtype`."""
    t, M = time.perf_counter(), windows.shape[1] - P - 1

    def recorded(b: int, done: bool) -> None:
        if done:
            release_memory()                # one window's float32 K/V and gradients, freed
            step("record", f"window {b + 1}", {"seconds": time.perf_counter() - t})
        else:
            step("record", f"recording window {b + 1}/{len(windows)} ({P} + {M} tokens: prefill, continuation "
                 "forward and backward)", None)

    a = lm.adapter
    recording = record_search(lm.model, windows[:, :P], windows[:, P:], served, base, list(a.layer_types),
                              a.head_dim, on_window=recorded, prefill_dtype=prefill_dtype)
    release_memory()
    return recording


def evaluation_probes(lm, bundle, cfg, P: int, M: int, served, base, levels: dict, pick: list[int] | None = None,
                      prefill_dtype: torch.dtype | None = None):
    """The evaluation windows recorded once for both of the confirmation's measurements: (the runtime's stepwise
    check, `DecodeProbe`; its gauge, the coded probe over the same recorded prompts). `pick`: only these of them
    (experiments that look at one document). `prefill_dtype`: the prompts' (`DecodeProbe`)."""
    a = lm.adapter
    windows = token_windows(lm.tokenizer, load_corpus(cfg.dataset, "eval"), cfg.eval_windows,
                            P + (cfg.eval_steps or M) + 1, cfg.seed + 2, long_first=True)
    windows = windows if pick is None else windows[pick]
    held = HeldTokens(lm.model, base, list(a.layer_types), len(windows))
    check = DecodeProbe(lm.model, bundle, windows[:, :P], windows[:, P:], tokenizer=lm.tokenizer,
                        on_window=release_memory, on_reference=held.capture, prefill_dtype=prefill_dtype)
    recorded = recorded_prompts(check.prompt, check.continuation, check.records, check.ref, held, levels)
    return check, CodedProbe(lm.model, recorded, served, base, list(a.layer_types), a.head_dim)


def measuring_in(model, dtype: torch.dtype) -> Callable[[], None]:
    """Cast `model` to `dtype` for measuring; returns the call that casts it back as it was. Its buffers (rotary
    frequencies, embedding scales) are put back as they were rather than cast there and back: a cast to bf16 would
    round float32 RoPE frequencies, and the caller's model would attend at the wrong angles after calibration."""
    before, buffers = model.dtype, dict(model.named_buffers())
    model.to(dtype)

    def restore() -> None:
        model.to(before)
        for name, buffer in buffers.items():
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, buffer)
    return restore


def choose_settings(lm, bundle, cfg, checkpoint, say: Callable[[str], None], progress: Progress | None = None, *,
                    prompt: int) -> dict:
    """Choose `bundle`'s settings (module docstring); sets its settings, ranks and calibration metadata in place and
    returns the report's content."""
    step = progress or (lambda stage, label, point: None)
    target = QualityTarget(cfg.target_top1, cfg.target_ppl_ratio, cfg.target_z, cfg.target_predictions)
    P, M = prompt, cfg.search_steps
    windows = token_windows(lm.tokenizer, load_corpus(cfg.dataset, "search"), cfg.search_windows, P + M + 1,
                            cfg.seed + 1, long_first=True)
    model_dtype, placed = lm.model.dtype, getattr(lm.model, "hf_device_map", None) is not None
    # an offloaded model stays as accelerate placed it
    restore = (lambda: None) if placed else measuring_in(lm.model, DTYPES[cfg.search_dtype])
    a = lm.adapter
    base = base_settings(list(a.layer_types), window=cfg.window, head_dim=a.head_dim)
    seconds = {}

    t = time.perf_counter()
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base,
                          bundle.extras.get("qk.smoothing"))
    recording = _record(lm, windows, P, served, base, step, model_dtype)
    costs = recording.costs
    if recording.levels:                    # the levels the allocation's formats decode with
        bundle.extras.update(bundle_levels(recording.levels, len(a.layer_types), served.rotation.shape[1]))
    seconds["recording"] = time.perf_counter() - t
    t = time.perf_counter()
    hull = frontier(costs)
    seconds["allocation"] = time.perf_counter() - t
    say(f"quality model: {len(hull)} allocations on the frontier, from {hull[0].held_bytes / 1e6:.1f} MB to "
        f"{hull[-1].held_bytes / 1e6:.1f} MB at the deployment context")

    memo = checkpoint.load_probes()
    rows: list[dict] = []
    candidates, split = hull, len(hull)     # what the budget bisects; past `split`, the measured path

    def label(i: int) -> str:
        return f"hull point {i}" if i <= split else f"path point {i - split}"

    def run_once(stage: str, name: str, allocation, run: Callable[[object], object], index: int | None) -> dict:
        config = to_config(base, costs, allocation)
        key = json.dumps([stage, config.to_dict()], sort_keys=True)
        step(stage, f"{name} ({'search' if stage in ('probe', 'step') else 'evaluation'} text)", None)
        t0 = time.perf_counter()
        if key not in memo:
            memo[key] = asdict(run(config))
            checkpoint.save_probes(memo)
            release_memory()
        fid = memo[key]
        rows.append(_row(stage, index, name, config, fid, target.met(fid), time.perf_counter() - t0,
                         allocation))
        say(f"  {stage:8} {name:28} predicted {allocation.predicted:9.3g}  bytes {rows[-1]['bytes_ratio']:.3f}  "
            f"top-1 {fid['top1']:.3f}  ppl {fid['ppl_ratio']:.3f}  {'meets' if rows[-1]['feasible'] else 'misses'}")
        step(stage, name, rows[-1])
        return fid

    def measured(stage: str, run: Callable[[int, object], object]) -> Callable[[int], dict]:
        return lambda i: run_once(stage, label(i), candidates[i], lambda config: run(i, config), i)

    t = time.perf_counter()
    probe = CodedProbe(lm.model, recording, served, base, list(a.layer_types), a.head_dim)
    on_search = measured("probe", lambda i, config: probe.measure(costs, candidates[i]))
    index, searched = bisect(len(hull), on_search, target, cfg.max_probes, [h.predicted for h in hull],
                             [h.held_bytes for h in hull])
    moves, plan = _moves_past(hull, index, searched, cfg)
    step("plan", "the moves past the bisection's point", plan)
    if moves:
        path, known = _along_moves(costs, hull, index, searched, moves[:cfg.step_probes], moves, target,
                                   lambda m, x: run_once("step", str(m), x, lambda config: probe.measure(costs, x),
                                                         None))
        candidates, split = hull[:index + 1] + path, index
        for r in rows:          # probed hull points past the split are not among the candidates now
            r["index"] = None if r["index"] is not None and r["index"] > split else r["index"]
        index, searched = bisect(len(candidates), on_search, target, path_probes(len(path), cfg.max_probes),
                                 [c.predicted for c in candidates], [c.held_bytes for c in candidates], known)
    levels = recording.levels
    probe = recording = None        # the recorded prompts: hundreds of MB
    release_memory()
    seconds["probes"] = time.perf_counter() - t

    t = time.perf_counter()
    eval_probe, gauge = evaluation_probes(lm, bundle, cfg, P, M, served, base, levels, prefill_dtype=model_dtype)
    index, checks = confirm(max(index, 0), searched,
                            measured("confirm", lambda i, config: eval_probe.measure(config)),
                            target, cfg.max_checks,
                            measured("gauge", lambda i, config: gauge.measure(costs, candidates[i])), cfg.max_gauges,
                            [c.predicted for c in candidates], [c.held_bytes for c in candidates])
    eval_probe = gauge = None
    checks = [p for p in checks if p.split == "evaluation"]          # the runtime's own: gauges only led to them
    seconds["confirmation"] = time.perf_counter() - t

    chosen = to_config(base, costs, candidates[index])
    held_out = next(p.fidelity for p in reversed(checks) if p.index == index)
    bundle.qk_rank, bundle.v_rank = ranks_of(bundle, chosen)
    bundle.settings = chosen.to_dict()
    search_meta = _search_meta(cfg, target, P, M, model_dtype, base, hull, candidates[split + 1:], split, rows,
                               any(p.met and p.index == index for p in checks), index, seconds)
    bundle.calibration["context"] = P + M + 1
    bundle.calibration["search"] = {**{k: v for k, v in search_meta.items() if k != "quality_model"},
                                    "held_out": _brief(held_out)}
    restore()
    return {"search": search_meta, "held_out": held_out}


def _moves_past(hull: list[Allocation], index: int, searched: list[Probe], cfg) -> tuple[list[Step], dict]:
    """The hull's moves past its point `index` where the hull is too coarse there (`budget.coarse`; none elsewhere),
    and the steps they add to the plan: the first `cfg.step_probes` measured alone, and a bisection of the path."""
    coarse_here = cfg.step_probes > 0 and coarse(index, searched, [h.held_bytes for h in hull])
    moves = hull_steps(hull, index) if coarse_here else []
    return moves, {"step": min(cfg.step_probes, len(moves)),
                   "probe": len(searched) + (path_probes(len(moves), cfg.max_probes) if moves else 0)}


def _along_moves(costs, hull: list[Allocation], index: int, searched: list[Probe], measured: list[Step],
                 moves: list[Step], target: QualityTarget, measure: Callable[[Step, Allocation], dict]
                 ) -> tuple[list[Allocation], list[Probe]]:
    """The path past hull[index] (`allocate.measured_path`) with `measured`, the first of `moves`, each measured alone
    on it (`measure(move, allocation)`: a Fidelity as a dict), and the probes known on hull[:index + 1] + path: the
    search's up to `index`, and the path's first point where it is a move measured alone."""
    start = hull[index]
    alone = [m.alone(costs, start) for m in measured]
    fids = [measure(m, x) for m, x in zip(measured, alone)]
    at_start = next(p.fidelity for p in searched if p.index == index)
    # measured KL is a mean over the probe's predictions; the table's loss is their sum
    added = [(f["kl"] - at_start["kl"]) * f["predictions"] for f in fids] + [None] * (len(moves) - len(fids))
    path = measured_path(costs, start, moves, added)
    known = [p for p in searched if p.index <= index]
    first = next((j for j, x in enumerate(alone) if x.bits.equal(path[0].bits)), None)
    if first is not None:
        known.append(Probe(index + 1, "search", fids[first], target.met(fids[first])))
    return path, known


def _search_meta(cfg, target: QualityTarget, P: int, M: int, model_dtype, base, hull: list[Allocation],
                 path: list[Allocation], split: int, rows: list[dict], met: bool, index: int, seconds: dict) -> dict:
    """The report's account of the search: its target and probe, the hull and the path past `split`, every
    measured row, the decision at candidate `index` (`met`: its check met) and where the time went."""
    return {
        "target": target.to_dict(),
        "probe": {"windows": cfg.search_windows, "prompt": P, "steps": M, "probe": "coded",
                  "context": P + M + 1, "split": "search", "dtype": cfg.search_dtype,
                  "prefill_dtype": str(model_dtype).removeprefix("torch.")},
        "quality_model": {"hull": [_point(h) for h in hull], "base": base.to_dict(),
                          "path": {"from": split, "points": [_point(h) for h in path]}},
        "chosen": next(r for r in reversed(rows) if r["index"] == index and r["stage"] == "confirm"),
        "path": rows,
        "decision": {"checks": [r for r in rows if r["stage"] == "confirm"], "met": met,
                     "met_at_bounds": met, "accepted_anyway": not met and cfg.accept_best},
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }


def _point(a: Allocation) -> dict:
    return {"predicted_loss": a.predicted, "held_bytes": a.held_bytes, "bits": a.bits.tolist(), "high": HIGH[a.high],
            "alpha_high": ALPHAS[a.alpha]}


def _brief(fid: dict) -> dict:
    return {"bytes_ratio": fid["memory"]["ratio_to_fp16"], "top1": fid["top1"], "ppl_ratio": fid["ppl_ratio"],
            "kl": fid["kl"], "predictions": fid["predictions"], "top1_windows": fid.get("top1_windows", [])}
