"""Drops are logged in aggregate, never per frame: a stream dropping every frame for its deadline
would otherwise write 60 lines a second. The counters (accounting, metrics) count each drop; this
only says in the log, every LOG_EVERY_S, which streams dropped what."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from engine.frames.lifecycle import DropReason

log = logging.getLogger("vidar.pool")

LOG_EVERY_S = 5.0


class DropLog:
    def __init__(self, pool: str, lock: threading.RLock):
        self.pool, self._lock = pool, lock  # the pool's ledger lock: core and output threads both note
        self._counts: Counter = Counter()  # (stream, reason) since the last line
        self._last = time.monotonic()

    def note(self, stream: str, reason: DropReason) -> None:
        """Ledger lock held."""
        self._counts[(stream, reason.value)] += 1

    def flush(self) -> None:
        now = time.monotonic()
        if not self._counts or now - self._last < LOG_EVERY_S:
            return
        with self._lock:
            counts, self._counts = self._counts, Counter()
        by_stream: dict[str, list[str]] = {}
        for (stream, reason), n in sorted(counts.items()):
            by_stream.setdefault(stream, []).append(f"{n} {reason}")
        for stream, parts in by_stream.items():
            log.info("stream %s: pool %s dropped %s in %.0f s", stream, self.pool, ", ".join(parts), now - self._last)
        self._last = now
