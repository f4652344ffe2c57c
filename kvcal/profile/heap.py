"""The process heap while calibrating: hand freed memory back to the OS between search points and windows.

Trimming, not a low mmap threshold: mapping every large tensor afresh would make each forward pass pay page faults.
"""

from __future__ import annotations

import functools


def release_memory() -> None:
    """Hand freed heap memory back to the OS between search points. Each point allocates and frees hundreds of MB of
    short-lived tensors; glibc keeps them, so without this the resident set climbs with every point."""
    import gc
    import signal
    import threading

    # an interrupt (Ctrl-C, or the command line's SIGTERM) raised inside a finalizer that gc runs is printed and
    # dropped ("Exception ignored in __del__"), so hold the signals for the duration and deliver them after
    held: list[int] = []
    signals = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda signum, _: held.append(signum)) for s in signals} if main else {}
    try:
        gc.collect()
        trim_heap()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    for signum in dict.fromkeys(held):
        signal.raise_signal(signum)


def trim_heap() -> None:
    """Hand freed heap memory back to the OS, without a garbage collection first: cheap enough (tens of milliseconds
    on a heap of a GB or two) to call inside a pass, between chunks whose freed tensors a fragmented heap would
    otherwise keep resident."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


@functools.cache
def _libc():
    """The C library from the symbols already loaded (None if it cannot be opened). Not ctypes.util.find_library: it
    runs ldconfig in a subprocess, and a Ctrl-C that lands during that subprocess is lost."""
    import ctypes

    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
