"""The process heap while calibrating: freed tensor memory goes back to the OS instead of inflating the peak RSS.

glibc serves an allocation above its mmap threshold with mmap and returns it with munmap when freed. The threshold
starts at 128 KiB and rises to the size of any mmapped block that is freed, up to 32 MiB, so after the first
few-MB tensor is freed, tensors of that size come from the heap and their memory stays resident after they are
freed. A search window allocates and frees hundreds of MB of such tensors (the recording's attention blocks, each
layer's K/V), so the resident set then climbs by hundreds of MB above what is alive. `return_large_frees` pins the
threshold at 1 MiB for the process (the `kvcal calibrate` command calls it once); `release_memory` trims the heap
between search points.
"""

from __future__ import annotations

import functools

MMAP_THRESHOLD = 1 << 20     # bytes: larger allocations are mmapped and unmapped when freed
_M_MMAP_THRESHOLD = -3       # mallopt's parameter number (glibc malloc.h)


def return_large_frees() -> bool:
    """Pin glibc's mmap threshold at MMAP_THRESHOLD for this process (module docstring). False where the C library
    is not glibc (nothing changed)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def release_memory() -> None:
    """Hand freed heap memory back to the OS between search points. Each point allocates and frees hundreds of MB of
    short-lived tensors; glibc keeps them, so without this the resident set climbs with every point."""
    import gc
    import signal
    import threading

    # a Ctrl-C handled inside a finalizer that gc runs is printed and dropped ("Exception ignored in __del__"), so
    # hold it for the duration and raise it after
    held: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: held.append(1)) if main else None
    try:
        gc.collect()
        libc = _libc()
        trim = getattr(libc, "malloc_trim", None) if libc is not None else None
        if trim is not None:
            trim(0)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


@functools.cache
def _libc():
    """The C library from the symbols already loaded (None if it cannot be opened). Not ctypes.util.find_library: it
    runs ldconfig in a subprocess, and a Ctrl-C that lands during that subprocess is lost."""
    import ctypes

    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
