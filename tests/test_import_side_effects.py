"""Importing kvcal changes nothing in the host process: a serving stack that imports kvcal's runtime keeps its
environment (Hugging Face Hub access included), its logging and its torch settings. Only the `kvcal` command sets its
own offline mode, and loading a model reads its local folder without asking the Hub either way.

Each check runs in a fresh interpreter, started without the offline variables this suite's conftest sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")

# what is compared before and after an import (torch is imported first: its own import is not kvcal's doing)
SNAPSHOT = r'''
import json, logging, os, sys
import torch

def snapshot():
    root = logging.getLogger()
    return {
        "environ": dict(os.environ),
        "logging.root.level": root.level,
        "logging.root.handlers": [repr(h) for h in root.handlers],
        "logging.disable": logging.root.manager.disable,
        "torch.get_num_threads": torch.get_num_threads(),
        "torch.get_num_interop_threads": torch.get_num_interop_threads(),
        "torch.get_default_dtype": str(torch.get_default_dtype()),
        "torch.get_float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch.are_deterministic_algorithms_enabled": torch.are_deterministic_algorithms_enabled(),
        "torch.is_grad_enabled": torch.is_grad_enabled(),
    }

def changes(before, after):
    out = {k: [before[k], after[k]] for k in before if k != "environ" and before[k] != after[k]}
    env_b, env_a = before["environ"], after["environ"]
    out.update({f"os.environ[{k!r}]": [env_b.get(k), env_a.get(k)] for k in sorted(set(env_b) | set(env_a))
                if env_b.get(k) != env_a.get(k)})
    return out
'''


def _run(code: str, *args: str, timeout: int = 300) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", SNAPSHOT + code, *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


IMPORT = r'''
import importlib
before = snapshot()
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(changes(before, snapshot())))
'''


@pytest.mark.parametrize("module", ["kvcal", "kvcal.runtime", "kvcal.runtime.hf", "kvcal.runtime.bundle", "kvcal.eval",
                                    "kvcal.profile", "kvcal.bench", "kvcal.cli", "kvcal.models", "kvcal.data"])
def test_importing_changes_nothing_in_the_process(module):
    assert _run(IMPORT, module) == {}


def test_importing_every_module_changes_nothing_in_the_process():
    """Every module of kvcal/ but `__main__` (which runs the command), in one process."""
    names = []
    for f in sorted((REPO / "kvcal").rglob("*.py")):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    assert len(names) > 50
    assert _run(IMPORT, *names) == {}


def test_the_command_sets_its_own_offline_mode():
    """`kvcal.cli.main` turns the offline mode on for its process, in huggingface_hub too (already imported by then),
    and leaves a user's own choice alone."""
    code = r'''
import huggingface_hub.constants as hub
from kvcal.cli import offline_mode
assert not hub.HF_HUB_OFFLINE
offline_mode()
print(json.dumps({"env": [os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")],
                  "hub": hub.HF_HUB_OFFLINE}))
'''
    assert _run(code) == {"env": ["1", "1"], "hub": True}
    user = code.replace("from kvcal.cli import", "os.environ['HF_HUB_OFFLINE'] = '0'\nfrom kvcal.cli import")
    assert _run(user) == {"env": ["0", "1"], "hub": False}


LOAD = r'''
import socket
asked = []

def refuse(*args, **kwargs):
    asked.append(repr(args)[:200])
    raise OSError("no network in this test")

socket.socket.connect = refuse
socket.getaddrinfo = refuse
from kvcal.models import load_model
before = snapshot()
lm = load_model(sys.argv[1], dtype="float32")
ids = lm.tokenizer("the cat sat on the mat", return_tensors="pt").input_ids
with torch.no_grad():
    logits = lm.model(ids).logits
finite = bool(torch.isfinite(logits).all())
print(json.dumps({"asked": asked, "finite": finite, "changes": changes(before, snapshot())}))
'''


def _packaged_or_skip(name: str) -> str:
    from kvcal.models import resolve_model

    try:
        resolve_model(name)
    except ValueError as e:
        pytest.skip(f"{name} unavailable: {e}")
    return name


@pytest.mark.parametrize("which", ["folder", "smollm2-135m"])
def test_models_load_from_local_folders_without_offline_variables_or_network(which, tiny_dir):
    """Without HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE and with every network connection refused, a model folder and a
    packaged model load and run, and nothing tried to reach the Hub."""
    spec = str(tiny_dir) if which == "folder" else _packaged_or_skip(which)
    out = _run(LOAD, spec)
    assert out["asked"] == [] and out["finite"]
    assert out["changes"] == {}
