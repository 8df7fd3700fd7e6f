"""Supervision of the control plane's long-lived asyncio tasks (the control socket, the live view's state
ticker). The engine's threads are supervised where they live: the engine core checks the publisher and
the view's encoder every step (`health()`), and each pool checks its worker threads and output stage.

The rule everywhere: a task or thread that ends by itself (a bug) is restarted; after `max_failures`
ends within `window_s` the engine is dead (exit 3, with the reason). Never a silent half-life: an
engine that runs on without its publisher, its control socket or its view.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

from .faults import FaultPolicy

log = logging.getLogger("vidar.supervise")


class SupervisedTask:
    """An asyncio task that must run until its owner stops it. Create it on the running loop; call
    `health()` from that loop regularly (the runtime's main loop does, every 0.1 s)."""

    def __init__(self, name: str, make: Callable[[], Awaitable[None]], *, max_failures: int = 3,
                 window_s: float = 60.0):
        self.name, self._make = name, make
        self._policy = FaultPolicy(name, max_failures=max_failures, window_s=window_s, what="crashes", label=name)
        self.restarts = 0
        self.task = asyncio.ensure_future(make())

    def health(self) -> Optional[str]:
        """None while the task runs (or after it was restarted); why not, once it keeps ending."""
        if not self.task.done():
            return None
        err = None if self.task.cancelled() else self.task.exception()
        why = f"{type(err).__name__}: {err}" if err is not None else "it ended"
        self._policy.record(why)
        if self._policy.dead:
            return f"{self.name} keeps crashing: {self._policy.dead}"
        log.error("%s ended (%s): restarting it", self.name, why)
        self.restarts += 1
        self.task = asyncio.ensure_future(self._make())
        return None

    def cancel(self) -> None:
        self.task.cancel()
