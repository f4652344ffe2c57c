"""How a cache is served: `ServeOptions`, the choices a bundle never stores.

A bundle's `CompressionConfig` says what is kept and how it is coded; `ServeOptions` says how this process serves it
(attention backend, page size, CPU threads). Two processes may serve one bundle with different options and hold the
same tokens. The options are resolved once, by `ServeOptions.resolve`, when a cache is made.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ServeOptions:
    """`backend`: "auto" (cuda, else the fused cpu kernels, else torch), "torch", "cpu" or "cuda".
    `page_bytes`: an explicit page size in bytes; None: sized from the bundle's `page_tokens`.
    `threads`: torch intra-op threads while the cache attends; None: leave torch's setting as it is."""

    backend: str = "auto"
    page_bytes: int | None = None
    threads: int | None = None

    def __post_init__(self):
        if self.page_bytes is not None and self.page_bytes <= 0:
            raise ValueError(f"page_bytes={self.page_bytes} must be a positive number of bytes (or None)")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads={self.threads} must be a positive count (or None)")

    def resolve(self, device: str = "cpu", formats: tuple = (), head_dim: int = 0):
        """The attention backend class these options choose for `device` and the tier `formats` (ValueError, one line,
        when the named backend cannot serve them)."""
        from kvcal.runtime.backends.registry import select_backend

        return select_backend(self.backend, str(device), tuple(formats), head_dim)

    def with_(self, **changes) -> ServeOptions:
        return replace(self, **changes)
