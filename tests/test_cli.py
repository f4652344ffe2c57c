"""The CLI end to end on a tiny random model: calibrate, inspect, JSON output, errors."""

import json

from typer.testing import CliRunner

from kvcal.cli import app

runner = CliRunner()


def test_calibrate_then_inspect(tiny_dir, text_file, tmp_path):
    out = tmp_path / "cli.kvcal.safetensors"
    args = ["calibrate", "--model", str(tiny_dir), "--out", str(out), "--random-tokens", "128", "--text-tokens",
            "128", "--seq-len", "64", "--dataset", str(text_file), "--dtype", "float32", "--removal-rate", "0.2",
            "--quiet", "--json", "--no-search"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["bundle"] == str(out) and out.is_file()
    assert summary["tokens"] == {"random": 128, "text": 128}
    assert sum(summary["ranks"]["qk"].values()) == 2 * 2

    r = runner.invoke(app, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "per layer / KV head" in r.stdout and "token independence" in r.stdout

    r = runner.invoke(app, ["inspect", str(out), "--json", "--model", str(tiny_dir)])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert len(info["heads"]) == 4 and info["calibration"]["removal_rate"] == 0.2


def test_inspect_refuses_other_model_and_bad_files(tiny_dir, text_file, tmp_path):
    from conftest import save_model

    out = tmp_path / "b.kvcal.safetensors"
    runner.invoke(app, ["calibrate", "--model", str(tiny_dir), "--out", str(out), "--random-tokens", "64",
                        "--text-tokens", "64", "--seq-len", "64", "--dataset", str(text_file), "-q", "--no-search"])
    other = save_model(tmp_path / "other", "qwen2")
    r = runner.invoke(app, ["inspect", str(out), "--model", str(other)])
    assert r.exit_code == 1 and "calibrate this model" in r.stderr
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(b"not a bundle at all")
    r = runner.invoke(app, ["inspect", str(bad)])
    assert r.exit_code == 1 and "not a readable safetensors file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_arguments_give_one_line_errors(tmp_path):
    r = runner.invoke(app, ["calibrate", "--model", str(tmp_path / "nope")])
    assert r.exit_code == 1 and "neither a packaged model" in r.stderr
    r = runner.invoke(app, ["calibrate", "--removal-rate", "1.5"])
    assert r.exit_code == 1 and "removal-rate" in r.stderr


def test_unsupported_architecture(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    cfg.save_pretrained(tmp_path)
    r = runner.invoke(app, ["calibrate", "--model", str(tmp_path)])
    assert r.exit_code == 1
    assert "unsupported architecture `gpt2`" in r.stderr and "llama" in r.stderr


def test_unbuilt_commands_say_so():
    r = runner.invoke(app, ["bench"])
    assert r.exit_code == 2 and "not built yet" in r.stderr


def test_help_lists_the_four_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("calibrate", "inspect", "bench", "export"):
        assert cmd in r.stdout
