"""Thread helpers, one module for all of them (no engine state here):

- `OwnThread`: `join`/`alive` for a class that runs one thread of its own in `self._thread` (the engine
  core, a stream's ingest thread);
- `settle`: resolving a Future its waiter may have cancelled;
- `BusyTime`: the busy time of one stage thread (a worker, the output stage), read by the core;
- intra-op thread counts per calling thread (below).

Intra-op thread counts: torch.set_num_threads reaches OpenMP's `omp_set_num_threads`, whose setting
belongs to the calling thread: each worker thread (and SAM 2's output thread) sets its own, and
warm-up, run on the engine's starting thread, borrows the workers' count for its measurement and
gives it back. One trap: torch's first parallel op on a thread (or get_num_threads) re-applies the
count last set by ANY thread, so a plain set_num_threads is undone by a later one on another thread
(measured: a thread that set 1, then another set 2, ran its next op with 2). Initialising first makes
it stick.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Iterator, Optional


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


def set_intra_op_threads(n: Optional[int]) -> None:
    """The calling thread's intra-op thread count (None: leave it as it is)."""
    if n:
        import torch
        torch.get_num_threads()  # this thread's lazy initialisation first (see above)
        torch.set_num_threads(n)


@contextlib.contextmanager
def intra_op_threads(n: Optional[int]) -> Iterator[None]:
    """Run a block with n intra-op threads on this thread, then restore the count it had."""
    if not n:
        yield
        return
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
