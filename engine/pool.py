"""One model pool: a thread that pulls frames from the rings, asks the scheduler, runs the worker.

The pool thread is the only one that touches its scheduler and worker. It pulls frames only
when its worker is free, so while a batch runs new frames stay in the rings, where live
rings can overwrite the oldest (drop-oldest) and offline rings push back on the decoder.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, Optional

from .accounting import Accounting
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
    def __init__(self, name: str, worker: Worker, *, max_batch: int, max_wait_s: float, publisher: Publisher,
                 metrics: Optional[Metrics] = None, on_stream_done: Callable[[str, str], None] = lambda p, s: None,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.worker = name, worker
        self.acct = Accounting(name)
        self.scheduler = EdfScheduler(max_batch=max_batch, latency=LatencyModel(), max_wait_s=max_wait_s)
        self._publisher, self._metrics, self._on_done = publisher, metrics, on_stream_done
        self._clock = clock
        self._rings: dict[str, FrameRing] = {}
        self._done: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pool-{name}", daemon=True)
        self._pending_log: Counter = Counter()
        self._last_log = time.monotonic()
        self.batches = 0
        self.error: Optional[BaseException] = None

    # -- wiring -----------------------------------------------------------------------------
    def add_ring(self, ring: FrameRing) -> None:
        with self._lock:
            self._rings[ring.stream] = ring
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def warmup(self) -> None:
        sizes = sorted({1, self.scheduler.max_batch})
        for b, seconds in self.worker.warmup(sizes).items():
            self.scheduler.update(b, seconds)
        log.info("pool %s: warm-up %s", self.name,
                 ", ".join(f"b{b}={s * 1e3:.1f}ms" for b, s in self.scheduler.latency.measured().items()))

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, drain: bool, timeout: float) -> bool:
        """drain: finish what the rings and scheduler hold; else drop it. Returns True if the thread ended."""
        if not drain:
            self._abort.set()
        self._stop.set()
        self.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(2.0)
        return not self._thread.is_alive()

    # -- thread body ------------------------------------------------------------------------
    def _pull(self, now: float) -> None:
        with self._lock:
            rings = list(self._rings.values())
        for ring in rings:
            for fv in ring.take_ready():
                if self._metrics:
                    self._metrics.observe(self.name, "decode", fv.meta.decode_s)
                    self._metrics.observe(self.name, "queue_wait", max(0.0, now - fv.meta.t_decoded))
                fv.meta.extra["t_taken"] = now
                self.scheduler.add(fv, deadline=fv.meta.deadline, now=now)

    def _run(self) -> None:
        try:
            while True:
                if self._abort.is_set():
                    self._abort_pending()
                    return
                self._wake.clear()  # before pulling: a frame written after this point re-sets it
                now = self._clock()
                self._pull(now)
                plan = self.scheduler.schedule(now)
                for fv in plan.dropped:
                    self._drop(fv, DropReason.DEADLINE)
                if plan.batch:
                    self._run_batch(plan.batch)
                    continue
                self._check_done()
                if self._stop.is_set() and self.scheduler.pending() == 0 and self._all_rings_idle():
                    return
                self._log_drops()
                timeout = 0.1 if plan.wake_at is None else max(0.0, min(0.1, plan.wake_at - self._clock()))
                self._wake.wait(timeout)
        except BaseException as err:  # engine-dead: the engine reports it and exits non-zero
            self.error = err
            log.exception("pool %s: crashed", self.name)

    def _all_rings_idle(self) -> bool:
        with self._lock:
            return all(r.drained() or r.held() == 0 for r in self._rings.values())

    def _drop(self, fv: FrameView, reason: DropReason) -> None:
        self.acct.drop(fv.meta.stream, reason)
        self._pending_log[(fv.meta.stream, reason.value)] += 1
        fv.release()

    def _run_batch(self, batch: list[FrameView]) -> None:
        t0 = self._clock()
        for fv in batch:
            if self._metrics:
                self._metrics.observe(self.name, "batch_wait", max(0.0, t0 - fv.meta.extra.get("t_taken", t0)))
        try:
            inputs = self.worker.prepare(batch)
        except Exception as err:
            self._fail(batch, FailReason.PREPROCESS_ERROR, err)
            return
        finally:
            for fv in batch:
                fv.release()  # the input batch is built: decoding may reuse the slots now
        try:
            outputs = self.worker.infer(inputs)
            if len(outputs) != len(batch):
                raise RuntimeError(f"worker returned {len(outputs)} outputs for {len(batch)} frames")
        except Exception as err:
            self._fail(batch, FailReason.MODEL_ERROR, err)
            return
        elapsed = self._clock() - t0
        self.batches += 1
        self.scheduler.update(len(batch), elapsed)
        if self._metrics:
            for _ in batch:
                self._metrics.observe(self.name, "inference", elapsed)
        now = self._clock()
        for fv, fields in zip(batch, outputs):
            if fv.meta.live and now > fv.meta.deadline:
                self.acct.drop(fv.meta.stream, DropReason.LATE)  # the model ran long: never publish late
                self._pending_log[(fv.meta.stream, DropReason.LATE.value)] += 1
                continue
            self._publisher.submit_result(self.acct, fv.meta, self.worker.kind, self.worker.weights_tag, fields)

    def _fail(self, batch: list[FrameView], reason: FailReason, err: Exception) -> None:
        for fv in batch:
            self.acct.fail(fv.meta.stream, reason)
        log.error("pool %s: batch of %d failed (%s): %s: %s", self.name, len(batch), reason.value,
                  type(err).__name__, err)

    def _check_done(self) -> None:
        with self._lock:
            rings = [r for s, r in self._rings.items() if s not in self._done]
        for ring in rings:
            stream = ring.stream
            if ring.drained() and ring.held() == 0 and not self.scheduler.count(lambda fv: fv.meta.stream == stream):
                self._done.add(stream)
                self._on_done(self.name, stream)

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
            by_stream: dict[str, list[str]] = {}
            for (stream, reason), n in sorted(self._pending_log.items()):
                by_stream.setdefault(stream, []).append(f"{n} {reason}")
            for stream, parts in by_stream.items():
                log.info("stream %s: pool %s dropped %s in %.0f s", stream, self.name, ", ".join(parts),
                         now - self._last_log)
            self._pending_log.clear()
            self._last_log = now
