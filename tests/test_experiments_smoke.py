"""Every script in experiments/ runs: each one end to end at tiny sizes, on the tests' tiny random Llama (or Gemma3,
for sliding-window layers) and a bundle calibrated for it here, so that a change to kvcal that breaks a script fails
the suite instead of the next person who runs it.

The scripts run in this process through `runpy` (as `python experiments/NAME.py ARGS` would run them: `__main__`,
`sys.argv`, experiments/ first on `sys.path`), so torch and transformers are imported once for all of them; the few
that start `kvcal` in a fresh process to measure it (calibrate_models, cli_capture) pay for one each.
"""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvcal.cli import app

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"

SMALL_CALIBRATE = ["--no-search", "--random-tokens", "64", "--text-tokens", "64", "--seq-len", "64"]

# script (and a mode of it after a space) -> its arguments at tiny sizes; {llama}/{gemma} are model folders,
# {llama_bundle}/{gemma_bundle} bundles calibrated for them (statistics only: the runtime's default settings), {data}
# a .jsonl of word-salad documents, {tmp} a fresh folder per script
SMOKE: dict[str, list[str]] = {
    "bases": ["--model", "{llama}", "--tokens", "128", "--eval-windows", "1", "--seq-len", "64",
              "--json", "{tmp}/out.json"],
    "beams_crop": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--prompt", "40", "--beams", "2",
                   "--new-tokens", "4", "--repeats", "1", "--crops", "1", "--json", "{tmp}/out.json"],
    "calibrate_unrotated": ["--json", "{tmp}/out.json", "--", "--model", "{llama}", *SMALL_CALIBRATE, "--dataset",
                            "{data}"],
    "calibration_floor": ["--model", "{llama}", "--repeats", "1", "--context", "64", "--prefill-dtype", "bfloat16",
                          "--json", "{tmp}/out.json"],
    "calibrate_models": ["{llama}", "--results", "{tmp}", "--", *SMALL_CALIBRATE, "--dataset", "{data}"],
    "cli_capture": ["--out", "{tmp}", "--", *SMALL_CALIBRATE],
    "cli_flags_page": ["--check"],
    "context_sweep": ["--bundle", "{llama_bundle}", "--model", "{llama}", "--contexts", "64,128", "--windows", "1",
                      "--steps", "8", "--json", "{tmp}/out.json", "--png", "{tmp}/out.png"],
    "cpu_attention": ["--contexts", "64", "--batches", "1", "--reps", "1", "--no-compile", "--json",
                      "{tmp}/out.json"],
    "cpu_prefill": ["--context", "64", "--reps", "1", "--threads", "1", "--json", "{tmp}/out.json"],
    "cuda_decode": ["--device", "cpu", "--quick", "--iters", "1", "--geometries", "qwen2.5-1.5b shape", "--json",
                    "{tmp}/out.json"],
    "format_swaps": ["--model", "{gemma}", "--bundle", "{gemma_bundle}", "--swap=-/-/-", "--swap=K8V4/K4cV2/K4V4+4",
                     "--windows", "1", "--prompt", "40", "--steps", "8", "--json", "{tmp}/out.json"],
    "gauge_gap": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--windows", "2", "--pick", "1", "--prompt", "48",
                  "--steps", "8", "--json", "{tmp}/out.json"],
    "served_bytes": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--windows", "1", "--prompt", "40",
                     "--steps", "8", "--json", "{tmp}/out.json"],
    "held_tokens": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--prompt", "48", "--steps", "8",
                    "--json", "{tmp}/out.json"],
    "fp8_margin": ["--model", "{llama}", "--calib-tokens", "128", "--windows", "1", "--seq-len", "64",
                   "--json", "{tmp}/out.json"],
    "joint_quality": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--backend", "torch", "--windows", "1",
                      "--prompt", "40", "--steps", "4"],
    "key_formats": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--windows", "1", "--prompt", "40",
                    "--steps", "8", "--rows", "0,1", "--key-range-windows", "1", "--json", "{tmp}/out.json"],
    "layer_swaps": ["--model", "{gemma}", "--bundle", "{gemma_bundle}", "--row=", "--row", "2=K8V8", "--windows", "1",
                    "--prompt", "40", "--steps", "8", "--json", "{tmp}/out.json"],
    "meta_bits": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--windows", "1", "--prompt", "40",
                  "--steps", "8", "--json", "{tmp}/out.json"],
    "mixing": ["--model", "{llama}", "--windows", "1", "--prompt", "40", "--steps", "4", "--calib-tokens", "128",
               "--calib-seq-len", "64", "--json", "{tmp}/out.json"],
    "nuq_pages": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--bits", "4", "--windows", "1", "--prompt",
                  "200", "--steps", "16", "--json", "{tmp}/out.json"],   # long enough that pages pay
    "pre_rope_keys": ["--model", "{gemma}", "--context", "96", "--windows", "1", "--steps", "8", "--fit-windows", "1",
                      "--rows", "0,7,10,13,16,22,25,29,33", "--bundle", "{gemma_bundle}", "--json", "{tmp}/out.json"],
    "predicted_vs_measured": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--context", "64", "--steps", "8",
                              "--windows", "1", "--allocations", "2", "--json", "{tmp}/out.json"],
    "predicted_vs_measured --layer-steps": ["--model", "{gemma}", "--bundle", "{gemma_bundle}", "--context", "64",
                                            "--steps", "8", "--windows", "1", "--layer-steps", "2", "--chunk", "4"],
    "probe_cost": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--context", "64", "--steps", "8",
                   "--json", "{tmp}/out.json"],
    "probe_rss": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--prompt", "40", "--steps", "8",
                  "--windows", "1"],
    "readme_snippet": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--new-tokens", "4", "--long", "64",
                       "--repeats", "1", "--json", "{tmp}/out.json"],
    "results_pages": ["--models", "{llama}", "--bundles", "{tmp}/bundles", "--out", "{tmp}/results", "--work",
                      "{tmp}", "--", "--threads", "1",
                      "--quick", "--methods", "dense,kvcal-joint", "--windows", "1", "--prompt", "40", "--steps",
                      "4", "--contexts", "64", "--passkey-lengths", "64", "--speed-steps", "2"],
    "rss_trace": ["--every", "0.05", "--bucket", "0.2", "--json", "{tmp}/out.json", "--", sys.executable, "-c",
                  "import time; x = bytearray(64 << 20); time.sleep(0.5)"],
    "thread_bits": ["--models", "{llama}", "--rows", "4", "64", "--json", "{tmp}/out.json"],
    "runtime": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--contexts", "64", "--steps", "4",
                "--speed-contexts", "64", "--batches", "1", "--speed-steps", "2", "--speed-configs", "K8V4", "bundle",
                "--threads", "1", "--json", "{tmp}/out.json"],
    "sliding_recent": ["--model", "{gemma}", "--bundle", "{gemma_bundle}", "--row", "K4V4+4", "--windows", "1",
                       "--prompt", "40", "--steps", "8", "--json", "{tmp}/out.json"],
    "smoothing": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--prompt", "40", "--steps", "8",
                  "--windows", "1", "--json", "{tmp}/out.json"],
    "thread_determinism": ["--json", "{tmp}/out.json", "--", "--model", "{llama}", *SMALL_CALIBRATE, "--dataset",
                           "{data}"],
    "value_groups": ["--model", "{llama}", "--bundle", "{llama_bundle}", "--windows", "1", "--prompt", "40",
                     "--steps", "8", "--json", "{tmp}/out.json"],
    "with_settings": ["--bundle", "{gemma_bundle}", "--swap", "K8V4/K4cV2/K4V4+4", "--out",
                      "{tmp}/b.kvcal.safetensors"],
}


