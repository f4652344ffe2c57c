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
                                dataset=sys.argv[3], dtype="float32", search=search, context=160,
                                search_windows=2, search_steps=32, eval_windows=1,
                                accept_best=True))
""")


@pytest.mark.parametrize(("model_type", "search"), [("llama", "no-search"), ("gemma3_text", "no-search"),
                                                     ("llama", "search")])
def test_bundle_tensors_are_bit_identical_across_thread_counts(model_type, search, text_file, tmp_path):
    """With the search on, the chosen settings (and so the rank tensors) must agree as well."""
    from conftest import save_model
    from safetensors.torch import load_file

    model_dir = save_model(tmp_path / "model", model_type)
    outs = []
    for threads in (1, 2):
        out = tmp_path / f"t{threads}.kvcal.safetensors"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                             os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(threads), str(model_dir), str(text_file), str(out),
                               search],
                              capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(out)
    a, b = (load_file(str(out)) for out in outs)
    assert a.keys() == b.keys() and {"qk.rotation", "v.basis"} <= set(a)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].contiguous().view(torch.uint8), b[name].contiguous().view(torch.uint8)), name
    if search == "search":
        from kvcal.runtime.bundle import load_bundle

        first, second = (load_bundle(out) for out in outs)
        assert first.settings == second.settings
