"""`join` and `alive` for a class that runs one thread of its own in `self._thread`
(the engine core, a stream's decoder thread)."""

from __future__ import annotations

import threading
from typing import Optional


class OwnThread:
    _thread: threading.Thread

    def join(self, timeout: Optional[float] = None) -> bool:
        """True if the thread has ended within `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
