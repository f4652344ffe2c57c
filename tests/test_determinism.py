"""The same inputs give the same bundle tensors whatever the torch thread count (issue 14: a bundle made on one
machine must be the bundle made on another)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(int(sys.argv[1]))
    from kvcal.profile.calibrate import CalibrationConfig, calibrate
    search = sys.argv[5] == "search"
    calibrate(CalibrationConfig(model=sys.argv[2], out=sys.argv[4], random_tokens=512, text_tokens=512, seq_len=64,
                                dataset=sys.argv[3], dtype=sys.argv[6], search=search, context=160,
                                search_windows=2, search_steps=32, eval_windows=1,
                                accept_best=True))
""")


@pytest.mark.parametrize(("model_type", "search", "dtype"), [("llama", "no-search", "float32"),
                                                              ("gemma3_text", "no-search", "float32"),
                                                              ("llama", "search", "float32"),
                                                              ("llama", "search", "bfloat16")])
def test_bundle_tensors_are_bit_identical_across_thread_counts(model_type, search, dtype, text_file, tmp_path):
    """With the search on, the chosen settings (and so the rank tensors) must agree as well; bfloat16: the passes
    and the search's prompt prefills in bf16 (the default where the CPU computes bf16), the continuations in float32."""
    from conftest import save_model
    from safetensors.torch import load_file

    model_dir = save_model(tmp_path / "model", model_type)
    outs = []
    for threads in (1, 2):
        out = tmp_path / f"t{threads}.kvcal.safetensors"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                             os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(threads), str(model_dir), str(text_file), str(out),
                               search, dtype],
                              capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(out)
    a, b = (load_file(str(out)) for out in outs)
    assert a.keys() == b.keys() and {"qk.rotation", "v.basis"} <= set(a)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].contiguous().view(torch.uint8), b[name].contiguous().view(torch.uint8)), name
    from kvcal.runtime.bundle import load_bundle

    first, second = (load_bundle(out) for out in outs)
    # the mode is recorded: on one CPU the real model's recording differed across thread counts (docs/calibration.md)
    assert first.calibration["blas"] == second.calibration["blas"] == ("mkl-strict" if torch.backends.mkl.is_available()
                                                                        else "none")
    if search == "search":
        assert first.settings == second.settings


STRICT = textwrap.dedent("""
    import torch
    from kvcal.profile.reproducible import strict_blas
    first = strict_blas()
    torch.randn(64, 64) @ torch.randn(64, 64)
    print(first, strict_blas())
""")
LATE = textwrap.dedent("""
    import torch
    torch.randn(64, 64) @ torch.randn(64, 64)
    from kvcal.profile.reproducible import strict_blas
    print(strict_blas())
""")


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL: no mode to choose")
def test_strict_blas_is_chosen_before_the_first_product_and_reported_too_late_after():
    """In a fresh process the mode is set and stays set; after a product MKL has fixed its mode, which is said."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    env.pop("MKL_CBWR", None)
    fresh, late = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
                   for code in (STRICT, LATE))
    assert fresh.returncode == 0 and late.returncode == 0, fresh.stderr[-1000:] + late.stderr[-1000:]
    assert fresh.stdout.split() == ["mkl-strict", "mkl-strict"]
    assert late.stdout.split() == ["mkl"]


def test_pass_threads_keeps_the_count_where_products_agree_and_takes_one_where_they_do_not(monkeypatch):
    """The current count where every linear shape gives one thread's bits, 1 where one shape does not (a product
    that reads the thread count stands in for a thread-dependent kernel); the count is restored either way, and the
    global random state is not drawn from."""
    from kvcal.profile.reproducible import pass_threads
    from kvcal.runtime.cache import torch_threads

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    model.get_output_embeddings = lambda: model[1]
    with torch_threads(2):
        state = torch.random.get_rng_state()
        assert pass_threads(model, 64) == 2
        assert torch.equal(torch.random.get_rng_state(), state)
        linear = torch.nn.functional.linear
        monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w: linear(x, w) + torch.get_num_threads())
        assert pass_threads(model, 64) == 1
        assert torch.get_num_threads() == 2
    with torch_threads(1):
        assert pass_threads(model, 64) == 1 and torch.get_num_threads() == 1
