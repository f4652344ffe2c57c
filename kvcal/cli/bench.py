"""`kvcal bench` (not built yet)."""

from kvcal.cli._options import fail


def bench() -> None:
    """Not built yet: will compare kvcal with baselines on quality, memory and speed."""
    raise fail("`kvcal bench` is not built yet (tracked as issue 5); nothing was run", code=2)
