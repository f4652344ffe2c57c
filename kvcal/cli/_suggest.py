"""Bundle paths as users type them: the one resolver that `inspect`, `bench` and `export` share, and suggestions for a
mistyped path. Existing bundles whose names are closest come before the advice to calibrate, which takes minutes, and
that advice only ever names a bundle file (`*.kvcal.safetensors`)."""

from __future__ import annotations

import difflib
import itertools
import os
from pathlib import Path

import kvcal
from kvcal.models import DEFAULT_MODEL, PACKAGED_MODELS

BUNDLE_SUFFIX = ".safetensors"
BUNDLE_EXT = ".kvcal.safetensors"    # what `kvcal calibrate` writes; its report files share the stem
MAX_ENTRIES = 2000        # files looked at per folder: a suggestion must stay instant, even in a huge folder


def bundle_stem(name: str) -> str:
    """The name a bundle and its report share: 'x.kvcal.safetensors', 'x.kvcal.report.md', 'x.kvcal',
    'x.safetensors' and 'x' all give 'x' (other dots stay: 'qwen2.5-coder' is a model name, not a suffix)."""
    if name.endswith(".kvcal"):
        return name[:-len(".kvcal")]
    if ".kvcal." in name:
        return name[:name.rindex(".kvcal.")]
    return name.removesuffix(BUNDLE_SUFFIX)


def resolve_bundle(path: Path) -> Path:
    """The bundle file `path` names: `path` itself, or for a missing `X` (or `X.kvcal`), the `X.kvcal.safetensors`
    beside it, said on stderr. ValueError with a one-line message (suggestions first) when there is none."""
    if path.is_file():
        if not path.name.endswith(BUNDLE_SUFFIX) and ".kvcal." in path.name:
            beside = path.with_name(bundle_stem(path.name) + BUNDLE_EXT)
            if beside.is_file():        # a report of a bundle, e.g. `x.kvcal.report.md`: the bundle is what is read
                raise ValueError(f"`{path}` is a report, not a bundle; pass its bundle `{shown_path(beside)}`")
        return path
    if not path.exists() and not path.name.endswith(BUNDLE_SUFFIX):
        beside = path.with_name(bundle_stem(path.name) + BUNDLE_EXT)
        if beside.is_file():
            from kvcal.cli._console import stderr
            from kvcal.cli._errors import plain

            stderr.print(f"no file `{plain(str(path))}`: using `{plain(str(beside))}`", style="dim", highlight=False,
                         soft_wrap=True)
            return beside
    raise ValueError(missing_bundle(path))


def shipped_bundle(model: str) -> Path | None:
    """An existing bundle for `model` (a packaged name, .gguf or model folder), where `kvcal calibrate` writes it by
    default (the current folder) or where the clone ships it (`artifacts/`, looked up from the current folder, then
    from the clone that holds this package); None when there is none."""
    name = bundle_stem(Path(model).name.removesuffix(".gguf")) + BUNDLE_EXT
    clone = Path(kvcal.__file__).resolve().parents[1]
    for folder in (Path("."), Path("artifacts"), clone / "artifacts"):
        if (folder / name).is_file():
            return folder / name
    return None


def _candidates(folder: Path) -> list[Path]:
    """Bundles (`*.safetensors`) in `folder` and in its direct, non-hidden subfolders."""
    out: list[Path] = []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)[:MAX_ENTRIES]
    except OSError:
        return out
    for e in entries:
        if e.name.startswith("."):
            continue
        try:
            if e.is_file() and e.name.endswith(BUNDLE_SUFFIX):
                out.append(Path(e.path))
            elif e.is_dir():
                with os.scandir(e.path) as sub:
                    for i, f in enumerate(sub):
                        if i >= MAX_ENTRIES:
                            break
                        if f.name.endswith(BUNDLE_SUFFIX) and not f.name.startswith(".") and f.is_file():
                            out.append(Path(f.path))
        except OSError:
            continue
    return out


def similar_bundles(path: Path, n: int = 3) -> list[Path]:
    """Existing bundles that `path` (which is no bundle) most likely means: the same name in a subfolder first, then
    names close to it, looked up from `path` when it is a folder, else from the nearest existing folder of `path`.
    Names are compared by their stems, so `x`, `x.kvcal.report.md` and `x.kvcal.safetensors` all match
    `x.kvcal.safetensors`."""
    if path.is_dir():
        found = _candidates(path)
    else:
        folder = path.parent
        while not folder.is_dir() and folder != folder.parent:
            folder = folder.parent
        found = _candidates(folder if folder.is_dir() else Path("."))
    stem = bundle_stem(path.name)
    same = [p for p in found if bundle_stem(p.name) == stem]
    stems = sorted({bundle_stem(p.name) for p in found})
    close = difflib.get_close_matches(stem, stems, n=n, cutoff=0.6)
    ranked = same + [p for s in close for p in found if bundle_stem(p.name) == s and p not in same]
    return (ranked or (found if path.is_dir() else []))[:n]


def missing_bundle(path: Path) -> str:
    """One-line error for a path that holds no bundle: similar existing bundles first, then how to make one."""
    if path.is_dir():
        return _folder_not_bundle(path)
    guesses = similar_bundles(path)
    what = f"no bundle at `{path}`"
    make = f"`{calibrate_command(path)}`"
    if guesses:
        listed = " or ".join(f"`{shown_path(p)}`" for p in guesses)
        return f"{what}; did you mean {listed}? (otherwise create one with {make})"
    return f"{what}; create one with {make}"


def _folder_not_bundle(path: Path) -> str:
    """A folder given where a bundle file goes (even one named `x.kvcal.safetensors`): the kvcal bundles inside it,
    if any (other files there, such as a model's weights, are no suggestion), else how to write one into it."""
    from kvcal.runtime.bundle import is_kvcal_bundle

    inside = list(itertools.islice((p for p in _candidates(path) if is_kvcal_bundle(p)), 3))
    what = f"`{path}` is a folder, not a bundle file"
    if inside:
        return f"{what}; pass a bundle inside it: {' or '.join(f'`{shown_path(p)}`' for p in inside)}"
    return f"{what}, and holds no bundle; pass a bundle file, or write one into it with `{calibrate_command(path)}`"


def calibrate_command(path: Path) -> str:
    """The `kvcal calibrate` that writes a bundle the user meant by `path`, with `--out` always a bundle name: the
    stem of `path` (`x.kvcal.report.md` -> `x.kvcal.safetensors`), or in a folder the default model's bundle; and
    `--model` when the stem is another packaged model's name."""
    if path.is_dir():
        return f"kvcal calibrate --out {path / (DEFAULT_MODEL + BUNDLE_EXT)}"
    stem = bundle_stem(path.name)
    model = f"--model {stem} " if stem in PACKAGED_MODELS and stem != DEFAULT_MODEL else ""
    return f"kvcal calibrate {model}--out {path.with_name(stem + BUNDLE_EXT)}"


def shown_path(p: Path) -> str:
    """A path as the user would type it: relative to the current folder when it is below it."""
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)
