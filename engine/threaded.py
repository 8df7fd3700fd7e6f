"""Thread helpers: `join`/`alive` for a class that runs one thread of its own in `self._thread`
(the engine core, a stream's decoder thread), and settling a Future its waiter may have cancelled."""

from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Optional


class OwnThread:
    _thread: threading.Thread

    def join(self, timeout: Optional[float] = None) -> bool:
        """True if the thread has ended within `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def settle(fut: Future, result: Any = None, exc: Optional[BaseException] = None) -> bool:
    """Resolve `fut` unless it is already done: a control request's waiter cancels its future when it
    times out (concurrent.futures raises on setting a cancelled future). True if this call resolved it."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        return True
    except InvalidStateError:
        return False
