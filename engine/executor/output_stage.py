"""A pool's output stage: its own thread, between the workers and the publisher.

Workers hand finished batches here and go back to work. This thread, in dispatch order:
reorders batches (several workers finish out of order; each stream's results leave in order),
fails the frames of failed batches, drops frames of removed streams and live frames already
past their deadline, runs the family's output processor (SAM 2's shared tracking stage and mask
rendering), drops what finished late, and queues the rest at the publisher, which never blocks.
It also runs the requests queued for the processor (messages.py: StreamAdded, StreamRemoved,
ProcessorControl) between batches: the processor's state has this thread as its one owner.
What goes back to the pool are messages too: the drops it counts go to the pool's DropLog, and
the (batch size, seconds) timings wait in a bounded queue the pool's step drains (take_timings).

The engine core's watchdog covers it: a batch whose output step runs past `batch_timeout_s` fails
(model_hang) and a fresh thread takes over the stage. Every thread works under a generation of
the stage's Fence (fence.py) and commits anything (processor state, frames' terminal states)
only under the ledger lock and only while its generation is current, so a hung thread that wakes
up later changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from typing import Callable, Optional

from engine.frames.accounting import Accounting
from engine.frames.drop_log import DropLog
from engine.util.threads import BusyTime
from engine.executor.fence import Fence
from engine.executor.messages import BatchResult, OutputRequest, ProcessorControl, StreamAdded, StreamRemoved
from engine.util.threads import set_intra_op_threads
from engine.sched.faults import FaultPolicy
from engine.frames.lifecycle import DropReason, FailReason
from engine.publish.publisher import Publisher
from engine.models.base import PostProcessor

log = logging.getLogger("vidar.output")


class OutputStage:
    def __init__(self, pool: str, *, weights: str, acct: Accounting, publisher: Publisher,
                 faults: FaultPolicy, drop_log: DropLog, processor: Optional[PostProcessor] = None,
                 clock: Callable[[], float] = time.monotonic, threads: Optional[int] = None):
        self.pool, self.weights = pool, weights
        self._threads = threads  # intra-op threads of this stage's thread (SAM 2's tracking stage)  # the pool's name is its results' type and topic
        self._acct, self._publisher, self._faults, self.processor = acct, publisher, faults, processor
        self._drop_log = drop_log  # the pool's: it notes the drops here, the pool's step flushes it
        self._clock = clock
        # everything below is guarded by the ledger lock (acct.lock)
        self._inbox: deque[BatchResult] = deque()
        self._reorder: dict[int, BatchResult] = {}
        self._current: Optional[BatchResult] = None
        self._next = 0                    # batch id to publish next
        self._streams: set[str] = set()   # streams whose frames are processed; others are dropped
        self._requests: deque = deque()   # (OutputRequest, Future): run between batches on this stage's thread
        self._timings: deque = deque(maxlen=1024)  # (batch size, seconds dispatch -> output done), for the pool
        self._fence = Fence()             # a thread commits only while its generation is current
        # read by the core for the pool's busy share: SAM 2's tracking stage runs here, not on a worker
        self._busy = BusyTime(self._clock)
        self._stop = False
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.replacements = 0
        self._crash = ""  # why the last thread died, if one did
        acct.add_holder("output", self._held)

    # -- other threads ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, args=(self._fence.ticket(),), name=f"output-{self.pool}",
                                        daemon=True)
        self._thread.start()

    def submit(self, res: BatchResult) -> None:
        """A finished (or failed) batch. The caller holds the ledger lock."""
        self._inbox.append(res)
        self._wake.set()

    def request(self, req: OutputRequest) -> Future:
        """Run a request on this stage's thread between batches (the processor's owner); its reply
        (ProcessorControl: the reply's extra fields) or exception lands in the future."""
        fut: Future = Future()
        with self._acct.lock:
            self._requests.append((req, fut))
        self._wake.set()
        return fut

    def take_timings(self) -> list[tuple[int, float]]:
        """Core thread: the (batch size, seconds dispatch -> output done) of the batches published since
        the last call, oldest first (the scheduler's latency model learns from them)."""
        out = []
        while self._timings:  # deque pops are atomic: the stage's thread may append meanwhile
            out.append(self._timings.popleft())
        return out

    def add_stream(self, stream: str) -> None:
        with self._acct.lock:
            self._streams.add(stream)
        if self.processor is not None:
            self.request(StreamAdded(stream))

    def remove_stream(self, stream: str) -> None:
        """From now on the stream's frames are dropped here (stream_removed); its processor state goes."""
        with self._acct.lock:
            self._streams.discard(stream)
        if self.processor is not None:
            self.request(StreamRemoved(stream))

    def _held(self) -> Counter:
        n: Counter = Counter()
        for res in [*self._inbox, *self._reorder.values(), *([self._current] if self._current else [])]:
            n.update(fv.meta.stream for fv in _pending(res))
        return n

    @property
    def busy_since(self) -> Optional[float]:
        """When the running batch started (None: idle)."""
        return self._busy.since

    def busy_seconds(self, now: float) -> float:
        """Seconds this stage has spent on output steps, the running one up to `now`."""
        return self._busy.seconds(now)

    def check_hung(self, now: float, timeout_s: float) -> bool:
        """Core thread: an output step running past `timeout_s` fails its batch (model_hang), and a
        new thread with the next generation takes over the stage."""
        with self._acct.lock:
            res, since = self._current, self.busy_since
            if res is None or since is None or now - since <= timeout_s:
                return False
            self._fence.end()
            self._current = None
            self._busy.end()
            for fv in _pending(res):
                self._acct.fail(fv.meta.stream, FailReason.MODEL_HANG)
            self._next += 1
            self.replacements += 1
        log.error("pool %s: output step of a batch of %d hung for %.1f s: replacing the output thread",
                  self.pool, len(res.frames), now - since)
        self._faults.record(f"model_hang: output step outran faults.batch_timeout_s={timeout_s:g}")
        self.start()
        return True

    def check_alive(self) -> bool:
        """Core thread: the stage's thread ended although nobody stopped it (a bug outside the per-batch
        guard, e.g. in a processor's events): the batch in hand fails (output_error), the fault is
        recorded and a fresh thread with the next generation takes over. Never a stage that silently
        stops publishing."""
        thread = self._thread
        if thread is None or thread.is_alive():
            return False
        with self._acct.lock:
            if self._stop or thread is not self._thread:
                return False
            res, self._current = self._current, None
            self._fence.end()
            self._busy.end()
            if res is not None:
                for fv in _pending(res):
                    self._acct.fail(fv.meta.stream, FailReason.OUTPUT_ERROR)
                self._next += 1
            self.replacements += 1
        why = self._crash or "ended"
        log.error("pool %s: output thread died (%s): replacing it", self.pool, why)
        self._faults.record(f"output thread died: {why}")
        self.start()
        return True

    def abort(self, *, drop: Optional[DropReason] = None, fail: Optional[FailReason] = None) -> None:
        """Shutdown or engine death: every frame this stage holds ends now (dropped or failed). The
        running thread's generation ends too: what it finishes is ignored."""
        with self._acct.lock:
            self._fence.end()
            held = [*self._inbox, *self._reorder.values(), *([self._current] if self._current else [])]
            self._inbox.clear()
            self._reorder.clear()
            self._current = None
            self._busy.end()
            self._stop = True
            for res in held:
                for fv in _pending(res):
                    (self._acct.drop(fv.meta.stream, drop) if drop else self._acct.fail(fv.meta.stream, fail))
        self._wake.set()

    def stop(self, timeout: float) -> bool:
        """After the pool's workers stopped: finish what is queued, then end the thread."""
        with self._acct.lock:
            self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    # -- the stage's thread -------------------------------------------------------------------------
    def _run(self, gen: int) -> None:
        try:
            self._loop(gen)
        except BaseException as err:  # outside the per-batch guard: the core's check_alive replaces the thread
            self._crash = f"{type(err).__name__}: {err}"
            log.exception("pool %s: output thread crashed", self.pool)

    def _loop(self, gen: int) -> None:
        set_intra_op_threads(self._threads)
        while True:
            self._run_requests(gen)
            with self._acct.lock:
                if not self._fence.admits(gen):
                    return
                while self._inbox:
                    res = self._inbox.popleft()
                    self._reorder[res.batch.id] = res
                res = self._reorder.pop(self._next, None)
                if res is None:
                    if self._stop and not self._requests:
                        return
                    self._wake.clear()
                else:
                    self._current = res
                    self._busy.start()
            if res is None:
                self._wake.wait(0.1)
                continue
            try:
                self._process(res, gen)
            except Exception as err:  # a bug here must not stall the stage: this batch fails, the next goes on
                log.exception("pool %s: output step failed", self.pool)
                self._fail_current(res, gen, FailReason.OUTPUT_ERROR, err)
            self._emit_events()

    def _run_requests(self, gen: int) -> None:
        while True:
            with self._acct.lock:
                if not self._fence.admits(gen) or not self._requests:
                    return
                req, fut = self._requests.popleft()
            try:
                fut.set_result(self._apply(req))
            except BaseException as err:  # the caller gets it; the stage goes on
                fut.set_exception(err)
            self._emit_events()

    def _apply(self, req: OutputRequest) -> object:
        """One request, on this stage's thread."""
        if isinstance(req, ProcessorControl):
            if self.processor is None:
                raise NotImplementedError(f"pool {self.pool} has no output processor for {req.op}")
            return self.processor.control(req.op, req.request)
        if isinstance(req, StreamAdded):
            return self.processor.add_stream(req.stream) if self.processor is not None else None
        if isinstance(req, StreamRemoved):
            return self.processor.remove_stream(req.stream) if self.processor is not None else None
        raise TypeError(f"output stage: unknown request {req!r}")

    def _emit_events(self) -> None:
        """The processor's events (a prompt rejected, an object dropped), after the results before them."""
        if self.processor is not None:
            for stream, kind, reason in self.processor.events():
                self._publisher.submit_event(stream, kind, reason)

    def _fail_current(self, res: BatchResult, gen: int, reason: FailReason, err: BaseException) -> None:
        with self._acct.lock:
            if not self._fence.admits(gen) or self._current is not res:
                return
            for fv in _pending(res):
                self._acct.fail(fv.meta.stream, reason)
            self._current = None
            self._busy.end()
            self._next += 1
        if res.error is None:
            res.error = err
        self._faults.record(f"{reason.value}: {type(err).__name__}: {err}")

    def _process(self, res: BatchResult, gen: int) -> None:
        if res.fail_reason is not None:
            log.error("pool %s: batch of %d failed (%s): %s: %s", self.pool, len(res.frames), res.fail_reason.value,
                      type(res.error).__name__, res.error)
            self._fail_current(res, gen, res.fail_reason, res.error)
            return
        keep = self._drop_before_processing(res, gen)
        if keep is None:
            return
        fields = [res.outputs[i] for i in keep]
        commit: Callable[[], None] = lambda: None
        if self.processor is not None and keep:
            fields, commit = self.processor.process([res.frames[i] for i in keep], fields)
        self._publish(res, gen, keep, fields, commit)

    def _drop_before_processing(self, res: BatchResult, gen: int) -> Optional[list[int]]:
        """Frames of removed streams, and live frames already late: no output compute is spent on them."""
        now = self._clock()
        keep = []
        with self._acct.lock:
            if not self._fence.admits(gen):
                return None
            for i, fv in enumerate(res.frames):
                if fv.meta.stream not in self._streams:
                    self._drop(res, i, DropReason.STREAM_REMOVED)
                elif fv.meta.live and now > fv.meta.deadline:
                    self._drop(res, i, DropReason.LATE)
                else:
                    keep.append(i)
        return keep

    def _drop(self, res: BatchResult, i: int, reason: DropReason) -> None:
        """Ledger lock held. The frame stays in the batch list (indices stay valid) but is marked done."""
        fv = res.frames[i]
        self._acct.drop(fv.meta.stream, reason)
        self._drop_log.note(fv.meta.stream, reason)
        res.frames[i] = _Done(fv.meta)

    def _publish(self, res: BatchResult, gen: int, keep: list[int], fields: list, commit: Callable[[], None]) -> None:
        now = self._clock()
        items, failed = [], []
        with self._acct.lock:
            if not self._fence.admits(gen):
                return  # replaced by the watchdog: this thread's work is void
            commit()
            for i, f in zip(keep, fields):
                fv = res.frames[i]
                if isinstance(f, BaseException):
                    self._acct.fail(fv.meta.stream, FailReason.OUTPUT_ERROR)
                    failed.append(f)
                elif fv.meta.live and now > fv.meta.deadline:
                    self._acct.drop(fv.meta.stream, DropReason.LATE)  # the model ran long: never publish late
                    self._drop_log.note(fv.meta.stream, DropReason.LATE)
                else:
                    items.append((fv.meta, self.pool, self.weights, f))
            self._current = None
            self._busy.end()
            self._next += 1
            self._publisher.submit_results(self._acct, items)
        if keep:
            self._timings.append((len(res.frames), now - res.batch.t_dispatch))
        for err in failed:
            log.error("pool %s: output of a frame failed: %s: %s", self.pool, type(err).__name__, err)
            self._faults.record(f"output_error: {type(err).__name__}: {err}")


class _Done:
    """Stands in for a frame that already reached its terminal state inside a batch."""

    __slots__ = ("meta",)

    def __init__(self, meta):
        self.meta = meta


def _pending(res: BatchResult) -> list:
    """The batch's frames that have not reached a terminal state yet."""
    return [fv for fv in res.frames if not isinstance(fv, _Done)]
