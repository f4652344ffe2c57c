"""The tests that compare two code paths (marked `float_order`) hold under every instruction set torch can pick on
this CPU, not only its best one.

torch chooses its vectorised kernels once per process by `ATEN_CPU_CAPABILITY` (default: the CPU's best), and their
summation order differs between `default`, `avx2` and `avx512`. A comparison that holds only under one of them fails
on another machine; rerunning the marked tests in a subprocess per capability makes that fail here too. A capability
the CPU lacks is skipped: torch would execute instructions the CPU does not have.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CAPABILITIES = ("default", "avx2", "avx512")       # torch's names, from the least to the most capable


def available() -> list[str]:
    """The capabilities up to the one torch runs this process with (its best, or what the environment asks)."""
    best = torch.backends.cpu.get_cpu_capability().lower()
    if best not in CAPABILITIES:                   # e.g. "avx512_bf16" variants, or a non-x86 CPU
        best = next((c for c in reversed(CAPABILITIES) if best.startswith(c)), "default")
    return list(CAPABILITIES[:CAPABILITIES.index(best) + 1])


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_code_path_comparisons_hold_under_each_instruction_set(capability):
    if capability not in available():
        pytest.skip(f"this CPU runs torch at {available()[-1]}, below {capability}")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "float_order", "-p", "no:cacheprovider",
                           str(root / "tests")], capture_output=True, text=True, env=env, cwd=root, timeout=900)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail       # the marker selected tests, and they ran
