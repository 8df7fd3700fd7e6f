"""Reconnect policy of network streams: capped exponential backoff with jitter. Pure: no clock, no sleep.

The ingest thread asks for a pause after every failed open and after every ended session. The pause
doubles each time, up to `max_s`, and starts again from `initial_s` only after a session that
delivered frames for `reset_after_s`: a server that accepts and closes at once (or sends two
frames and hangs up) backs off exactly like one that refuses, instead of being hammered twice a
second for ever.

Jitter only ever shortens a pause (by up to `jitter`), so the cap holds with jitter included
and cameras behind one switch still do not retry in step.

    >>> b = Backoff(0.5, 30, 10, rng=lambda: 0.0)
    >>> [b.after_failure() for _ in range(4)]
    [0.5, 1.0, 2.0, 4.0]
    >>> b.after_session(delivered_s=60.0)  # a good session: start again, first retry within 1 s
    0.5
"""

from __future__ import annotations

import math
import random
from typing import Callable

#: after a good session the first retry comes within this (a camera that blinked is back at once)
FIRST_RETRY_MAX_S = 1.0


class Backoff:
    """Pauses between connection attempts of one stream.

    Args:
        initial_s: first pause (after a good session: at most FIRST_RETRY_MAX_S).
        max_s: no pause is ever longer, jitter included.
        reset_after_s: a session must deliver frames for this long to start the backoff again.
        jitter: a pause is shortened by a random fraction in [0, jitter).
        rng: returns a float in [0, 1); injected by tests.
    """

    def __init__(self, initial_s: float, max_s: float, reset_after_s: float, *, jitter: float = 0.2,
                 rng: Callable[[], float] = random.random):
        if not (initial_s > 0 and max_s > 0 and reset_after_s > 0 and 0 <= jitter < 1):
            raise ValueError(f"backoff needs initial_s, max_s, reset_after_s > 0 and 0 <= jitter < 1; got "
                             f"{initial_s}, {max_s}, {reset_after_s}, {jitter}")
        self.initial_s, self.max_s, self.reset_after_s = initial_s, max_s, reset_after_s
        self.jitter, self._rng = jitter, rng
        self._delay = initial_s

    def after_failure(self) -> float:
        """An attempt to open failed: the pause before the next attempt."""
        return self._next(math.inf)

    def after_session(self, delivered_s: float) -> float:
        """A session ended after delivering frames for `delivered_s` seconds: the pause before reconnecting."""
        if delivered_s >= self.reset_after_s:
            self._delay = self.initial_s
            return self._next(FIRST_RETRY_MAX_S)
        return self._next(math.inf)  # ended at once or soon: as if the attempt had failed

    def _next(self, cap: float) -> float:
        pause = min(self._delay, self.max_s, cap) * (1.0 - self.jitter * self._rng())
        self._delay = min(self._delay * 2, self.max_s)
        return pause
