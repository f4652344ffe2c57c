"""`--threads N|auto` (kvcal.cli._threads): the rule as a pure function of (option, cores, load, environment), the
option on the command line, and that the count reaches torch and the fused CPU decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvcal.cli import _threads, app
from kvcal.cli._threads import parse_threads, resolve_threads, use_threads

runner = CliRunner()
ARTIFACT = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m.kvcal.safetensors"


@pytest.fixture(autouse=True)
def keep_torch_threads(monkeypatch):
    """What these tests apply is undone: torch's count comes back, and the inter-op pool (which torch lets a process
    size only once) is left alone."""
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize(("load", "want"), [(0.0, 2), (0.4, 2), (1.2, 1), (2.0, 1), (5.0, 1)])
def test_auto_uses_the_cores_the_load_leaves_free(load, want):
    choice = resolve_threads(None, cores=2, load=load, env=None)
    assert (choice.count, choice.source) == (want, "auto")
    assert str(choice) == f"{want} (auto: {load:.1f} of 2 cores busy)"


def test_auto_on_more_cores_and_without_a_load_average():
    assert resolve_threads(None, cores=16, load=3.0, env=None).count == 13
    assert resolve_threads(None, cores=16, load=40.0, env=None).count == 1
    assert resolve_threads(None, cores=4, load=None, env=None).count == 4       # busy cores unknown: every core


def test_an_explicit_count_wins_over_load_and_environment():
    for load in (0.0, 5.0):
        choice = resolve_threads(3, cores=2, load=load, env="1")
        assert (choice.count, choice.source, str(choice)) == (3, "option", "3 (--threads 3)")


def test_omp_num_threads_is_respected_when_the_option_is_auto():
    choice = resolve_threads(None, cores=2, load=0.0, env="1")
    assert (choice.count, choice.source, str(choice)) == (1, "env", "1 (OMP_NUM_THREADS=1)")
    assert resolve_threads(parse_threads("auto"), cores=8, load=5.0, env="4").count == 4
    assert resolve_threads(None, cores=8, load=0.0, env="3,2").count == 3       # nested levels: the outer one
    for ignored in ("", "  ", "0", "many"):                                    # not a count: OpenMP ignores it too
        assert resolve_threads(None, cores=2, load=1.2, env=ignored).source == "auto"


def test_parse_threads():
    assert parse_threads("auto") is parse_threads("AUTO") is parse_threads(None) is None
    assert parse_threads("1") == 1 and parse_threads(" 4 ") == 4
    for bad in ("0", "-2", "x", "1.5", ""):
        with pytest.raises(ValueError, match="`--threads 1`"):
            parse_threads(bad)


def test_use_threads_applies_the_count_to_torch_and_the_cpu_decode(monkeypatch):
    """The fused CPU decode asks torch for its thread count at each layer, so `--threads` reaches it too."""
    from kvcal.runtime.backends.cpu import backend as cpu_backend

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert use_threads("1").count == 1 and torch.get_num_threads() == 1                  # the option wins
    assert use_threads("auto").source == "env" and torch.get_num_threads() == 2

    seen = []

    class FakeLibrary:
        def kvcal_decode(self, *args):
            seen.append(args[-5])             # ... track_scores, threads, GRAIN, out, new_score, levels
            return 0

    monkeypatch.setattr(cpu_backend, "load_library", lambda: FakeLibrary())
    monkeypatch.setattr(cpu_backend, "_layer_args", lambda store, layer: ())
    monkeypatch.setattr(cpu_backend, "_levels_ptr", lambda store, layer: None)
    q, kv = torch.zeros(1, 1, 1, 1, 4), torch.zeros(1, 1, 1, 4)
    for n in ("1", "3"):
        use_threads(n)
        cpu_backend.CpuBackend.attend(None, 0, q, kv, kv, 0.5)
    assert seen == [1, 3]


def test_busy_cores_count_other_work_and_not_a_command_that_has_ended():
    """A job spinning on one core reads as one busy core (of this process's usable cores); the figure is measured at
    the start of a command, so a kvcal run that has just finished (which the load average still counts) is not in it."""
    import subprocess
    import sys

    cores = _threads.usable_cores()
    quiet = _threads.busy_cores(0.3)
    if quiet is None:
        pytest.skip("/proc/stat cannot be read here")
    assert 0.0 <= quiet <= cores
    if cores < 2 or quiet > 0.5:
        pytest.skip(f"the machine is busy already ({quiet:.1f} of {cores} cores)")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.3)
        busy = _threads.busy_cores(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and 0.7 <= busy - quiet <= 1.3, (quiet, busy)


@pytest.mark.skipif(not ARTIFACT.is_file(), reason="the shipped bundle is not in artifacts/")
def test_every_command_takes_threads_and_a_bad_value_is_one_line_naming_the_fix():
    before = torch.get_num_threads()
    r = runner.invoke(app, ["inspect", str(ARTIFACT), "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert torch.get_num_threads() == before          # an in-process command gives the caller's count back
    for bad in ("0", "x"):
        r = runner.invoke(app, ["inspect", str(ARTIFACT), "--threads", bad])
        assert r.exit_code != 0 and r.stdout == ""
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        line = " ".join(r.stderr.split())
        assert f"--threads {bad}" in line and "`--threads 1`" in line and "`auto`" in line, line
    for command in ("calibrate", "inspect", "bench", "export"):
        r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "100"})
        assert r.exit_code == 0 and "--threads N|auto" in r.stdout, (command, r.stdout)


def test_calibrate_says_how_many_threads_it_used_and_why(tiny_dir, text_file, tmp_path):
    args = ["calibrate", "--model", str(tiny_dir), "--random-tokens", "64", "--text-tokens", "64", "--seq-len", "64",
            "--dataset", str(text_file), "--dtype", "float32", "--no-search", "--quiet", "--threads", "1"]
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "a.kvcal.safetensors"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["threads"] == {"count": 1, "source": "option", "cores": _threads.CORES_AT_START,
                                               "load": None, "text": "1 (--threads 1)"}
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "b.kvcal.safetensors")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    time_row = next(line for line in r.stdout.splitlines() if line.startswith("time"))
    assert time_row.rstrip().endswith("MiB; threads 1 (--threads 1)"), time_row
