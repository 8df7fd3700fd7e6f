"""Worker threads: each runs batches on one worker instance, so a pool can run several at once.

Why threads: the model releases the GIL inside its kernels. On a 2-core CPU, two instances
with one intra-op thread each beat one instance with two threads by ~1.5x when a decoder
thread shares the cores (measured: 91 vs 59 frames/s, vit_tiny at batch 4 on 720p), because
OpenMP's barrier-synchronised parallel regions stall whenever the decoder takes a core.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from .frame import FailReason
from .ring import FrameView
from .workers.base import Worker

log = logging.getLogger("vidar.executor")


@dataclass
class BatchResult:
    batch_id: int
    frames: list[FrameView]
    outputs: Optional[list[dict]] = None
    fail_reason: Optional[FailReason] = None
    error: Optional[BaseException] = None
    elapsed: float = 0.0
    worker: int = 0
    meta: dict = field(default_factory=dict)


class WorkerThread:
    def __init__(self, name: str, index: int, worker: Worker, *, threads: Optional[int],
                 on_done: Callable[[BatchResult], None], clock: Callable[[], float] = time.monotonic):
        self.index, self.worker = index, worker
        self._threads, self._on_done, self._clock = threads, on_done, clock
        self._inbox: queue.Queue = queue.Queue(maxsize=1)
        self.idle = True
        self.abandoned = False  # set by the watchdog: whatever this thread finishes is ignored
        self.current: Optional[tuple[int, list[FrameView]]] = None
        self.busy_since: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name=f"worker-{name}-{index}", daemon=True)
        self._thread.start()

    def submit(self, batch_id: int, frames: list[FrameView]) -> None:
        self.idle = False
        self.current, self.busy_since = (batch_id, frames), self._clock()
        self._inbox.put((batch_id, frames))

    def stop(self, timeout: float) -> bool:
        if self.abandoned:
            return True  # a hung thread cannot be stopped; it is a daemon and holds nothing we need
        try:
            self._inbox.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        if self._threads:
            import torch
            torch.set_num_threads(self._threads)  # OpenMP's thread count is per calling thread
        while True:
            item = self._inbox.get()
            if item is None:
                return
            batch_id, frames = item
            res = self._execute(batch_id, frames)
            self.current, self.busy_since = None, None
            if not self.abandoned:
                self._on_done(res)

    def _execute(self, batch_id: int, frames: list[FrameView]) -> BatchResult:
        res = BatchResult(batch_id, frames, worker=self.index)
        t0 = self._clock()
        try:
            inputs = self.worker.prepare(frames)
        except Exception as err:
            res.fail_reason, res.error = FailReason.PREPROCESS_ERROR, err
            return res
        finally:
            for fv in frames:
                fv.release()  # the input batch is built: decoding may reuse the slots now
        try:
            outputs = self.worker.infer(inputs)
            if len(outputs) != len(frames):
                raise RuntimeError(f"worker returned {len(outputs)} outputs for {len(frames)} frames")
            res.outputs = outputs
        except Exception as err:
            res.fail_reason, res.error = FailReason.MODEL_ERROR, err
        res.elapsed = self._clock() - t0
        return res
