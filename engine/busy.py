"""Busy time of one stage thread (a worker slot, the output stage), read by the core for the busy share."""
from __future__ import annotations

from typing import Callable, Optional


class BusyTime:
    """Seconds a thread spent on work, the running piece up to now.

    The state is one tuple (seconds in finished pieces, start of the running one or None), replaced whole,
    so the core thread reads a consistent pair while the stage's thread updates it, without a lock.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._t: tuple[float, Optional[float]] = (0.0, None)

    def start(self) -> None:
        self._t = (self._t[0], self._clock())

    def end(self) -> None:
        """The running piece is over (a no-op when none runs)."""
        done, since = self._t
        if since is not None:
            self._t = (done + max(0.0, self._clock() - since), None)

    @property
    def since(self) -> Optional[float]:
        """When the running piece started (None: idle)."""
        return self._t[1]

    def seconds(self, now: float) -> float:
        done, since = self._t
        return done + (max(0.0, now - since) if since is not None else 0.0)
