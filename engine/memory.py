"""Native heap: bound glibc's malloc arenas, and read the heap's state for soak runs.

Why this exists: glibc gives threads their own malloc arena, up to 8 x cores of them. vidar's
threads come and go (a decoder thread per stream added, a worker rebuilt after a fault) and
allocate frame-sized blocks, so each arena keeps its own fragmented free memory that
malloc_trim cannot hand back. Measured with `benchmarks/soak.py` (6 min, a stream removed and
re-added every 10 s, benchmarks/RESULTS.md): 15 arenas held ~32 MB free and trimmed RSS rose
7.8 MB per 10 min; with 2 arenas ~13-24 MB free and 1.2 MB per 10 min. Bytes in use were flat
(~186 MB) in both: fragmentation, not a leak.

Written by hand with ctypes because no dependency of ours exposes mallopt; an LD_PRELOADed
jemalloc/tcmalloc would also do, but needs a system package and a launcher. Everything here is a
no-op off glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
from typing import Optional

log = logging.getLogger("vidar.memory")

M_ARENA_MAX = -8  # glibc's malloc.h


class _MallInfo2(ctypes.Structure):
    # glibc >= 2.33; sums over every arena
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None)  # the C library already loaded into this process
        libc.gnu_get_libc_version  # only glibc has it: mallopt's numbering is glibc's
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


_LIBC = _glibc()


def limit_malloc_arenas(n: int) -> Optional[int]:
    """Cap glibc's malloc arenas at `n` (0: leave glibc's default). Returns the cap applied, or None.

    MALLOC_ARENA_MAX in the environment wins (glibc read it at start-up). glibc fixes its limit
    once a ninth arena is needed, so call this before the engine starts its threads; arenas that
    already exist stay.
    """
    if n <= 0 or _LIBC is None or os.environ.get("MALLOC_ARENA_MAX"):
        return None
    if _LIBC.mallopt(M_ARENA_MAX, n) != 1:
        log.warning("mallopt(M_ARENA_MAX, %d) failed: malloc arenas left at glibc's default", n)
        return None
    return n


def malloc_trim() -> bool:
    """Give free heap memory back to the OS (glibc); False where there is no glibc."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0) >= 0)


def arena_count() -> Optional[int]:
    """Number of malloc arenas now (glibc's malloc_info XML has one <heap> per arena)."""
    if _LIBC is None or not hasattr(_LIBC, "malloc_info"):
        return None
    fd, path = tempfile.mkstemp(prefix="vidar-mallinfo-")
    os.close(fd)
    try:
        _LIBC.fopen.restype, _LIBC.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
        _LIBC.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        _LIBC.fclose.argtypes = [ctypes.c_void_p]
        f = _LIBC.fopen(path.encode(), b"w")
        if not f:
            return None
        _LIBC.malloc_info(0, f)
        _LIBC.fclose(f)
        with open(path) as fh:
            return fh.read().count("<heap nr=")
    finally:
        os.unlink(path)


def heap_bytes() -> Optional[dict]:
    """glibc heap in bytes (in use, free in the arenas, mmapped outside them); None off glibc."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    mi = _LIBC.mallinfo2()
    return {"in_use": mi.uordblks, "free": mi.fordblks, "mmapped": mi.hblkhd}


def heap_stats() -> Optional[dict]:
    """glibc heap in MB: bytes in use (a leak shows here) and free bytes the arenas hold
    (fragmentation shows here), plus large blocks mmapped outside the arenas."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    mi, mb = _LIBC.mallinfo2(), 2 ** 20
    return {"arenas": arena_count(), "arena_mb": round(mi.arena / mb, 2), "used_mb": round(mi.uordblks / mb, 2),
            "free_mb": round(mi.fordblks / mb, 2), "mmap_mb": round(mi.hblkhd / mb, 2), "mmap_n": mi.hblks}
