"""The engine-dead policy of one pool: `max_failures` failed or hung batches within `window_s`. The same
count guards the control plane's supervised tasks and the view's encoder thread (`what`: "crashes")."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional


class FaultPolicy:
    def __init__(self, pool: str, *, max_failures: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic, what: str = "failed batches",
                 label: Optional[str] = None):
        self.pool, self.max_failures, self.window_s, self._clock = pool, max_failures, window_s, clock
        self._what, self._label = what, label or f"pool {pool}"  # what is counted, and whose
        self._times: deque = deque()
        self._lock = threading.Lock()
        self.dead: Optional[str] = None  # why this pool killed the engine, once it has

    def record(self, reason: str) -> None:
        """One failed or hung batch (or output step). Thread-safe."""
        with self._lock:
            now = self._clock()
            self._times.append(now)
            while self._times and now - self._times[0] > self.window_s:
                self._times.popleft()
            if len(self._times) >= self.max_failures and self.dead is None:
                self.dead = (f"{self._label}: {len(self._times)} {self._what} within {self.window_s:g} s "
                             f"(last: {reason})")
