"""One model pool: a dispatcher thread, a pure scheduler, and one or more worker threads.

The dispatcher is the only thread that touches the scheduler. It pulls frames from the rings
only when a worker is idle, so while every worker is busy new frames stay in the rings, where
live rings overwrite the oldest (drop-oldest) and offline rings push back on the decoder.
Results are published in dispatch order (a small reorder buffer), so each stream's results
stay in sequence even when several workers finish out of order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Callable, Optional, Sequence

from .accounting import Accounting
from .executor import BatchResult, WorkerThread
from .frame import DropReason, FailReason
from .latency import LatencyModel
from .metrics import Metrics
from .publisher import Publisher
from .ring import FrameRing, FrameView
from .scheduler import EdfScheduler
from .workers.base import Worker

log = logging.getLogger("vidar.pool")

LOG_EVERY_S = 5.0  # drops are logged in aggregate, never per frame


class Pool:
    def __init__(self, name: str, workers: Sequence[Worker], *, max_batch: int, max_wait_s: float,
                 publisher: Publisher, threads: Optional[int] = None, metrics: Optional[Metrics] = None,
                 on_stream_done: Callable[[str, str], None] = lambda p, s: None,
                 stage2: Optional[Callable[[list, list], list]] = None,
                 worker_factory: Optional[Callable[[], Worker]] = None,
                 max_failures: int = 3, failure_window_s: float = 60.0, batch_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        if not workers:
            raise ValueError("a pool needs at least one worker")
        self.name, self.workers = name, list(workers)
        self.worker = self.workers[0]
        self.acct = Accounting(name)
        self.scheduler = EdfScheduler(max_batch=max_batch, latency=LatencyModel(), max_wait_s=max_wait_s)
        self._publisher, self._metrics, self._on_done = publisher, metrics, on_stream_done
        self._clock, self._threads = clock, threads
        self._stage2 = stage2  # a shared stage run in dispatch order after the workers (SAM 2's decoder)
        # Faults: a failed or hung batch gets a fresh worker; K failures in W seconds kill the engine.
        self._factory = worker_factory
        self._max_failures, self._window_s, self._batch_timeout_s = max_failures, failure_window_s, batch_timeout_s
        self._failures: deque = deque()
        self.rebuilds = 0
        self._rings: dict[str, FrameRing] = {}
        self._done: set[str] = set()
        self._removals: list = []
        self._lock = threading.Lock()        # rings
        self._out_lock = threading.Lock()    # reorder buffer and publication
        self._completed: dict[int, BatchResult] = {}
        self._next_publish = 0
        self._next_batch = 0
        self._timings: deque = deque()       # (batch size, seconds) from workers, for the scheduler
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pool-{name}", daemon=True)
        self._runners: list[WorkerThread] = []
        self._pending_log: Counter = Counter()
        self._log_lock = threading.Lock()
        self._last_log = time.monotonic()
        self.batches = 0
        self.error: Optional[BaseException] = None

    # -- wiring -----------------------------------------------------------------------------
    def add_ring(self, ring: FrameRing) -> None:
        with self._lock:
            self._rings[ring.stream] = ring
            self._done.discard(ring.stream)  # a stream id may come back after a removal
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def remove_stream(self, stream: str, timeout: float = 5.0) -> bool:
        """Forget a stream: the dispatcher drops what it holds of it (stream_removed). Waits for that."""
        done = threading.Event()
        with self._lock:
            self._removals.append((stream, done))
        self.wake()
        return done.wait(timeout) if self._thread.is_alive() else self._apply_removals() or True

    def warmup(self) -> None:
        sizes = sorted({1, self.scheduler.max_batch})
        for b, seconds in self.worker.warmup(sizes).items():
            self.scheduler.update(b, seconds)
        log.info("pool %s: %d worker(s); warm-up %s", self.name, len(self.workers),
                 ", ".join(f"b{b}={s * 1e3:.1f}ms" for b, s in self.scheduler.latency.measured().items()))

    def start(self) -> None:
        self._runners = [self._new_runner(i, w) for i, w in enumerate(self.workers)]
        self._thread.start()

    def stop(self, *, drain: bool, timeout: float) -> bool:
        """drain: finish what the rings and scheduler hold; else drop it. Returns True if every thread ended."""
        t_end = time.monotonic() + timeout
        if self._thread.ident is None:  # never started (start-up failed): nothing runs
            return True
        if not drain:
            self._abort.set()
        self._stop.set()
        self.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(2.0)
        ok = not self._thread.is_alive()
        for r in self._runners:
            ok &= r.stop(max(0.1, t_end - time.monotonic()))
        return ok

    # -- dispatcher thread --------------------------------------------------------------------
    def _idle_runner(self) -> Optional[WorkerThread]:
        return next((r for r in self._runners if r.idle and not r.abandoned), None)

    def _new_runner(self, index: int, worker: Worker) -> WorkerThread:
        return WorkerThread(self.name, index, worker, threads=self._threads, on_done=self._completed_batch,
                            clock=self._clock)

    def _watchdog(self, now: float) -> None:
        """A batch running longer than batch_timeout_s is hung: fail its frames, replace its worker."""
        for i, r in enumerate(self._runners):
            current, since = r.current, r.busy_since
            if current is None or since is None or now - since <= self._batch_timeout_s:
                continue
            batch_id, frames = current
            r.abandoned = True
            for fv in frames:
                fv.release()
            log.error("pool %s: batch of %d hung for %.1f s on worker %d: replacing the worker", self.name,
                      len(frames), now - since, i)
            self._runners[i] = self._new_runner(i, self._rebuilt(i))
            err = TimeoutError(f"batch outran faults.batch_timeout_s={self._batch_timeout_s}")
            self._completed_batch(BatchResult(batch_id, frames, fail_reason=FailReason.MODEL_HANG, error=err,
                                              worker=i))

    def _rebuilt(self, i: int) -> Worker:
        """A fresh worker instance for slot i (the old one may be in a bad state)."""
        if self._factory is None:
            return self.workers[i]
        self.rebuilds += 1
        self.workers[i] = self._factory()
        return self.workers[i]

    def _record_failure(self, reason: str) -> None:
        now = self._clock()
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self._window_s:
            self._failures.popleft()
        if len(self._failures) >= self._max_failures and self.error is None:
            from .errors import EngineDeadError
            self.error = EngineDeadError(f"pool {self.name}: {len(self._failures)} failed batches within "
                                         f"{self._window_s:g} s (last: {reason})")

    def _run(self) -> None:
        try:
            while True:
                if self._abort.is_set():
                    self._abort_pending()
                    return
                self._wake.clear()  # before pulling: a frame written after this point re-sets it
                self._apply_removals()
                while self._timings:
                    self.scheduler.update(*self._timings.popleft())
                self._watchdog(self._clock())
                runner = self._idle_runner()
                wake_at = None
                if runner is not None:
                    now = self._clock()
                    self._pull(now)
                    plan = self.scheduler.schedule(now)
                    for fv in plan.dropped:
                        self._drop(fv, DropReason.DEADLINE)
                    if plan.batch:
                        self._dispatch(runner, plan.batch, now)
                        continue
                    wake_at = plan.wake_at
                    if all(r.idle for r in self._runners):
                        self._check_done()
                        if self._stop.is_set() and self.scheduler.pending() == 0 and self._all_rings_idle():
                            return
                self._log_drops()
                timeout = 0.1 if wake_at is None else max(0.0, min(0.1, wake_at - self._clock()))
                self._wake.wait(timeout)
        except BaseException as err:  # engine-dead: the engine reports it and exits non-zero
            self.error = err
            log.exception("pool %s: dispatcher crashed", self.name)

    def _pull(self, now: float) -> None:
        with self._lock:
            rings = list(self._rings.values())
        for ring in rings:
            for fv in ring.take_ready():
                if self._metrics:
                    self._metrics.observe(self.name, "decode", fv.meta.decode_s)
                    self._metrics.observe(self.name, "queue_wait", max(0.0, now - fv.meta.t_decoded))
                fv.meta.extra["t_taken"] = now
                self.scheduler.add(fv, deadline=fv.meta.deadline, now=now, key=fv.meta.stream)

    def _dispatch(self, runner: WorkerThread, batch: list[FrameView], now: float) -> None:
        if self._metrics:
            for fv in batch:
                self._metrics.observe(self.name, "batch_wait", max(0.0, now - fv.meta.extra.get("t_taken", now)))
        batch_id = self._next_batch
        self._next_batch += 1
        runner.submit(batch_id, batch)

    def _all_rings_idle(self) -> bool:
        with self._lock:
            return all(r.drained() or r.held() == 0 for r in self._rings.values())

    def _drop(self, fv: FrameView, reason: DropReason) -> None:
        self.acct.drop(fv.meta.stream, reason)
        self._note_drop(fv.meta.stream, reason)
        fv.release()

    def _note_drop(self, stream: str, reason: DropReason) -> None:
        with self._log_lock:
            self._pending_log[(stream, reason.value)] += 1

    # -- completion (called on worker threads) ------------------------------------------------
    def _completed_batch(self, res: BatchResult) -> None:
        with self._out_lock:
            if res.batch_id < self._next_publish or res.batch_id in self._completed:
                return  # already resolved (the watchdog declared it hung)
            self._completed[res.batch_id] = res
            while self._next_publish in self._completed:
                self._finish(self._completed.pop(self._next_publish))
                self._next_publish += 1
        runner = self._runners[res.worker]
        if res.fail_reason is not None and res.fail_reason is not FailReason.MODEL_HANG and self._factory:
            runner.worker = self._rebuilt(res.worker)  # this runs on the runner's own thread: safe to swap
        runner.idle = True
        self.wake()

    def _finish(self, res: BatchResult) -> None:
        if res.fail_reason is not None:
            for fv in res.frames:
                self.acct.fail(fv.meta.stream, res.fail_reason)
            log.error("pool %s: batch of %d failed (%s): %s: %s", self.name, len(res.frames),
                      res.fail_reason.value, type(res.error).__name__, res.error)
            self._record_failure(f"{res.fail_reason.value}: {res.error}")
            return
        if self._stage2 is not None:
            t0 = self._clock()
            try:
                res.outputs = self._stage2(res.frames, res.outputs)
            except Exception as err:
                res.fail_reason, res.error = FailReason.MODEL_ERROR, err
                self._finish(res)
                return
            res.elapsed += self._clock() - t0
        self.batches += 1
        self._timings.append((len(res.frames), res.elapsed))
        if self._metrics:
            for _ in res.frames:
                self._metrics.observe(self.name, "inference", res.elapsed)
        now = self._clock()
        worker = self.workers[res.worker]
        for fv, fields in zip(res.frames, res.outputs):
            if fv.meta.live and now > fv.meta.deadline:
                self.acct.drop(fv.meta.stream, DropReason.LATE)  # the model ran long: never publish late
                self._note_drop(fv.meta.stream, DropReason.LATE)
                continue
            self._publisher.submit_result(self.acct, fv.meta, worker.kind, worker.weights_tag, fields)

    # -- stream completion, abort, logs -------------------------------------------------------
    def _check_done(self) -> None:
        with self._lock:
            rings = [r for s, r in self._rings.items() if s not in self._done]
        for ring in rings:
            stream = ring.stream
            if ring.drained() and ring.held() == 0 and not self.scheduler.count(lambda fv: fv.meta.stream == stream):
                with self._lock:
                    self._done.add(stream)
                self._on_done(self.name, stream)

    def _apply_removals(self) -> None:
        with self._lock:
            removals, self._removals = self._removals, []
        for stream, done in removals:
            with self._lock:
                ring = self._rings.pop(stream, None)
            for fv in self.scheduler.remove(lambda fv: fv.meta.stream == stream):
                self._drop(fv, DropReason.STREAM_REMOVED)
            self.scheduler.forget(stream)
            if ring is not None:
                ring.close()
                for fv in ring.take_ready():
                    self._drop(fv, DropReason.STREAM_REMOVED)
            with self._lock:
                self._done.add(stream)
            done.set()

    def _abort_pending(self) -> None:
        for fv in self.scheduler.remove(lambda fv: True):
            self._drop(fv, DropReason.SHUTDOWN)
        with self._lock:
            rings = list(self._rings.values())
        for ring in rings:
            for fv in ring.take_ready():
                self._drop(fv, DropReason.SHUTDOWN)

    def _log_drops(self) -> None:
        now = time.monotonic()
        if self._pending_log and now - self._last_log >= LOG_EVERY_S:
            with self._log_lock:
                counts, self._pending_log = self._pending_log, Counter()
            by_stream: dict[str, list[str]] = {}
            for (stream, reason), n in sorted(counts.items()):
                by_stream.setdefault(stream, []).append(f"{n} {reason}")
            for stream, parts in by_stream.items():
                log.info("stream %s: pool %s dropped %s in %.0f s", stream, self.name, ", ".join(parts),
                         now - self._last_log)
            self._last_log = now
