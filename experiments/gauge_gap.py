"""Where the runtime's check and its gauge part: one bundle's settings on the calibration's evaluation windows.

    python experiments/gauge_gap.py --bundle artifacts/smollm2-135m.kvcal.safetensors [--model smollm2-135m]
        [--windows 4 --prompt 3839 --steps 256] [--pick 2] [--hull-point N] [--only gauge,runtime]
        [--json docs/results/gauge-gap-smollm2-135m.json]

The windows, the recorded prompts and the held tokens are the confirmation's (`choose.evaluation_probes`: evaluation
text, seed + 2, the longest documents first). Measured at the bundle's settings:

- `gauge`: the coded probe over the recorded prompts (what `kvcal calibrate` gauges a point with);
- `runtime`: the runtime's stepwise check (`DecodeProbe`, what it confirms with);
- both again with a 16-bit high tier (`gauge (high K16V16)`, `runtime (high K16V16)`): the window is then exact;
- both again with the window held exact outside the pages (`gauge (exact window)`, `runtime (exact window)`:
  `CompressionConfig.exact_window`, the heavy hitters still in the high tier's format);
- the runtime with its decode-time seals restricted, to see what the low pages written during decode cost:
  `no decode seals` (tokens that become low during decode stay in the high tier), `prompt tokens only` (the prompt's
  heavy hitters demoted during decode are sealed, the continuation's tokens are not) and `continuation tokens only`.
  The policy's `_seal_pending` is wrapped for these: slots it must not seal are shown to it as empty;
- the key coding error of the pages the runtime sealed during decode (a replay of the prefill, then the continuation
  decoded under capture; relative squared error in the served basis), as sealed and with the same tokens re-paged in
  position order per KV head.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from kvcal.eval.fidelity import teacher_force
from kvcal.models import load_model
from kvcal.profile.allocate import Allocation, base_settings
from kvcal.profile.calibrate import CalibrationConfig
from kvcal.profile.choose import evaluation_probes
from kvcal.profile.quality_model import ALPHAS, HIGH, coded_keys
from kvcal.profile.ranks import ranks_of
from kvcal.profile.report import report_paths
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.policies.diffkv import DiffKVTiers
from kvcal.runtime.storage.bases import served_bases
from kvcal.runtime.storage.layout import TierFormat
from kvcal.runtime.storage.store import CompressedStore


def allocation_of(config: CompressionConfig, layer_types: list[str], H: int) -> Allocation:
    """The allocation (bits per layer, KV head and side; high tier; threshold) a bundle's settings serve."""
    bits = torch.zeros(len(layer_types), H, 2, dtype=torch.long)
    for layer, kind in enumerate(layer_types):
        for h in range(H):
            fmt = config.sliding_of(layer) if kind == "sliding_attention" else config.low_of(layer, h)
            bits[layer, h] = torch.tensor([fmt.k_bits, fmt.v_bits])
    high = [TierFormat.parse(h) for h in HIGH].index(config.high)
    return Allocation(bits, 0.0, 0.0, high, ALPHAS.index(int(config.tiering.alpha_high)))


def bundle_levels_by_layer(bundle, layer_types: list[str], H: int) -> dict:
    """The bundle's calibrated levels as the quality model holds them: paged layer -> {(side, bits): [H, 2**bits]}
    (the uniform grid where the bundle has none: calibrated without the search)."""
    def rows(side: str, bits: int, layer: int) -> torch.Tensor:
        t = bundle.extras.get(f"levels.{side}.{bits}")
        return t[layer] if t is not None else torch.arange(1 << bits, dtype=torch.float32).repeat(H, 1)

    return {layer: {(side, bits): rows(side, bits, layer) for side in "kv" for bits in (2, 4)}
            for layer, kind in enumerate(layer_types) if kind != "sliding_attention"}


@contextmanager
def seals_only(keep):
    """The DiffKV policy seals only high slots whose position passes `keep(pos)`; the others look empty to it."""
    seal = DiffKVTiers._seal_pending

    def restricted(self, layer, b, h, length, hi_s, hi_p, taus=None):
        return seal(self, layer, b, h, length, hi_s, torch.where(keep(hi_p), hi_p, torch.full_like(hi_p, -1)), taus)

    DiffKVTiers._seal_pending = restricted
    try:
        yield
    finally:
        DiffKVTiers._seal_pending = seal


@contextmanager
def sealed_pages(into: list):
    """Every low page the store writes while inside: (layer, sequences [n], KV heads [n], keys [n, T, r], positions
    [n, T])."""
    write = CompressedStore.write_pages

    def capture(self, layer, b, h, keys, values, pos, score):
        into.append((layer, b.clone(), h.clone(), keys.float().clone(), pos.clone()))
        return write(self, layer, b, h, keys, values, pos, score)

    CompressedStore.write_pages = capture
    try:
        yield
    finally:
        CompressedStore.write_pages = write


def key_errors(pages: list, config: CompressionConfig, levels: dict) -> dict:
    """Relative squared key error of the pages `sealed_pages` caught, as sealed and with the same tokens re-paged in
    position order per (sequence, layer, KV head)."""
    entries: dict = {}
    for layer, b, h, keys, pos in pages:
        for e in range(len(h)):
            entries.setdefault((layer, int(b[e]), int(h[e])), []).append((keys[e], pos[e]))
    err, total, tokens = {"as sealed": 0.0, "re-paged by position": 0.0}, 0.0, 0
    for (layer, _, h), rows in entries.items():
        k, p = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        fmt = config.low_of(layer, h)
        lut = levels.get(layer, {}).get(("k", fmt.k_bits)) if fmt.k_levels == "calibrated" else None
        lut = None if lut is None else lut[h:h + 1]
        for name, keys in (("as sealed", k), ("re-paged by position", k[p.argsort()])):
            err[name] += float(((coded_keys(keys[None], fmt, rows[0][0].shape[0], lut)[0] - keys) ** 2).sum())
        total, tokens = total + float((k ** 2).sum()), tokens + len(p)
    return {name: e / max(total, 1e-30) for name, e in err.items()} | {"tokens": tokens}