def test_every_script_has_a_smoke_run():
    scripts, smoked = {p.stem for p in EXPERIMENTS.glob("*.py")}, {name.split()[0] for name in SMOKE}
    assert scripts - smoked == set(), "add the new experiments/ scripts to SMOKE in this file"
    assert smoked - scripts == set(), "remove the deleted experiments/ scripts from SMOKE in this file"


@pytest.fixture(scope="session")
def smoke_env(tmp_path_factory, text_file):
    """Model folders and a bundle for each, made once."""
    from conftest import save_model

    root = tmp_path_factory.mktemp("experiments")
    env = {"data": str(text_file)}
    for family, model_type in (("llama", "llama"), ("gemma", "gemma3_text")):
        folder = save_model(root / family, model_type)
        bundle = root / f"{family}.kvcal.safetensors"
        r = CliRunner().invoke(app, ["calibrate", "--model", str(folder), "--out", str(bundle), "--dataset",
                                     str(text_file), *SMALL_CALIBRATE, "--dtype", "float32", "--quiet",
                                     "--threads", "1"])
        assert r.exit_code == 0, r.output
        env[family], env[f"{family}_bundle"] = str(folder), str(bundle)
    return env


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_script_runs_at_tiny_sizes(name, smoke_env, tmp_path, monkeypatch):
    if name == "cli_capture" and shutil.which("tmux") is None:
        pytest.skip("cli_capture needs tmux")
    if name == "results_pages":                 # the bundle it looks for: BUNDLES/<model folder name>.kvcal.safetensors
        (tmp_path / "bundles").mkdir()
        shutil.copy(smoke_env["llama_bundle"], tmp_path / "bundles" / f"{Path(smoke_env['llama']).name}"
                                                                        ".kvcal.safetensors")
    script = EXPERIMENTS / f"{name.split()[0]}.py"
    argv = [a.format(**smoke_env, tmp=tmp_path) for a in SMOKE[name]]
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        assert e.code in (None, 0), f"experiments/{name}.py exited with {e.code}"
    finally:
        torch.set_num_threads(threads)
        for mod in [m for m, v in sys.modules.items() if str(getattr(v, "__file__", "")).startswith(str(EXPERIMENTS))]:
            del sys.modules[mod]         # format_swaps imported by a sibling: the next script gets a fresh one
    if name == "thread_determinism":            # the tiny model's bundles agree at 1 and 2 threads
        assert json.loads((tmp_path / "out.json").read_text())["differ"] == []
    if name == "calibrate_unrotated":           # the summary of a calibration that ran, marked with its frame
        out = json.loads((tmp_path / "out.json").read_text())
        assert out["frame"] == {"rotate": False} and out["tokens"]
    if name == "thread_bits":                   # every (rows, in, out) tried in both dtypes, the head too
        per = json.loads((tmp_path / "out.json").read_text())["models"][smoke_env["llama"]]
        assert per["bfloat16"]["tried"] == per["float32"]["tried"] == 2 * len(per["shapes"])
    if name == "rss_trace":                     # the child's 64 MiB buffer, seen by the sampler
        assert json.loads((tmp_path / "out.json").read_text())["peak_mib"] >= 64
    if name == "results_pages":                 # one flat page per model, its plot links renamed with it
        model = Path(smoke_env["llama"]).name
        assert sorted(p.name for p in (tmp_path / "results").iterdir()) == sorted(
            f"{model}{suffix}" for suffix in (".md", ".json", "-pareto.png", "-decode_time.png"))
        assert f"]({model}-pareto.png)" in (tmp_path / "results" / f"{model}.md").read_text()


