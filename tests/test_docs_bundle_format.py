"""docs/bundle-format.md names every tensor and metadata key a bundle holds, so the page cannot fall behind the
format: the shipped bundle's header, a freshly saved tiny bundle with every optional tensor, the v1 bundle in
tests/data, and the schema tables of `kvcal.runtime.bundle` and `kvcal.runtime.config`. The last test does the same for
docs/runtime-api.md (the runtime's exports and `memory()` keys)."""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import make_model, random_bundle

from kvcal.runtime.bundle import (
    OPTIONAL_TENSORS,
    READABLE_VERSIONS,
    REQUIRED_TENSORS,
    SCHEMA_VERSION,
    ModelInfo,
    save_bundle,
)
from kvcal.runtime.config import SETTINGS_KEYS
from kvcal.runtime.files import safetensors_header

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "bundle-format.md"
SHIPPED = ROOT / "artifacts" / "smollm2-135m.kvcal.safetensors"
V1 = Path(__file__).parent / "data" / "v1-tiny-llama.kvcal.safetensors"


def _named(text: str) -> set[str]:
    """Every `backticked` name on the page."""
    return set(re.findall(r"`([^`\n]+)`", text))


def _keys(path: Path) -> tuple[set[str], dict[str, str]]:
    """(tensor keys, metadata) of a safetensors file, from its header alone."""
    found = safetensors_header(path)
    assert found is not None, f"{path} has no readable safetensors header"
    header = dict(found[1])
    meta = header.pop("__metadata__", {})
    return set(header), meta


def _missing(path: Path, named: set[str]) -> list[str]:
    tensors, meta = _keys(path)
    return sorted((tensors | set(meta)) - named)


@pytest.fixture(scope="module")
def named() -> set[str]:
    return _named(PAGE.read_text(encoding="utf-8"))


def test_page_names_every_key_of_the_shipped_bundle(named):
    if not SHIPPED.is_file():
        pytest.skip(f"{SHIPPED} is not in this checkout")
    assert not _missing(SHIPPED, named), "add these keys to docs/bundle-format.md"
    _, meta = _keys(SHIPPED)
    assert not sorted(set(json.loads(meta["model"])) - named)


def test_page_names_every_key_of_a_freshly_saved_bundle(named, tmp_path):
    """A tiny bundle with every optional tensor (so the newest schema), saved by this kvcal."""
    torch.manual_seed(0)
    model, tok = make_model("llama", seed=0)
    bundle = random_bundle(model, tok)
    L, H, d = bundle.shape
    low = -torch.rand(L, H, d)
    bundle.extras = {"k.absmax": torch.rand(L, H), "v.absmax": torch.rand(L, H),
                     "fastgen.recovery": torch.rand(L, H, 4), "fastgen.kept_fraction": torch.rand(L, H, 4),
                     "k.range_low": low, "k.range_high": low + torch.rand(L, H, d),
                     "qk.smoothing": 0.5 + torch.rand(L, H, d)}
    for name in OPTIONAL_TENSORS:
        if name.startswith("levels."):                 # sorted, endpoints pinned at 0 and 2**bits - 1
            top = (1 << int(name.rsplit(".", 1)[1])) - 1
            inner = torch.rand(L, H, top - 1).sort(-1).values * top
            bundle.extras[name] = torch.cat([torch.zeros(L, H, 1), inner, torch.full((L, H, 1), float(top))], -1)
    bundle.settings = {"window": 8}
    assert set(bundle.extras) == set(OPTIONAL_TENSORS), "extend this test's extras to the new optional tensor"
    path = save_bundle(bundle, tmp_path / "tiny.kvcal.safetensors")
    assert not _missing(path, named), "add these keys to docs/bundle-format.md"
    tensors, meta = _keys(path)
    assert tensors == set(REQUIRED_TENSORS) | set(OPTIONAL_TENSORS)
    assert meta["schema_version"] == str(SCHEMA_VERSION)


def test_page_names_every_key_of_the_v1_bundle(named):
    assert not _missing(V1, named), "add these keys to docs/bundle-format.md"


def test_page_names_the_schema_tables(named):
    """Every tensor the loader knows, every model-block field, every settings key, every readable version."""
    want = set(REQUIRED_TENSORS) | set(OPTIONAL_TENSORS) | set(ModelInfo.__dataclass_fields__) | set(SETTINGS_KEYS)
    assert not sorted(want - named), "add these keys to docs/bundle-format.md"
    text = PAGE.read_text(encoding="utf-8")
    for version in READABLE_VERSIONS:
        assert re.search(rf"^\| {version} \|", text, re.M), f"schema version {version} has no row on the page"


def test_runtime_api_page_names_every_export_and_memory_key():
    """docs/runtime-api.md, the companion page: every name in `kvcal.runtime.__all__` and every key of
    `KvcalCache.memory()` (read from an empty cache: the keys do not depend on the calls made)."""
    import kvcal.runtime
    from kvcal.runtime.hf import KvcalCache

    named = _named((ROOT / "docs" / "runtime-api.md").read_text(encoding="utf-8"))
    model, tok = make_model("llama", seed=0)
    cache = KvcalCache.from_bundle(random_bundle(model, tok), model, tokenizer=tok)
    assert not sorted(set(kvcal.runtime.__all__) - named), "add these exports to docs/runtime-api.md"
    assert not sorted(set(cache.memory()) - named), "add these memory() keys to docs/runtime-api.md"
