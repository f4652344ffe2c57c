"""Small things that each cost a newcomer minutes: what `inspect` says an unsearched bundle stores, bundle paths typed
without their extension, suggestions that only ever name a bundle file, `bench` pointing at the bundle the clone
ships, what the README says git ignores, plain output without padding or boxes, and the progress bars in docs/cli.md.
(The quiet CUDA build is tested in tests/test_cuda_build.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcal.cli import app
from kvcal.cli._suggest import bundle_stem, calibrate_command

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "artifacts" / "smollm2-135m.kvcal.safetensors"
BOX_DRAWING = re.compile("[\u2500-\u257f]")
runner = CliRunner()


def _line(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def unsearched_bundle(tmp_path):
    """A bundle as `kvcal calibrate --no-search` writes it: its settings block records the window only."""
    from conftest import make_model, random_bundle

    from kvcal.runtime.bundle import save_bundle
    from kvcal.runtime.config import CompressionConfig

    model, tok = make_model()
    b = random_bundle(model, tok)
    b.settings = CompressionConfig().with_tiering(window=24).to_dict(searched=False)
    path = tmp_path / "plain.kvcal.safetensors"
    save_bundle(b, path)
    return path


# --------------------------------------------------------------------------------------------- what is stored


def test_inspect_names_the_default_settings_an_unsearched_bundle_is_served_with(unsearched_bundle):
    from kvcal.runtime.config import CompressionConfig

    r = runner.invoke(app, ["inspect", str(unsearched_bundle)], env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    served = CompressionConfig.from_dict({"window": 24})         # what the runtime reads the block as
    stored = _line(r.stdout)
    stored = stored[stored.index("stored"):stored.index(" size ")]
    assert served.high.name in stored and served.low.name in stored, stored
    assert f"window of {served.tiering.window} tokens" in stored and "runtime's defaults" in stored, stored


# --------------------------------------------------------------------------------------------- bundle paths


def test_a_bundle_path_without_its_extension_finds_the_bundle_beside_it(tmp_path, monkeypatch):
    shutil.copyfile(ARTIFACT, tmp_path / "smollm2-135m.kvcal.safetensors")
    monkeypatch.chdir(tmp_path)
    for typed in ("smollm2-135m", "smollm2-135m.kvcal"):
        r = runner.invoke(app, ["inspect", typed], env={"COLUMNS": "100"})
        assert r.exit_code == 0, r.output
        assert r.stdout.startswith("bundle smollm2-135m.kvcal.safetensors: smollm2-135m"), r.stdout
        assert f"no file `{typed}`: using `smollm2-135m.kvcal.safetensors`" in _line(r.stderr)
    r = runner.invoke(app, ["export", "smollm2-135m", "--format", "manifest", "--out", "m"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "m" / "manifest.json").is_file()
    # bench resolves the bundle before it loads the model (which fails here: only the resolution is checked)
    r = runner.invoke(app, ["bench", "--bundle", "smollm2-135m", "--model", str(tmp_path / "no-model")])
    assert r.exit_code == 1 and "using `smollm2-135m.kvcal.safetensors`" in _line(r.stderr), r.stderr


def test_a_report_passed_as_the_bundle_names_its_bundle(tmp_path, monkeypatch):
    shutil.copyfile(ARTIFACT, tmp_path / "x.kvcal.safetensors")
    (tmp_path / "x.kvcal.report.md").write_text("# report\n")
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["inspect", "x.kvcal.report.md"])
    assert r.exit_code == 1
    assert "`x.kvcal.report.md` is a report, not a bundle; pass its bundle `x.kvcal.safetensors`" in _line(r.stderr)


@pytest.mark.parametrize("typed", ["x.kvcal.report.md", "smollm2-135m", "notes.txt", "b.safetensors", "runs",
                                   "qwen2.5-coder-1.5b", "sub/missing/y.kvcal.report.json"])
def test_no_suggestion_proposes_out_with_a_name_that_is_not_a_bundle(tmp_path, monkeypatch, typed):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    for args in (["inspect", typed], ["bench", "--bundle", typed], ["export", typed, "--format", "manifest",
                                                                      "--out", "m"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 1, r.output
        line = _line(r.stderr)
        outs = re.findall(r"--out (\S+?)`", line)
        assert outs and all(o.endswith(".kvcal.safetensors") for o in outs), line
        assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m").exists()


def test_the_calibrate_suggestion_keeps_the_stem_and_names_a_packaged_model():
    assert bundle_stem("x.kvcal.report.md") == bundle_stem("x.kvcal.safetensors") == bundle_stem("x.kvcal") == "x"
    assert bundle_stem("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b" and bundle_stem("b.safetensors") == "b"
    assert calibrate_command(Path("d/x.kvcal.report.md")) == "kvcal calibrate --out d/x.kvcal.safetensors"
    assert calibrate_command(Path("qwen2.5-coder-1.5b")) == \
        "kvcal calibrate --model qwen2.5-coder-1.5b --out qwen2.5-coder-1.5b.kvcal.safetensors"


# --------------------------------------------------------------------------------------------- bench


def test_bench_without_a_bundle_names_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    r = runner.invoke(app, ["bench", "--quick"])
    assert r.exit_code == 1
    assert "add `--bundle artifacts/smollm2-135m.kvcal.safetensors`" in _line(r.stderr), r.stderr
    monkeypatch.chdir(tmp_path)                     # elsewhere: the clone's artifacts/, by its full path
    r = runner.invoke(app, ["bench", "--quick"])
    assert r.exit_code == 1 and f"add `--bundle {ARTIFACT}`" in _line(r.stderr), r.stderr
    shutil.copyfile(ARTIFACT, tmp_path / "smollm2-135m.kvcal.safetensors")     # what `kvcal calibrate` writes here
    r = runner.invoke(app, ["bench", "--quick"])
    assert r.exit_code == 1 and "add `--bundle smollm2-135m.kvcal.safetensors`" in _line(r.stderr), r.stderr
    r = runner.invoke(app, ["bench", "--quick", "--model", "qwen2.5-coder-1.5b"])     # another model's shipped one
    assert r.exit_code == 1 and f"add `--bundle {ROOT / 'artifacts' / 'qwen2.5-coder-1.5b.kvcal.safetensors'}`" \
        in _line(r.stderr), r.stderr
    from conftest import save_model

    folder = save_model(tmp_path / "tiny", "llama")                 # a model with no bundle anywhere
    r = runner.invoke(app, ["bench", "--quick", "--model", str(folder)])
    assert r.exit_code == 1 and "--bundle` (the model's bundle); create one with `kvcal calibrate --model " \
        f"{folder}`" in _line(r.stderr), r.stderr


# --------------------------------------------------------------------------------------------- .gitignore


def _export_outs() -> set[str]:
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "export.md").read_text()
    return set(re.findall(r"kvcal export [^\n]*--out (\S+)", text))


def test_the_folders_the_export_examples_write_are_git_ignored():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git clone")
    outs = _export_outs()
    assert {"kv-scales", "smollm2-manifest"} <= outs
    for folder in outs:
        r = subprocess.run(["git", "check-ignore", "-q", f"{folder}/file"], cwd=ROOT)
        assert r.returncode == 0, f"{folder}/ is written by an export example but is not git-ignored"


# --------------------------------------------------------------------------------------------- plain output


@pytest.mark.parametrize("columns", ["80", "200"])
def test_inspect_lines_end_without_padding(unsearched_bundle, columns):
    for extra in ([], ["--heads"]):
        for bundle in (ARTIFACT, unsearched_bundle):
            r = runner.invoke(app, ["inspect", str(bundle), *extra], env={"COLUMNS": columns})
            assert r.exit_code == 0, r.output
            padded = [line for line in r.stdout.splitlines() if line != line.rstrip()]
            assert not padded, padded


def test_export_prints_names_and_values_without_a_box(tmp_path):
    r = runner.invoke(app, ["export", str(ARTIFACT), "--format", "manifest", "--out", str(tmp_path / "m")],
                      env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == "kvcal export manifest: smollm2-135m"
    assert not BOX_DRAWING.search(r.stdout), r.stdout
    assert not [line for line in lines if line != line.rstrip()]
    assert any(re.match(r"tiers +high K\w+, low K\w+, pages of \d+ B$", line) for line in lines), r.stdout


# --------------------------------------------------------------------------------------------- docs/cli.md


def test_docs_show_a_bar_for_every_statistics_pass():
    """Every pass `kvcal calibrate` runs gets a bar (`run_pass` reports each by name); docs/cli.md shows them all."""
    code = "".join((ROOT / "kvcal" / "profile" / f).read_text() for f in ("calibrate.py", "passes.py"))
    passes = re.findall(r'run_pass\(lm, "([\w-]+)"', code)
    assert "key-ranges" in passes and len(passes) == 3          # random tokens, text (FastGen beside it), key ranges
    doc = (ROOT / "docs" / "cli.md").read_text()
    for name in passes:
        assert re.search(rf"^{name} +━+ \d+/\d+ windows", doc, re.M), f"docs/cli.md shows no `{name}` bar"
