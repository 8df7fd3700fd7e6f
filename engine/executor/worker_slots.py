"""A pool's worker slots: one worker thread per instance, and the watchdog over them.

A slot runs one batch at a time (executor.WorkerThread). The engine core dispatches to an idle
slot; the worker thread hands the finished batch to the output stage through `_completed`,
which accepts it only while the thread's generation of the slot's Fence (fence.py) is current.
A batch that outruns `faults.batch_timeout_s` is failed by the watchdog (model_hang), which ends
that generation, and its slot gets a fresh thread (the next generation) with a rebuilt instance;
nothing the hung thread finishes later is accepted.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Optional

from engine.frames.accounting import Accounting
from engine.executor.fence import Fence
from engine.executor.messages import BatchResult
from engine.executor.worker_thread import WorkerThread
from engine.sched.faults import FaultPolicy
from engine.frames.lifecycle import FailReason
from engine.publish.metrics import Metrics
from engine.executor.output_stage import OutputStage
from engine.frames.ref import FrameRef
from engine.models.registry import PoolSpec

log = logging.getLogger("vidar.pool")


class WorkerSlots:
    def __init__(self, spec: PoolSpec, *, acct: Accounting, output: OutputStage, batch_timeout_s: float,
                 metrics: Optional[Metrics], wake: Callable[[], None], clock: Callable[[], float],
                 faults: Optional[FaultPolicy] = None):
        self.name, self.spec = spec.name, spec
        self._faults = faults
        self._acct, self._output, self._timeout_s = acct, output, batch_timeout_s
        self._metrics, self._wake, self._clock = metrics, wake, clock
        self.workers: list[WorkerThread] = []
        self._fences = [Fence() for _ in spec.models]  # one per slot, outliving the slot's threads
        self.rebuilds = 0  # worker instances replaced after a failed or hung batch
        self.frames_run = 0  # frames whose batch a worker finished (the cluster's cost per frame reads it)
        self._stopping = False
        acct.add_holder("workers", self.held)

    @property
    def models(self) -> list:
        """The worker instances in use (a failed one is replaced by its rebuilt successor)."""
        return [r.model for r in self.workers] if self.workers else list(self.spec.models)

    def start(self) -> None:
        self.workers = [self._new_worker(i, w) for i, w in enumerate(self.spec.models)]

    def stop(self, timeout: float) -> bool:
        self._stopping = True  # threads that end from here on were told to
        t_end = time.monotonic() + timeout
        ok = True
        for r in self.workers:
            ok &= r.stop(max(0.1, t_end - time.monotonic()))
        return ok

    def close(self) -> None:
        for w in {id(r.model): r.model for r in self.workers}.values():
            w.close()

    def _new_worker(self, index: int, worker) -> WorkerThread:
        return WorkerThread(self.name, index, worker, threads=self.spec.threads, on_done=self._completed,
                            factory=self._rebuild_worker if self.spec.factory else None, wake=self._wake,
                            clock=self._clock, fence=self._fences[index])

    def _rebuild_worker(self):
        """A fresh worker instance (sharing the model) for a slot whose instance failed or hung."""
        self.rebuilds += 1
        return self.spec.factory()

    # -- core thread, ledger lock held -------------------------------------------------------------
    def idle(self) -> Optional[WorkerThread]:
        return next((r for r in self.workers if r.idle and not r.abandoned), None)

    def busy_seconds(self, now: float) -> float:
        """ModelRunner-seconds spent running batches by the current slots (a replaced slot's past goes with it)."""
        return sum(r.busy_seconds(now) for r in self.workers)

    def held(self) -> Counter:
        return Counter(fv.meta.stream for r in self.workers if r.current is not None for fv in r.current.frames)

    def take_all(self) -> list[FrameRef]:
        """Abort: every batch on a worker is taken back; those threads are abandoned."""
        frames: list[FrameRef] = []
        for r in self.workers:
            if r.current is not None:
                frames += r.current.frames
                r.current = None
                r.abandon()
        return frames

    # -- worker threads -----------------------------------------------------------------------------
    def _completed(self, worker: WorkerThread, res: BatchResult) -> bool:
        """Hand the batch to the output stage, unless the watchdog already did (it ended the thread's
        generation when it took the batch back: the one check)."""
        with self._acct.lock:
            if worker.abandoned:
                return False
            worker.current = None
            self.frames_run += len(res.frames)
            self._output.submit(res)
        if self._metrics and res.fail_reason is None:
            for _ in res.frames:
                self._metrics.observe(self.name, "inference", res.elapsed)
        return True

    # -- watchdog (core thread) ---------------------------------------------------------------------
    def watchdog(self, now: float) -> None:
        """A batch running longer than batch_timeout_s is hung: it fails (model_hang), its worker thread
        is abandoned and replaced by a fresh one with a rebuilt worker. A worker thread that died (a bug
        outside its per-batch guards) is replaced too: a dead slot is never idle again, and a pool whose
        slots all died would stall every stream without a word."""
        self._replace_dead(now)
        for i, r in enumerate(list(self.workers)):
            with self._acct.lock:
                batch, since = r.current, r.busy_since
                if batch is None or since is None or now - since <= self._timeout_s:
                    continue
                r.current = None
                r.abandon()  # from here on nothing it finishes is accepted
                err = TimeoutError(f"batch outran faults.batch_timeout_s={self._timeout_s:g}")
                self._output.submit(BatchResult(batch, fail_reason=FailReason.MODEL_HANG, error=err))
            # outside the lock (a rebuild may take a while); the abandoned slot is never dispatched to
            self.workers[i] = self._new_worker(i, self._rebuild_worker() if self.spec.factory else r.model)
            for ref in batch.frames:
                ref.release()  # the hung worker may never get to it (a drop: not offered to the view)
            log.error("pool %s: batch of %d hung for %.1f s on worker %d: replaced the worker", self.name,
                      len(batch.frames), now - since, i)

    def _replace_dead(self, now: float) -> None:
        for i, r in enumerate(list(self.workers)):
            if r.alive or r.abandoned or self._stopping:
                continue
            with self._acct.lock:
                batch, r.current = r.current, None
                r.abandon()
                if batch is not None:
                    err = RuntimeError("its worker thread died")
                    self._output.submit(BatchResult(batch, fail_reason=FailReason.MODEL_ERROR, error=err))
            self.workers[i] = self._new_worker(i, self._rebuild_worker() if self.spec.factory else r.model)
            log.error("pool %s: worker thread %d died: replaced it", self.name, i)
            if batch is None and self._faults is not None:  # a failed batch is recorded by the output stage
                self._faults.record("worker thread died")
