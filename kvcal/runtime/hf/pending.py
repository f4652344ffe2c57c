"""The layer whose attention is due: how a cache layer's `update` hands its K/V to kvcal's attention function.

transformers calls `cache.update(k, v, layer_idx)` right before the attention function and passes the function the
layer's module, not the cache. A kvcal layer (paged or sliding) that wants its own attention hands itself over here
(`hand_over`); the `kvcal` attention function takes it (`take`) when the call is that layer's. A hand-over still
pending at the next layer's `update` means the model did not run kvcal's attention (`claim_pending` raises).
"""

from __future__ import annotations

from contextvars import ContextVar

from kvcal.runtime.bundle import BundleMismatchError

_PENDING: ContextVar[tuple | None] = ContextVar("kvcal_pending", default=None)


def hand_over(layer, key, value=None) -> None:
    """`layer` (with `layer_idx`) attends next, to the new tokens `key` [B, H, n, d] (and `value`) it returned."""
    _PENDING.set((layer, key, value))


def take(module, key) -> tuple | None:
    """(layer, key, value) handed over for this attention call (the module's layer, the key it returned), cleared;
    None when the call is not a kvcal layer's."""
    pending = _PENDING.get()
    if pending is None or pending[0].layer_idx != module.layer_idx or pending[1] is not key:
        return None
    _PENDING.set(None)
    return pending


def clear() -> None:
    """Forget a hand-over left by a call that failed between a layer's update and its attention."""
    _PENDING.set(None)


def claim_pending() -> None:
    """Raise if the previous layer's hand-over never reached kvcal's attention: the model attended to the new tokens
    only."""
    if _PENDING.get() is not None:
        _PENDING.set(None)
        raise BundleMismatchError(
            "the model calling this KvcalCache does not run kvcal's attention, so it would attend to the new "
            "tokens only: use the cache with the model given to `KvcalCache.from_bundle(bundle, model)`, which "
            "installs that attention")