def test_results_pages_names_the_command_for_a_missing_bundle(tmp_path, monkeypatch, capsys):
    """The regeneration command skips a model with no bundle, says how to make one, and exits 1."""
    script = EXPERIMENTS / "results_pages.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--models", "qwen2.5-coder-1.5b", "--bundles", str(tmp_path),
                                      "--out", str(tmp_path / "results")])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(script), run_name="__main__")
    assert e.value.code == 1
    assert "kvcal calibrate -m qwen2.5-coder-1.5b --out" in capsys.readouterr().out
    assert not (tmp_path / "results").exists()


def test_results_pages_render_rewords_a_page_from_its_json(tmp_path, monkeypatch):
    """`--render` rewrites a page from its JSON alone: the shipped smollm2-135m page comes back line for line but
    for its verdict, which now states the target's bound as the bundle recorded it (over at most N predictions)."""
    script = EXPERIMENTS / "results_pages.py"
    shutil.copy(ROOT / "docs" / "results" / "smollm2-135m.json", tmp_path / "smollm2-135m.json")
    monkeypatch.setattr(sys, "argv", [str(script), "--render", "--models", "smollm2-135m", "--out", str(tmp_path)])
    runpy.run_path(str(script), run_name="__main__")
    before = (ROOT / "docs" / "results" / "smollm2-135m.md").read_text().splitlines()
    after = (tmp_path / "smollm2-135m.md").read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) <= 1
    report = json.loads((tmp_path / "smollm2-135m.json").read_text())
    n = report["bundle"]["target"]["held_out_predictions"]
    assert f"over at most {n} predictions" in report["summary"]["verdict"]
    assert report["summary"]["verdict"] in after


