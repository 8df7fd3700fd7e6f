"""Supervision of long-lived work that has no generation scheme of its own: the control plane's asyncio
tasks (the control socket, the live view's state ticker) and the live view's encoder thread. The engine
core checks the publisher and the view's encoder every step (`health()`); each pool replaces its own
worker threads and output stage (their batches carry generations: engine/worker_slots.py, output.py).

The rule everywhere: a task or thread that ends by itself (a bug) is restarted; after `max_failures`
ends within `window_s` the engine is dead (exit 3, with the reason). Never a silent half-life: an
engine that runs on without its publisher, its control socket or its view.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Awaitable, Callable, Optional

from engine.sched.faults import FaultPolicy

log = logging.getLogger("vidar.supervise")


class _Restarts:
    """What both kinds share: count a death, say why once there were too many, else log the restart."""

    def __init__(self, name: str, max_failures: int, window_s: float):
        self.name = name
        self._policy = FaultPolicy(name, max_failures=max_failures, window_s=window_s, what="crashes", label=name)
        self.restarts = 0

    def died(self, why: str) -> Optional[str]:
        """None: restart it now; a reason: it keeps dying."""
        self._policy.record(why)
        if self._policy.dead:
            return f"{self.name} keeps crashing: {self._policy.dead}"
        log.error("%s ended (%s): restarting it", self.name, why)
        self.restarts += 1
        return None


class SupervisedThread:
    """A daemon thread that must run until its owner stops it (the owner's `target` returns then). Call
    `health()` regularly while it should run (the engine core does, every step)."""

    def __init__(self, name: str, target: Callable[[], None], *, max_failures: int = 3, window_s: float = 60.0):
        self._target, self._restarts = target, _Restarts(name, max_failures, window_s)
        self._crash = ""
        self._start()

    def _start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=self._restarts.name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._target()
        except BaseException as err:  # outside the target's own guards (a bug): health() restarts it
            self._crash = f"{type(err).__name__}: {err}"
            log.exception("%s crashed", self._restarts.name)

    def health(self) -> Optional[str]:
        """None while the thread runs (or after it was restarted); why not, once it keeps dying."""
        if self.thread.is_alive():
            return None
        why = self._restarts.died(self._crash or "it ended")
        if why is None:
            self._start()
        return why


class SupervisedTask:
    """An asyncio task that must run until its owner stops it. Create it on the running loop; call
    `health()` from that loop regularly (the runtime's main loop does, every 0.1 s)."""

    def __init__(self, name: str, make: Callable[[], Awaitable[None]], *, max_failures: int = 3,
                 window_s: float = 60.0):
        self._make, self._restarts = make, _Restarts(name, max_failures, window_s)
        self.task = asyncio.ensure_future(make())

    def health(self) -> Optional[str]:
        """None while the task runs (or after it was restarted); why not, once it keeps ending."""
        if not self.task.done():
            return None
        err = None if self.task.cancelled() else self.task.exception()
        why = self._restarts.died(f"{type(err).__name__}: {err}" if err is not None else "it ended")
        if why is None:
            self.task = asyncio.ensure_future(self._make())
        return why

    def cancel(self) -> None:
        self.task.cancel()
