"""Native heap: cap glibc's malloc arenas, and read the heap's state (metrics, soak runs).

Why this exists: with glibc's default, each thread that allocates while the others hold the
arenas gets an arena of its own, up to 8 x cores of them (15 in vidar's soak on 2 cores). A
thread that exits leaves its arena to the next new thread, so as streams are removed and re-added
and workers rebuilt, frame-sized blocks are allocated and freed across many arenas, and each keeps
its own fragmented free space; the partly used pages of it stay resident even after malloc_trim.
Measured with `benchmarks/soak.py` (benchmarks/RESULTS.md): bytes in use flat, the arenas' free
space and the trimmed RSS creeping up with the default, both much less with 2 arenas.

The cap is process-wide and cannot be undone (arenas that exist stay; glibc reads the cap once, on
the first new arena it needs after it is set, or after 8 arenas exist if it never was), so the CLI
sets it before the engine starts any thread. Written by hand with ctypes because no dependency of
ours exposes mallopt/mallinfo2; an LD_PRELOADed jemalloc or tcmalloc would replace all of this (and
then everything here is a no-op: the functions below only act when glibc's malloc is the one in use).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import tempfile
from typing import Optional

log = logging.getLogger("vidar.memory")

M_ARENA_MAX = -8  # glibc's malloc.h


class _MallInfo2(ctypes.Structure):
    # glibc >= 2.33; sums over every arena
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc() -> Optional[ctypes.CDLL]:
    """glibc, if it is this process's C library and its malloc is the one in use; else None."""
    try:
        if platform.libc_ver()[0] != "glibc":
            return None
        proc, libc = ctypes.CDLL(None), ctypes.CDLL("libc.so.6")
        # an LD_PRELOADed allocator shadows glibc's malloc: mallopt/mallinfo2 would then say nothing
        if ctypes.cast(proc.malloc, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
            return None
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.malloc_info.argtypes, libc.malloc_info.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int
        libc.fopen.argtypes, libc.fopen.restype = [ctypes.c_char_p, ctypes.c_char_p], ctypes.c_void_p
        libc.fclose.argtypes, libc.fclose.restype = [ctypes.c_void_p], ctypes.c_int
        if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
            libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError, TypeError):
        return None


_LIBC = _glibc()


def _env_arena_max() -> Optional[int]:
    """The arena cap glibc took from the environment at start-up (MALLOC_ARENA_MAX or GLIBC_TUNABLES)."""
    m = re.search(r"(?:^|:)glibc\.malloc\.arena_max=(\d+)", os.environ.get("GLIBC_TUNABLES", ""))
    for raw in (os.environ.get("MALLOC_ARENA_MAX", ""), m.group(1) if m else ""):
        if raw.strip().isdigit() and int(raw) > 0:
            return int(raw)
    return None


def limit_malloc_arenas(n: int) -> Optional[int]:
    """Cap glibc's malloc arenas at `n` (0: leave glibc's default). Returns the cap in force, or None.

    A cap from the environment wins. Call before starting threads: arenas that already exist stay,
    and a warning says how many there are.
    """
    if n <= 0 or _LIBC is None:
        return None
    env = _env_arena_max()
    if env is not None:
        return env
    if _LIBC.mallopt(M_ARENA_MAX, n) != 1:
        log.warning("mallopt(M_ARENA_MAX, %d) failed: malloc arenas left at glibc's default", n)
        return None
    have = arena_count()
    if have is not None and have > n:
        log.info("malloc_arenas=%d: %d arenas exist already (threads started before the engine); "
                 "no new ones will be made", n, have)
    return n


def malloc_trim() -> bool:
    """Give free heap pages back to the OS (glibc); False where there is no glibc malloc."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0) >= 0)


def arena_count() -> Optional[int]:
    """Number of malloc arenas now (glibc's malloc_info XML has one <heap> per arena)."""
    if _LIBC is None:
        return None
    try:
        fd, path = tempfile.mkstemp(prefix="vidar-mallinfo-")
    except OSError:
        return None
    os.close(fd)
    try:
        f = _LIBC.fopen(path.encode(), b"w")
        if not f:
            return None
        ok = _LIBC.malloc_info(0, f) == 0
        _LIBC.fclose(f)
        with open(path) as fh:
            return fh.read().count("<heap nr=") if ok else None
    finally:
        os.unlink(path)


def heap_bytes() -> Optional[dict]:
    """glibc heap in bytes: in use, free inside the arenas (resident or not: malloc_trim hands whole
    free pages back but they still count here), and mmapped outside the arenas (large blocks, e.g.
    frames before glibc raises its mmap threshold). A leak grows in_use or mmapped. None off glibc."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    mi = _LIBC.mallinfo2()  # takes each arena's lock briefly while it walks the free lists
    return {"in_use": mi.uordblks, "free": mi.fordblks, "mmapped": mi.hblkhd, "mmapped_blocks": mi.hblks}


def heap_stats() -> Optional[dict]:
    """heap_bytes in MB, plus the arena count (for the soak's samples)."""
    h = heap_bytes()
    if h is None:
        return None
    mb = 2 ** 20
    return {"arenas": arena_count(), "used_mb": round(h["in_use"] / mb, 2), "free_mb": round(h["free"] / mb, 2),
            "arena_mb": round((h["in_use"] + h["free"]) / mb, 2), "mmap_mb": round(h["mmapped"] / mb, 2),
            "mmap_n": h["mmapped_blocks"]}