def test_with_settings_serves_a_hull_point_of_the_report(smoke_env, tmp_path, monkeypatch):
    """`with_settings.py --hull-point N` copies the bundle with point N of the frontier its report lists: per-head
    bits become `low_layers` / `low_heads` as the calibration's `to_config` writes them."""
    from kvcal.profile.allocate import base_settings
    from kvcal.runtime.bundle import load_bundle

    bundle = tmp_path / "b.kvcal.safetensors"
    shutil.copy(smoke_env["llama_bundle"], bundle)
    info = load_bundle(bundle).model
    bits = [[[4, 4]] * info.num_kv_heads for _ in range(info.num_layers)]
    bits[0] = [[2, 2]] * info.num_kv_heads
    bits[1][-1] = [8, 4]
    point = {"bits": bits, "predicted_loss": 1.0, "held_bytes": 1.0, "high": "K8V8", "alpha_high": 16.0}
    base = base_settings(list(info.layer_types), head_dim=info.head_dim).to_dict()
    (tmp_path / "b.kvcal.report.json").write_text(json.dumps({"search": {"quality_model": {"hull": [point],
                                                                                            "base": base}}}))
    script = EXPERIMENTS / "with_settings.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--bundle", str(bundle), "--hull-point", "0", "--out",
                                      str(tmp_path / "c.kvcal.safetensors")])
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    runpy.run_path(str(script), run_name="__main__")
    got = load_bundle(tmp_path / "c.kvcal.safetensors")
    assert got.settings["low_layers"] == {"0": "K2cnV2nm8"}
    assert got.settings["low_heads"] == {"1": {str(info.num_kv_heads - 1): "K8cV4nm8"}}
    assert (got.settings["high"], got.settings["alpha_high"]) == ("K8V8", 16.0)
    assert got.calibration["hand_set"] == "hull point 0"
    # a report without the search's frontier is one line naming the fix, and nothing is written
    (tmp_path / "b.kvcal.report.json").write_text(json.dumps({"held_out": {}}))
    monkeypatch.setattr(sys, "argv", [str(script), "--bundle", str(bundle), "--hull-point", "0", "--out",
                                      str(tmp_path / "d.kvcal.safetensors")])
    with pytest.raises(SystemExit, match="lists no frontier .* use --swap"):
        runpy.run_path(str(script), run_name="__main__")
    assert not (tmp_path / "d.kvcal.safetensors").exists()
