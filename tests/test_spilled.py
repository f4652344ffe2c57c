"""SpilledRecords: recorded prompts on disk, a window per file, read back exactly and stacked as one batch."""

import pytest
import torch

from kvcal.eval.spilled import SpilledRecords


def _window(seed: int, seen: int | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {0: (torch.randn(1, 2, 5, 4, generator=g).half(), torch.randn(1, 2, 5, 4, generator=g).half(), None),
            1: (torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, 4, generator=g), seen),
            2: (torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5), {"diffkv": torch.ones(1, 5)})}


def test_windows_read_back_exactly_and_stack_as_a_batch():
    spilled = SpilledRecords()
    windows = [_window(b, seen=7) for b in range(3)]
    for w in windows:
        spilled.append(w)
    assert len(spilled) == 3
    for b, w in enumerate(windows):
        back = spilled.window(b)
        assert back[0][0].dtype == torch.float16 and torch.equal(back[0][0], w[0][0]) and back[0][2] is None
    batch = spilled.batch()
    assert torch.equal(batch[0][1], torch.cat([w[0][1] for w in windows]))
    assert torch.equal(batch[2][2]["diffkv"], torch.ones(3, 5)) and batch[1][2] == 7


def test_a_batch_of_windows_that_disagree_is_refused():
    spilled = SpilledRecords()
    spilled.append(_window(0, seen=7))
    spilled.append(_window(1, seen=8))
    with pytest.raises(ValueError, match="cannot be one batch"):
        spilled.batch()
    with pytest.raises(ValueError, match="one window"):
        spilled.append({0: (torch.zeros(2, 1, 1, 1),)})
    with pytest.raises(IndexError):
        spilled.window(5)


def test_the_files_go_with_the_object():
    import gc
    from pathlib import Path

    spilled = SpilledRecords()
    spilled.append(_window(0))
    folder = Path(spilled._folder.name)
    assert any(folder.iterdir())
    del spilled
    gc.collect()
    assert not folder.exists()


def test_a_batch_reads_a_layer_only_when_it_is_looked_up(monkeypatch):
    """The runtime's check primes its cache from `batch()` a layer at a time, so it holds one layer's batch."""
    import kvcal.eval.spilled as spilled_module

    spilled = SpilledRecords()
    windows = [_window(b, seen=7) for b in range(3)]
    for w in windows:
        spilled.append(w)
    loads = []
    real_load = spilled_module.torch.load
    monkeypatch.setattr(spilled_module.torch, "load", lambda path, **kw: loads.append(path) or real_load(path, **kw))
    batch = spilled.batch()
    assert list(batch) == [0, 1, 2] and len(batch) == 3 and 2 in batch and 5 not in batch and not loads
    assert torch.equal(batch[1][0], torch.cat([w[1][0] for w in windows]))
    assert len(loads) == 3 and all("layer-1" in str(p) for p in loads)
    with pytest.raises(KeyError):
        batch[5]
