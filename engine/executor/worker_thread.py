"""ModelRunner threads: each runs batches on one worker instance, so a pool can run several at once.

Why threads: the model releases the GIL inside its kernels. On a 2-core CPU, two instances
with one intra-op thread each beat one instance with two threads by ~1.5x when a decoder
thread shares the cores (measured: 91 vs 59 frames/s, vit_tiny at batch 4 on 720p), because
OpenMP's barrier-synchronised parallel regions stall whenever the decoder takes a core.

A worker thread owns nothing shared: the engine core hands it a Batch (`current`, set under the
pool's ledger lock), and it hands the BatchResult back through `on_done`, which accepts it only
while the thread's generation of its slot's Fence (fence.py) is current (the watchdog may have
declared it hung and replaced this thread meanwhile). A replaced thread ends after its batch and
never touches the pool again.

Once the model input is built, the thread releases the batch's frames as seen: their ring offers
them to the live view on the way (engine.frames), so this thread knows nothing of the view.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

from engine.util.threads import BusyTime
from engine.executor.fence import Fence
from engine.executor.messages import Batch, BatchResult
from engine.frames.lifecycle import FailReason
from engine.util.threads import set_intra_op_threads
from engine.models.base import ModelRunner

log = logging.getLogger("vidar.executor")


class WorkerThread:
    def __init__(self, pool: str, index: int, model: ModelRunner, *, threads: Optional[int],
                 on_done: Callable[["WorkerThread", BatchResult], bool],
                 factory: Optional[Callable[[], ModelRunner]] = None, wake: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, fence: Optional[Fence] = None):
        self.index, self.model = index, model
        self._threads, self._on_done, self._factory, self._wake, self._clock = threads, on_done, factory, wake, clock
        self._inbox: queue.Queue = queue.Queue(maxsize=1)
        self.idle = True
        # its slot's fence (shared with the threads that replace it) and the generation it works under
        self.fence = fence if fence is not None else Fence()
        self.ticket = self.fence.ticket()
        self.current: Optional[Batch] = None
        self._busy = BusyTime(self._clock)  # dispatch to idle again, per batch
        self._level = 0
        self._thread = threading.Thread(target=self._run, name=f"worker-{pool}-{index}", daemon=True)
        self._thread.start()

    @property
    def abandoned(self) -> bool:
        """The watchdog (or an abort) gave up on this thread: nothing it finishes is accepted."""
        return not self.fence.admits(self.ticket)

    def abandon(self) -> None:
        """Ledger lock held: end this thread's generation (it ends after the batch it runs)."""
        if not self.abandoned:
            self.fence.end()

    def submit(self, batch: Batch) -> None:
        """Core thread, ledger lock held, only when idle: the inbox is empty, so this never blocks."""
        self.idle = False
        self.current = batch
        self._busy.start()
        self._inbox.put_nowait(batch)

    @property
    def busy_since(self) -> Optional[float]:
        """When the running batch started (None: idle)."""
        return self._busy.since

    def busy_seconds(self, now: float) -> float:
        """Seconds this slot has spent running batches (dispatch to idle again), the running one up to `now`."""
        return self._busy.seconds(now)

    def stop(self, timeout: float) -> bool:
        """True once the thread has ended. A thread abandoned by an abort (its batch was taken back) ends
        after the batch it runs, whose result is ignored: it is waited for too, within the timeout. A
        process that exits while torch runs a forward on another thread dies in C++ ("terminate called
        without an active exception", exit 134), measured with vit_tiny after `stop(drain=False)`. (A
        thread the watchdog abandoned as hung is no longer a slot's thread: nothing waits for it.)"""
        if not self.abandoned:
            try:
                self._inbox.put(None, timeout=timeout)
            except queue.Full:
                return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # outside the per-batch guards (a bug): the watchdog replaces this slot
            log.exception("worker %d: thread crashed", self.index)

    def _loop(self) -> None:
        set_intra_op_threads(self._threads)
        while True:
            batch = self._inbox.get()
            if batch is None:
                return
            res = self._execute(batch)
            self._on_done(self, res)
            if self.abandoned:
                return
            if res.fail_reason is not None:
                self._rebuild()
            self._busy.end()
            self.idle = True
            self._wake()

    def _rebuild(self) -> None:
        """After a failed batch the instance may be in a bad state: replace it (on this thread)."""
        if self._factory is None:
            return
        try:
            self.model = self._factory()
            self._level = 0  # a fresh instance starts as configured; the next batch sets its level
        except Exception:  # keep the old instance: a pool with no worker would stall every stream
            log.exception("worker %d: rebuilding the worker failed; keeping the old instance", self.index)

    def _release_event(self):
        """The model's release event (ModelRunner.release_event); a failure there fails no frame: the
        slots are then released at once, as on the CPU."""
        try:
            return self.model.release_event()
        except Exception:
            log.exception("worker %d: release_event failed; releasing the slots without it", self.index)
            return None

    def _execute(self, batch: Batch) -> BatchResult:
        res = BatchResult(batch)
        t0 = self._clock()
        seen = False  # the input was built from the frames: their release offers them to the live view
        try:
            if batch.level != self._level:  # the ladder moved: e.g. SAM 2's encoder switches input size
                self.model.set_level(batch.level)
                self._level = batch.level
            inputs = self.model.prepare(batch.frames)
            seen = True
        except Exception as err:
            res.fail_reason, res.error = FailReason.PREPROCESS_ERROR, err
            return res
        finally:
            after = self._release_event()
            for ref in batch.frames:
                # the input batch is built (or failed): decoding may reuse the slots now (on a GPU, once the
                # kernels prepare queued have read them: `after`)
                ref.release(seen=seen, after=after)
        try:
            outputs = self.model.infer(inputs)
            if len(outputs) != len(batch.frames):
                raise RuntimeError(f"worker returned {len(outputs)} outputs for {len(batch.frames)} frames")
            res.outputs = outputs
        except Exception as err:
            res.fail_reason, res.error = FailReason.MODEL_ERROR, err
        res.elapsed = self._clock() - t0
        return res
