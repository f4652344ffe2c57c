"""`kvcal export` (not built yet)."""

from kvcal.cli._options import fail


def export() -> None:
    """Not built yet: will write a bundle in forms other serving stacks read."""
    raise fail("`kvcal export` is not built yet (tracked as issue 6); nothing was written", code=2)
