"""docs/results/: one page per packaged model, `kvcal bench` on the model's shipped bundle. This one command
regenerates them all:

    python experiments/results_pages.py                                  # every packaged model, the full bench
    python experiments/results_pages.py --models smollm2-135m -- --quick  # one model; after `--`: bench arguments
    python experiments/results_pages.py --render                         # reword the pages from their JSON

For each model, in this process, from the clone's root: `kvcal bench -m MODEL -b BUNDLES/MODEL.kvcal.safetensors
-o bench-MODEL --overwrite [ARGS]` (bench-*/ is git-ignored there), then its report copied flat into `--out`:
MODEL.md (the plot links renamed), MODEL.json, MODEL-pareto.png and MODEL-decode_time.png, replacing the last ones.
`--render` runs nothing: it recomputes each page's summary from its JSON and rewrites MODEL.md and MODEL.json, after
a change to how a report says what it measured (the measurements, the command and its date stay the page's own).
A model without a bundle is skipped with the command that makes one (exit status 1), or calibrated first with
`--calibrate-missing` (`kvcal calibrate -m MODEL --out BUNDLES/MODEL.kvcal.safetensors`, its report next to it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ("pareto.png", "decode_time.png")


def kvcal(*args: str) -> None:
    """`kvcal ARGS` from the clone's root, in this process (the bench records `sys.argv` as its command line)."""
    from kvcal.cli import main

    argv, cwd = sys.argv, os.getcwd()
    sys.argv = ["kvcal", *args]
    os.chdir(ROOT)
    try:
        main()
    except SystemExit as e:
        if e.code not in (None, 0):
            raise SystemExit(f"`kvcal {' '.join(args)}` failed (exit status {e.code})") from None
    finally:
        sys.argv = argv
        os.chdir(cwd)


def flat_links(md: str, name: str) -> str:
    """A report's markdown with its plot links renamed for the flat folder (NAME-pareto.png, ...)."""
    for plot in PLOTS:
        md = md.replace(f"]({plot})", f"]({name}-{plot})")
    return md


def bench_page(model: str, bundle: Path, work: Path, out: Path, extra: list[str]) -> list[Path]:
    """Run `kvcal bench` for `model` into work/bench-NAME and copy its report into `out` as NAME.*; returns the
    files written."""
    name = Path(model).name
    folder = work / f"bench-{name}"
    kvcal("bench", "-m", model, "-b", str(bundle), "-o", str(folder), "--overwrite", *extra)
    folder = folder if folder.is_absolute() else ROOT / folder
    out.mkdir(parents=True, exist_ok=True)
    md = flat_links((folder / "bench.md").read_text(), name)
    for plot in PLOTS:
        (out / f"{name}-{plot}").write_bytes((folder / plot).read_bytes())
    report = json.loads((folder / "bench.json").read_text())
    report["outputs"] = {"json": f"{name}.json", "md": f"{name}.md", "pareto_png": f"{name}-pareto.png",
                         "decode_png": f"{name}-decode_time.png"}
    (out / f"{name}.md").write_text(md)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    return [out / f"{name}.md", out / f"{name}.json", *(out / f"{name}-{plot}" for plot in PLOTS)]


def render_page(name: str, out: Path) -> list[Path]:
    """Rewrite NAME.md and NAME.json in `out` from NAME.json, the summary recomputed; returns the files written."""
    from kvcal.bench.report import markdown, summarise

    path = out / f"{name}.json"
    report = json.loads(path.read_text())
    report["summary"] = summarise(report)
    (out / f"{name}.md").write_text(flat_links(markdown(report), name))
    path.write_text(json.dumps(report, indent=2) + "\n")
    return [out / f"{name}.md", path]


def main() -> None:
    from kvcal.models.sources import PACKAGED_MODELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(PACKAGED_MODELS), help="packaged names or model folders")
    ap.add_argument("--bundles", type=Path, default=Path("artifacts"),
                    help="folder of MODEL.kvcal.safetensors (relative to the clone's root)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results", help="folder of the pages")
    ap.add_argument("--work", type=Path, default=Path("."),
                    help="where bench-MODEL/ folders go (relative to the clone's root, where they are git-ignored)")
    ap.add_argument("--calibrate-missing", action="store_true",
                    help="calibrate a model that has no bundle in --bundles (default: skip it)")
    ap.add_argument("--render", action="store_true",
                    help="run nothing: rewrite each page (MODEL.md, MODEL.json in --out) from its JSON")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)       # after `--`: more `kvcal bench` arguments
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1:]

    if args.render:
        for model in args.models:
            for path in render_page(Path(model).name, args.out):
                print(f"  {path}", flush=True)
        return
    missing = []
    for model in args.models:
        bundle = args.bundles / f"{Path(model).name}.kvcal.safetensors"
        if not (bundle if bundle.is_absolute() else ROOT / bundle).is_file():
            make = ["calibrate", "-m", model, "--out", str(bundle)]
            if not args.calibrate_missing:
                print(f"{model}: no bundle at {bundle}; make one with `kvcal {' '.join(make)}` or pass "
                      "--calibrate-missing", flush=True)
                missing.append(model)
                continue
            kvcal(*make)
        for path in bench_page(model, bundle, args.work, args.out, extra):
            print(f"  {path}", flush=True)
    if missing:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
