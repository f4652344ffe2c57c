"""The CLI end to end on a tiny random model: calibrate, inspect, JSON output, errors."""

import json

import pytest
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
    assert r.exit_code == 1 and "is not a kvcal bundle" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_arguments_give_one_line_errors(tmp_path):
    r = runner.invoke(app, ["calibrate", "--model", str(tmp_path / "nope")])
    assert r.exit_code == 1 and "neither a packaged model" in r.stderr
    r = runner.invoke(app, ["calibrate", "--removal-rate", "1.5"])
    assert r.exit_code == 1 and "removal-rate" in r.stderr


def test_removal_rate_with_the_search_on_is_refused_before_any_work(tiny_dir, text_file, tmp_path):
    """The search chooses ranks itself, so a fixed `--removal-rate` would be silently dropped: it is refused with a
    one-line error naming the fix, and nothing is written."""
    out = tmp_path / "r.kvcal.safetensors"
    r = runner.invoke(app, ["calibrate", "--model", str(tiny_dir), "--out", str(out), "--dataset", str(text_file),
                            "--removal-rate", "0.1", "--quiet"])
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "`--removal-rate 0.1`" in r.stderr and "--no-search" in r.stderr
    assert not out.exists() and not (tmp_path / "r.kvcal.safetensors.ckpt").exists()


def test_unsupported_architecture(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    cfg.save_pretrained(tmp_path)
    r = runner.invoke(app, ["calibrate", "--model", str(tmp_path)])
    assert r.exit_code == 1
    assert "unsupported architecture `gpt2`" in r.stderr and "llama" in r.stderr


def test_bench_without_a_bundle_says_how_to_make_one():
    r = runner.invoke(app, ["bench"])
    assert r.exit_code == 1 and "needs `--bundle`" in r.stderr and "kvcal calibrate" in r.stderr


def test_help_lists_the_four_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("calibrate", "inspect", "bench", "export"):
        assert cmd in r.stdout


def _tiny_calibrate(tiny_dir, text_file, out) -> list[str]:
    """A `kvcal calibrate` of the tiny model that takes a few seconds, writing `out`."""
    import sys

    return [sys.executable, "-m", "kvcal", "calibrate", "--model", str(tiny_dir), "--out", str(out),
            "--random-tokens", "512", "--text-tokens", "512", "--seq-len", "64", "--dataset", str(text_file),
            "--dtype", "float32", "--search-windows", "2", "--search-prompt", "48", "--search-steps", "8",
            "--target-top1", "0.5", "--target-ppl-ratio", "2", "--quiet", "--json"]


def test_sigint_then_rerun_resumes(tiny_dir, text_file, tmp_path):
    """A real Ctrl-C (SIGINT) in the middle of `kvcal calibrate`, then the same command again: finished passes and
    search points are not recomputed, and the bundle appears only at the end."""
    import os
    import signal
    import subprocess
    import time

    out = tmp_path / "b.kvcal.safetensors"
    ckpt = tmp_path / "b.kvcal.safetensors.ckpt"
    cmd = _tiny_calibrate(tiny_dir, text_file, out)
    # a shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT: give the child Ctrl-C's
    # default whoever started the suite
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (ckpt / "search.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "calibration finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "rerun the same command to resume" in err
    assert not out.exists() and (ckpt / "random-tokens.safetensors").is_file()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["resumed"]["random-tokens"] == 8 and summary["resumed"]["calibration-text"] == 8
    assert summary["resumed"]["measurements"] >= 1
    assert out.is_file() and not ckpt.exists()


def test_sigterm_removes_the_spilled_records_and_keeps_the_checkpoint(tiny_dir, text_file, tmp_path):
    """`kill` (SIGTERM) while the search holds its recorded prompts on disk: the process ends as Ctrl-C ends it (exit
    128 + 15, one line), with its record files removed from TMPDIR, the checkpoint kept and no bundle written. Python's
    default for SIGTERM ends the process without cleanup, which left a window's records (475 MB for gemma3-270m) in
    /tmp."""
    import os
    import signal
    import subprocess
    import time

    out, ckpt, scratch = tmp_path / "b.kvcal.safetensors", tmp_path / "b.kvcal.safetensors.ckpt", tmp_path / "tmp"
    scratch.mkdir()
    cmd = _tiny_calibrate(tiny_dir, text_file, out)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(scratch)})
    deadline = time.time() + 120
    while not list(scratch.glob("kvcal-records-*/*.pt")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "calibration finished before it spilled a record"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "terminated" in err and "Traceback" not in err
    assert not list(scratch.glob("kvcal-records-*")), "the spilled records were left behind"
    assert not out.exists() and (ckpt / "random-tokens.safetensors").is_file()


def test_a_sigterm_during_the_heap_release_is_delivered_after_it():
    """`heap.release_memory` runs gc, whose finalizers swallow what is raised inside them: a SIGTERM that lands there is
    held and delivered once gc is done, as the command line's `Terminated`, and the handlers are restored."""
    import gc
    import os
    import signal

    from kvcal.cli._errors import Terminated, _interrupt, _received
    from kvcal.profile.heap import release_memory

    previous = signal.signal(signal.SIGTERM, _interrupt)
    sent: list[int] = []

    def kill_once(phase, info):
        if phase == "start" and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)

    gc.callbacks.append(kill_once)
    try:
        with pytest.raises(Terminated):
            release_memory()
        assert sent and signal.getsignal(signal.SIGTERM) is _interrupt
    finally:
        gc.callbacks.remove(kill_once)
        signal.signal(signal.SIGTERM, previous)
        _received.clear()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_that_a_finalizer_swallows_stops_calibrate_at_its_next_display():
    """Python prints and drops an exception raised inside a finalizer, so a Ctrl-C whose handler runs there is lost and
    the run goes on to the end. The command line keeps the signal, and the progress displays calibrate and bench hand
    their pipelines (`checked`) raise it before they show anything."""
    import os
    import signal

    from kvcal.cli._errors import _interrupt, _received, checked

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))                 # bytecode for the handler to run in, inside the finalizer

    previous = signal.signal(signal.SIGINT, _interrupt)
    try:
        Finalized()                          # freed at once: the interrupt is raised in __del__ and dropped
        shown: list = []
        with pytest.raises(KeyboardInterrupt):
            checked(lambda *args: shown.append(args))("calibration-text", 1, 8)
        assert not shown
    finally:
        signal.signal(signal.SIGINT, previous)
        _received.clear()
