"""Python's cyclic garbage collector and a real-time engine: what is built at start-up is frozen out of it.

Why: a full (generation 2) collection walks every object the collector tracks, with the GIL held; an engine
process with torch, timm, pydantic and its pools loaded tracks a few hundred thousand, and one such collection
took 80-146 ms in benchmarks/bench_host.py (48 x 240p60: every thread stopped, ~300 frames waiting, a source's
frames shed; measured with gc.callbacks, benchmarks/RESULTS.md). `gc.freeze()` moves every object tracked now into
a permanent generation that collections skip, so later ones walk only what was made since. vLLM's engine core
does the same after its start-up (gc.collect(); gc.freeze()).

What it costs: garbage that exists at a freeze is kept until the unfreeze (the young generations are collected
first, which is cheap; a full collection here would cost the very pause this avoids, at every start). With one
engine that is what its start-up left; with engines whose lives overlap, each start also freezes the old garbage
made since the one before, all of it kept until the last one stops. Cyclic garbage of objects built before the
freeze (streams configured at start, then removed) is likewise kept until the stop. Process-wide: engines in one
process (tests, a Ray actor) share one count, the last one to stop unfreezes (Engine.stop does it even when a
close raised), which also undoes a freeze the embedding program made itself; an engine never stopped leaves the
process frozen.
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
