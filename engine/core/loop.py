"""The engine core: one thread that owns the engine's state and drives the pools.

As in vLLM's engine core, state has one owner and everything else sends it messages: the control
socket, the CLI and `Engine.start`/`Engine.stop` call `submit(request)` with a typed request
(engine/core/requests.py: AddStream, RemoveStream, Stop), which queues it; the core thread applies
queued requests between steps, so adding or removing a stream never races a batch being formed. A step:
apply messages; for each pool, pull ready frames, schedule, dispatch, watchdog; queue the eos of
streams that are done; check the fault policy. Sockets, decoding and models run on other threads.

Shutdown is a state machine: running -> draining (decoders stopped, pools finish what they hold,
up to `shutdown_timeout_s`) -> aborting (what is left is dropped as shutdown) -> stopped. Engine
death (a pool's fault policy, or this thread crashing) fails every frame in flight (engine_dead)
and queues every stream's eos with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Optional, Sequence, get_args

from engine.errors import ControlError
from engine.frames.lifecycle import DropReason, FailReason
from engine.executor.pool import Pool
from engine.core.requests import AddStream, CoreRequest, RemoveStream, Stop
from engine.core.stream_table import StreamTable
from engine.util.threads import OwnThread, settle

log = logging.getLogger("vidar.core")


class EngineCore(OwnThread):
    def __init__(self, pools: dict[str, Pool], table: StreamTable, *, shutdown_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 supervised: Sequence[Callable[[], Optional[str]]] = ()):
        self.pools, self.table = pools, table
        # health checks of the engine's other long-lived threads (the publisher, the view's encoder), run
        # every step: each restarts its thread itself where it can and returns why not when it cannot
        # (then the engine dies, loudly, exit 3). Pools check their own workers and output stage in step().
        self._supervised = tuple(supervised)
        self._shutdown_timeout_s, self._clock = shutdown_timeout_s, clock
        self._inbox: deque = deque()  # (CoreRequest, Future): applied between steps, in the order they came
        self._wake = threading.Event()
        self._absorb = 0  # frames_ready calls that may go without a wake-up (Pool.wake_slack), set by the core
        self.state = "created"   # running -> draining -> stopped
        self._drain_until: Optional[float] = None
        self._draining = True  # begin_stop(drain=False): an abort, not a drain that ran out of time
        self.dead: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)

    # -- other threads ------------------------------------------------------------------------------
    def start(self) -> None:
        self.state = "running"
        self._thread.start()

    def wake(self) -> None:
        # Event.set() takes the event's lock and notifies even when the flag is already up; checking first (no
        # lock) skips that while a step is due anyway. Safe: the frame is READY before its writer calls wake, and
        # the core clears the flag before it pulls, so a wake skipped because the flag was still up is followed by
        # a pull that sees the frame.
        if not self._wake.is_set():
            self._wake.set()

    def frames_ready(self, n: int = 1) -> None:
        """n frames were committed to rings (every ingest thread, the ingest I/O thread once per batch it read).
        Wakes the core unless its pools are waiting for batches to fill and these frames do not fill one
        (Pool.wake_slack): then it steps at the wait's limit anyway. Safe: `_absorb` is 0 from before the core
        pulls until after its pools have said their slack, so a frame readied meanwhile wakes it; a wake skipped
        by a stale count only moves a dispatch to the step already due at the batch's wait limit."""
        if self._absorb >= n:
            self._absorb -= n
            return
        self._absorb = 0
        self.wake()

    def submit(self, request: CoreRequest) -> Future:
        """Apply `request` on the core thread between steps; its result (or ControlError) lands in the
        returned future, which may resolve later (a removal completes when the stream's eos is queued).
        A caller that gives up may cancel it: a request not applied yet is then never applied."""
        fut: Future = Future()
        if not self._thread.is_alive() and self.state != "created":
            fut.set_exception(ControlError(f"the engine core is not running ({self.dead or self.state})"))
            return fut
        self._inbox.append((request, fut))
        self._wake.set()
        return fut

    # -- the core thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._absorb = 0  # every frame readied from here until the pools' slack is known wakes the core
                self._wake.clear()  # before the work: anything arriving during it sets it again
                self._apply_messages()
                now = self._clock()
                wakes = [pool.step(now) for pool in self.pools.values()]
                self._check_dead()
                self.table.poll()
                if self.state == "draining" and self._drained(now):
                    break
                timeout = min([0.1] + [max(0.0, w - self._clock()) for w in wakes if w is not None])
                if self.state == "running" and self.pools:
                    self._absorb = min(pool.wake_slack() for pool in self.pools.values())
                self._wake.wait(timeout)
        except BaseException as err:  # engine-dead: fail what is in flight, eos for every stream
            log.exception("engine core crashed")
            self._die(f"engine dead: core crashed: {type(err).__name__}: {err}")
        finally:
            self.state = "stopped"
            self._fail_pending_messages()

    def _apply_messages(self) -> None:
        while self._inbox:
            req, fut = self._inbox.popleft()
            if fut.cancelled():  # its caller timed out and was told so
                continue
            try:
                out = self._apply(req)
            except Exception as err:  # the caller gets it; the core goes on
                settle(fut, exc=err)
                continue
            if isinstance(out, Future):  # e.g. an add deferred until a removal of its id completes
                fut.add_done_callback(lambda f, out=out: f.cancelled() and out.cancel())
                out.add_done_callback(lambda f, fut=fut: _follow(fut, f))
            else:
                settle(fut, out)

    def _apply(self, req: CoreRequest) -> object:
        """One request, on the core thread: its handler's result, or a Future the caller's follows."""
        match req:
            case AddStream():
                return self.table.add(req.cfg)  # later if the same id is still being removed
            case RemoveStream():
                return self.table.remove(req.stream, req.reason)  # resolves when its eos is queued
            case Stop():
                return self.begin_stop(req.drain, req.reason)
        raise ControlError(f"the engine core does not take a {type(req).__name__} request; it takes "
                           f"{', '.join(t.__name__ for t in get_args(CoreRequest))}")

    def _fail_pending_messages(self) -> None:
        while self._inbox:
            _, fut = self._inbox.popleft()
            settle(fut, exc=ControlError(f"the engine core stopped ({self.dead or 'shutdown'})"))

    def _check_dead(self) -> None:
        if self.dead is None:
            reason = next((p.faults.dead for p in self.pools.values() if p.faults.dead), None)
            reason = reason or next((why for check in self._supervised if (why := check())), None)
            if reason:
                self._die(f"engine dead: {reason}")

    def _die(self, reason: str) -> None:
        """Every frame in flight fails (engine_dead) and every stream gets its eos with the reason."""
        if self.dead is not None:
            return
        self.dead = reason
        log.error("%s", reason)
        try:
            self.table.dead_reason = reason
            self.end_all(stop=reason, fail=FailReason.ENGINE_DEAD)
        except Exception:  # best effort: the engine is dead already; the runtime exits 3
            log.exception("while failing the frames in flight")

    # -- shutdown -------------------------------------------------------------------------------------
    def begin_stop(self, drain: bool, reason: str = "shutdown") -> None:
        """Core thread (a Stop request): stop the decoders; drain for up to shutdown_timeout_s, or abort now.
        `reason` is what each stream's eos says."""
        if self.state != "running":
            return
        self.state = "draining"
        self.table.stop_all(reason)
        self._drain_until = self._clock() + (self._shutdown_timeout_s if drain else 0.0)
        self._draining = drain

    def _drained(self, now: float) -> bool:
        if self.table.all_done():
            return True
        if now < self._drain_until:
            return False
        if self._draining:
            log.warning("shutdown: drain timeout (%.1f s): dropping what is left", self._shutdown_timeout_s)
        else:
            log.info("shutdown without drain: dropping what is left")
        self.end_all(drop=DropReason.SHUTDOWN)
        return True

    def end_all(self, *, stop: Optional[str] = None, drop: Optional[DropReason] = None,
                fail: Optional[FailReason] = None) -> None:
        """Every frame still held ends now (dropped or failed) and every finished stream's eos is queued;
        with `stop`, the decoders are stopped first with that reason. The owner thread only (the core, or
        `Engine.stop` once the core has died)."""
        if stop is not None:
            self.table.stop_all(stop)
        for pool in self.pools.values():
            pool.abort(drop=drop, fail=fail)
        self.table.poll()


def _follow(outer: Future, inner: Future) -> None:
    if inner.cancelled():
        return
    if inner.exception() is not None:
        settle(outer, exc=inner.exception())
    else:
        settle(outer, inner.result())