ROWS = ("gauge", "runtime", "gauge (high K16V16)", "runtime (high K16V16)", "gauge (exact window)",
        "runtime (exact window)", "no decode seals", "prompt tokens only", "continuation tokens only")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bundle", required=True, help="a bundle of --model; its settings are measured (without them, "
                    "as calibrated with --no-search: the allocation's frame at 4 bits)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=3839)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0, help="the calibration's seed (its evaluation windows use seed + 2)")
    ap.add_argument("--pick", help="comma-separated indices of the evaluation windows to measure (default: all)")
    ap.add_argument("--hull-point", type=int, help="measure the settings of this hull point from the bundle's report "
                    "(<bundle>.report.json, its last row with that index) instead of the bundle's own")
    ap.add_argument("--only", help="comma-separated rows to measure (default: all, then the decode-time page key "
                    "error, which --only skips), e.g. 'gauge,runtime'")
    ap.add_argument("--json")
    args = ap.parse_args()
    only = args.only.split(",") if args.only else list(ROWS)
    if unknown := set(only) - set(ROWS):
        raise SystemExit(f"--only: no row {sorted(unknown)[0]!r}; the rows are {', '.join(ROWS)}")
    lm = load_model(args.model, dtype="float32")
    model, a, bundle = lm.model, lm.adapter, load_bundle(args.bundle)
    layer_types, P, M = list(a.layer_types), args.prompt, args.steps
    config = CompressionConfig.from_dict(bundle.settings)
    if args.hull_point is not None:
        report = json.loads(report_paths(Path(args.bundle))["json"].read_text())
        rows = [r for r in report["search"]["path"] if r["index"] == args.hull_point]
        if not rows:
            raise SystemExit(f"--hull-point {args.hull_point}: the report measured no such point")
        config = CompressionConfig.from_dict(rows[-1]["settings"])
    elif "search" not in bundle.calibration:      # calibrated without the search: the allocation's frame, uniform codes
        config = base_settings(layer_types).with_(low=TierFormat.parse("K4cV4m8"))
    base = base_settings(layer_types)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, *ranks_of(bundle, base), base,
                          bundle.extras.get("qk.smoothing"))
    levels = bundle_levels_by_layer(bundle, layer_types, a.num_kv_heads)
    cfg = CalibrationConfig(model=args.model, seed=args.seed, eval_windows=args.windows, search_steps=M)
    pick = [int(i) for i in args.pick.split(",")] if args.pick else None
    check, gauge = evaluation_probes(lm, bundle, cfg, P, M, served, base, levels, pick)
    gauge.modelled_ratio = lambda costs, allocation: 0.0      # not reported: the runtime's rows count the bytes
    high16 = config.with_(high=TierFormat(16, 16))

    def gauged(exact: bool, settings: CompressionConfig):
        """The gauge reading the window as `settings` serve it (exact, or in the high tier's format)."""
        gauge.base = base.with_(exact_window=exact)
        return gauge.measure(None, allocation_of(settings, layer_types, a.num_kv_heads))

    runs = {
        "gauge": lambda: gauged(config.exact_window, config),
        "runtime": lambda: check.measure(config),
        "gauge (high K16V16)": lambda: gauged(config.exact_window, high16),
        "runtime (high K16V16)": lambda: check.measure(high16),
        "gauge (exact window)": lambda: gauged(True, config),
        "runtime (exact window)": lambda: check.measure(config.with_(exact_window=True)),
        "no decode seals": lambda: _with(seals_only(lambda pos: torch.zeros_like(pos, dtype=torch.bool)),
                                         lambda: check.measure(config)),
        "prompt tokens only": lambda: _with(seals_only(lambda pos: pos < P), lambda: check.measure(config)),
        "continuation tokens only": lambda: _with(seals_only(lambda pos: pos >= P), lambda: check.measure(config)),
    }
    assert list(runs) == list(ROWS)
    runs = {name: run for name, run in runs.items() if name in only}
    rows = []
    for name, run in runs.items():
        t = time.perf_counter()
        fid = run()
        rows.append({"measured": name, "top1": fid.top1, "kl": fid.kl, "ppl_ratio": fid.ppl_ratio,
                     "top1_windows": fid.top1_windows,
                     "bytes_ratio": None if name.startswith("gauge") else fid.memory["ratio_to_fp16"],
                     "seconds": round(time.perf_counter() - t, 1)})
        print(json.dumps(rows[-1]), flush=True)
    errors = None if args.only else decode_page_key_errors(check, config, levels, model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "bundle": args.bundle, "hull_point": args.hull_point,
                       "windows": args.windows, "pick": pick, "prompt": P, "steps": M, "rows": rows,
                       "decode_page_key_error": errors}, f, indent=1)


def decode_page_key_errors(check, config: CompressionConfig, levels: dict, model) -> dict:
    """`key_errors` of the pages the runtime seals while decoding the check's continuation."""
    pages: list = []
    cache = check.replay(config)             # the prefill's pages are written here, outside the capture
    with sealed_pages(pages), torch.inference_mode():
        teacher_force(model, cache, check.continuation, on_logits=lambda t, logits: None)
    cache.release()
    errors = key_errors(pages, config, levels)
    print(json.dumps({"decode-time page key error": errors}), flush=True)
    return errors


def _with(context, run):
    with context:
        return run()


if __name__ == "__main__":
    main()
