"""Python's cyclic garbage collector and a real-time engine: what is built at start-up is frozen out of it.

Why: a full (generation 2) collection walks every object the collector tracks, with the GIL held; an engine
process with torch, timm, pydantic and its pools loaded tracks a few hundred thousand, and one such collection
took 80-146 ms in benchmarks/bench_host.py (48 x 240p60: every thread stopped, ~300 frames waiting, a source's
frames shed; measured with gc.callbacks, benchmarks/RESULTS.md). `gc.freeze()` moves every object tracked now into
a permanent generation that collections skip, so later ones walk only what was made since. vLLM's engine core
does the same after its start-up (gc.collect(); gc.freeze()).

What it costs: garbage that exists at the freeze is kept until the unfreeze (bounded: what start-up left; the
young generations are collected first, which is cheap, while a full collection here would cost the very pause
this avoids, at every start). Process-wide: engines in one process (tests, a Ray actor) share one count, and the
last one to stop unfreezes, so a test process returns to plain collection between engines.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_engines = 0


def freeze_startup() -> None:
    """An engine has started: everything tracked now is left out of later collections."""
    global _engines
    with _lock:
        _engines += 1
        gc.collect(1)  # the young generations: start-up's fresh garbage, a few ms
        gc.freeze()


def engine_stopped() -> None:
    """An engine has stopped: the last one gives the frozen objects back to the collector."""
    global _engines
    with _lock:
        if _engines == 0:
            return
        _engines -= 1
        if _engines == 0:
            gc.unfreeze()


def engines() -> int:
    """Engines running in this process, as counted here."""
    return _engines
