"""One model pool: its rings, a pure scheduler, its worker slots (worker_slots.py: the worker
threads and their watchdog) and its output stage (output_stage.py).

The pool has no thread of its own for scheduling: the engine core thread (its one owner) calls
`step(now)`, which takes ready frames from the rings into the scheduler, drops the frames that
cannot meet their deadline, dispatches batches to idle workers and runs the watchdog. Workers
hand finished batches straight to the pool's output stage (its own thread: reordering, the
family's output processor, the late check, publishing), so no worker ever waits for output.

Every move of a frame (ring -> scheduler -> worker -> output stage -> publisher -> terminal) is
done under the pool's ledger lock (`acct.lock`), and each holder reports what it holds, so the
pool's in-flight count is counted, not derived (see accounting.py).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import Counter
from typing import Callable, Optional

from engine.errors import ConfigError
from engine.frames.accounting import Accounting
from engine.config import FaultsConfig, QosConfig
from engine.frames.drop_log import DropLog
from engine.executor.messages import Batch
from engine.executor.worker_thread import WorkerThread
from engine.sched.faults import FaultPolicy
from engine.frames.lifecycle import DropReason, FailReason
from engine.sched.batch_size import SWEEP_REPEATS, BatchChoice, candidate_sizes, choose_max_batch, stop_sweep
from engine.sched.latency import LatencyModel
from engine.publish.metrics import Metrics
from engine.executor.output_stage import OutputStage
from engine.publish.publisher import Publisher
from engine.sched.qos import PoolQos
from engine.frames.ref import FrameRef
from engine.frames.ring import FrameRing
from engine.sched.scheduler import EdfScheduler
from engine.util.threads import intra_op_threads
from engine.executor.worker_slots import WorkerSlots
from engine.models.registry import PoolSpec

log = logging.getLogger("vidar.pool")

_NO_FRAMES = 1 << 30  # wake_slack of a pool no stream feeds: it never limits the others'


class Pool:
    def __init__(self, spec: PoolSpec, *, publisher: Publisher, faults: FaultsConfig, max_wait_s: float,
                 credit: int, metrics: Optional[Metrics] = None, wake: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, qos: Optional[QosConfig] = None,
                 budget_s: Optional[float] = None):
        """`budget_s`: the engine's latency budget, which `max_batch: auto` chooses the batch size for. None
        while the engine has not chosen it yet (an unset budget.latency_ms on a CPU is chosen from the pools'
        `batch1_s`): it is then given to `warmup`."""
        if not spec.models:
            raise ValueError(f"pool {spec.name}: a pool needs at least one worker")
        self._budget_s = budget_s
        self._processor_warm = False
        self._batch1_runs: Optional[list[dict[int, float]]] = None  # batch 1's runs measured by batch1_s
        self.batch_choice: Optional[BatchChoice] = None  # with max_batch auto: what warm-up chose and why
        self.name, self.spec = spec.name, spec
        self.acct = Accounting(spec.name)
        self.scheduler = EdfScheduler(max_batch=spec.max_batch, latency=LatencyModel(), max_wait_s=max_wait_s)
        self.faults = FaultPolicy(spec.name, max_failures=faults.max_failures, window_s=faults.window_s, clock=clock)
        self._batch_timeout_s, self._credit, self._metrics = faults.batch_timeout_s, credit, metrics
        self.rings: dict[str, FrameRing] = {}
        # the rings holding READY frames (FrameRing.ready_set, under the ledger lock): what _pull looks at
        self._ready: dict[FrameRing, None] = {}
        self._attached: dict[FrameRing, int] = {}  # ring -> attach order: _pull takes rings in it, as before
        self._attach_order = itertools.count()
        self._next_batch = 0
        self.drop_log = DropLog(spec.name, self.acct.lock)
        self.output = OutputStage(spec.name, weights=spec.models[0].weights_tag, acct=self.acct,
                                  publisher=publisher, faults=self.faults, drop_log=self.drop_log,
                                  processor=spec.processor, clock=clock, threads=spec.output_threads)
        self.slots = WorkerSlots(spec, acct=self.acct, output=self.output, batch_timeout_s=faults.batch_timeout_s,
                                 metrics=metrics, wake=wake, clock=clock, faults=self.faults)
        self.acct.add_holder("scheduler", self.scheduler.count_by_key)
        self.acct.add_holder("publisher", lambda: publisher.held(spec.name))
        # emit stays a callable: engine.sched is pure and may not import the publisher, and an event is
        # sent out of the pool (to subscribers), not handed between its threads
        self.qos = PoolQos(spec.name, qos or QosConfig(), self.acct, levels=spec.levels, level_costs=spec.level_costs,
                           emit=lambda stream, kind, reason, fields: publisher.submit_event(
                               stream, kind, reason, fields=lambda: dict(fields)))

    def fallbacks(self) -> dict[str, str]:
        """The GPU pieces this pool runs without, each with why (issue 43 item 4): its runners' CUDA graphs after a
        failed capture or a rebuild (engine/models/graphs.py eager_reason), and its processor's (SAM 2's tracking
        step graphs). Empty where nothing fell back, and on the CPU, where no graph is tried."""
        out: dict[str, str] = {}
        for m in list(self.slots.models):
            graphs = getattr(m, "graphs", None)
            if graphs is not None and getattr(graphs, "eager_reason", None):
                out.setdefault("cuda_graphs", graphs.eager_reason)
        fallbacks = getattr(self.spec.processor, "fallbacks", None)  # processors need not derive PostProcessor
        if fallbacks is not None:
            out.update(fallbacks())
        return out

    # -- start / stop -------------------------------------------------------------------------

    def _warm_processor(self) -> None:
        # the family's output stage (SAM 2's tracking stage) first, once; a processor that does not derive from
        # PostProcessor (a plug-in's, a test's wrapper) may have no warm-up
        if self._processor_warm:
            return
        self._processor_warm = True
        warm = getattr(self.spec.processor, "warmup", None)
        if warm is not None:
            warm()

    def batch1_s(self) -> Optional[float]:
        """Batch 1's time at warm-up (the median of SWEEP_REPEATS runs, after the output stage's warm-up), or
        None when the model reports none: what an unset budget.latency_ms is chosen from on a CPU
        (engine/sched/budget_auto.py). The runs seed the scheduler; `warmup` does not measure batch 1 again."""
        self._warm_processor()
        if self._batch1_runs is None:
            self._batch1_runs = [self._warmup_times([1]) for _ in range(SWEEP_REPEATS)]
            if all(1 in r for r in self._batch1_runs):
                self.scheduler.update(1, statistics.median(r[1] for r in self._batch1_runs))
        if not all(1 in r for r in self._batch1_runs):
            return None
        return statistics.median(r[1] for r in self._batch1_runs)

    def warmup(self, budget_s: Optional[float] = None) -> None:
        """Measure batch times under the workers' own thread count; they seed the scheduler. With
        `max_batch: auto` the sizes 1, 2, 4, ... are measured until one does not fit the budget, and the
        scheduler's max_batch becomes the largest that does (sched/batch_size.py): the choice depends on the
        budget, which is why an unset one is chosen first. `budget_s`: the budget, when it was not known
        at construction."""
        if budget_s is not None:
            self._budget_s = budget_s
        if self.spec.auto_batch and not self._budget_s:
            raise ValueError(f"pool {self.name}: max_batch auto needs the latency budget (budget_s)")
        self._warm_processor()
        if self.spec.auto_batch:
            self._choose_batch()
        else:
            seeded = {1} if self._batch1_runs is not None else set()
            sizes = sorted({1, self.scheduler.max_batch} - seeded)
            for b, seconds in (self._warmup_times(sizes) if sizes else {}).items():
                if b not in seeded:  # a graphed runner also reports the smaller sizes: batch 1 is seeded already
                    self.scheduler.update(b, seconds)
        plan = self.spec.plan
        why = f" ({plan.why})" if plan is not None else ""
        log.info("pool %s: %d worker(s) x %s thread(s)%s; warm-up %s", self.name, len(self.slots.models),
                 self.spec.threads or "torch's", why,
                 ", ".join(f"b{b}={s * 1e3:.1f}ms" for b, s in self.scheduler.latency.measured().items()))
        if self.batch_choice is not None:
            log.info("pool %s: max_batch auto -> %d: %s", self.name, self.batch_choice.max_batch, self.batch_choice.why)

    def _choose_batch(self) -> None:
        latency, swept, seeded = self.scheduler.latency, [], set()
        if self._batch1_runs is not None and all(1 in r for r in self._batch1_runs):
            seeded.add(1)  # batch1_s measured and seeded it (the unset budget was chosen from it)
        for b in candidate_sizes(self.spec.max_batch):
            runs = (self._batch1_runs if b == 1 and self._batch1_runs is not None
                    else [self._warmup_times([b]) for _ in range(SWEEP_REPEATS)])
            if any(b not in r for r in runs):  # nothing to choose from: an estimate of 0 would pick the ceiling
                raise ConfigError(f"models.{self.name}.max_batch: auto, but the pool's model reports no time for "
                                  f"batch {b} at warm-up: set a number")
            # a graphed runner also reports every smaller size (at its padded cost): each seeds the model once
            for size in sorted(set(runs[0]) - seeded):
                self.scheduler.update(size, statistics.median(r[size] for r in runs))
                seeded.add(size)
            swept.append(b)
            if stop_sweep(latency.estimate(b), self._budget_s):
                break
        self.batch_choice = choose_max_batch(latency.estimate, swept, self._budget_s)
        self.scheduler.max_batch = self.batch_choice.max_batch

    def _warmup_times(self, sizes: list[int]) -> dict[int, float]:
        with intra_op_threads(self.spec.threads):
            return self.slots.models[0].warmup(sizes)

    def start(self) -> None:
        self.slots.start()
        self.output.start()

    def stop(self, timeout: float) -> bool:
        """Workers and the output stage end (after abort or drain). True if every thread ended."""
        t_end = time.monotonic() + timeout
        ok = self.slots.stop(timeout)
        out_ok = self.output.stop(max(0.1, t_end - time.monotonic()))
        self.slots.close()
        processor = self.spec.processor
        if out_ok and processor is not None and hasattr(processor, "close"):  # never under a thread still running
            processor.close()
        return ok and out_ok

    # -- rings (core thread) ---------------------------------------------------------------------
    def attach(self, ring: FrameRing) -> None:
        with self.acct.lock:
            self.rings[ring.stream] = ring
            self._attached[ring] = next(self._attach_order)
            ring.ready_set = self._ready
            if ring.ready():  # frames written before the attach (a ring is attached before its writer starts)
                self._ready[ring] = None
            self.acct.add_holder(f"ring:{ring.stream}", lambda: Counter({ring.stream: ring.ready()}),
                                 stream=ring.stream)  # its own frames only: another stream's snapshot skips it
        self.qos.attach(ring.stream, live=ring.live, max_interval=ring.max_interval)
        self.output.add_stream(ring.stream)

    def detach(self, stream: str, reason: DropReason) -> None:
        """The stream stops feeding this pool: what its ring and the scheduler hold is dropped now;
        frames already on a worker are dropped by the output stage (it forgets the stream first)."""
        self.output.remove_stream(stream)
        with self.acct.lock:
            ring = self.rings.pop(stream, None)
            frames = self.scheduler.remove(lambda fv: fv.meta.stream == stream)
            if ring is not None:
                ring.close()
                frames += ring.take_ready()
                ring.ready_set = None
                self._ready.pop(ring, None)
                self._attached.pop(ring, None)
            for fv in frames:
                self._drop(fv, reason)
            self.acct.remove_holder(f"ring:{stream}")
        self.scheduler.forget(stream)
        self.qos.detach(stream)

    def stream_idle(self, stream: str) -> bool:
        """Nothing of this stream left to process here: its ring is closed and empty, and no frame of
        it is in the scheduler, on a worker or in the output stage (results may still be waiting at
        the publisher, in order before anything queued after this)."""
        ring = self.rings.get(stream)
        if ring is not None and not ring.closed:
            # A running stream: no lock. The ledger lock is the one every ingest thread takes twice a frame (at 48
            # streams the core once spent 92 % of its time waiting for it here, when every stream was asked at
            # every step; the table now asks only streams with a closed ring: StreamTable._watch). `closed` only
            # ever turns true, and a stream asked once stays watched, so a close missed here is seen next step.
            return False
        with self.acct.lock:
            ring = self.rings.get(stream)
            return (ring is None or ring.closed) and self.acct.held(stream, exclude=("publisher",)) == 0

    # -- the core's step ---------------------------------------------------------------------------
    def step(self, now: float) -> Optional[float]:
        """Pull, schedule, dispatch. Returns when to step again at the latest (None: on a wake-up)."""
        for batch_size, seconds in self.output.take_timings():
            self.scheduler.update(batch_size, seconds)
        self.slots.watchdog(now)
        self.output.check_hung(now, self._batch_timeout_s)
        self.output.check_alive()
        workers = self.slots.workers
        self.qos.step(now, busy_s=self.slots.busy_seconds(now), output_busy_s=self.output.busy_seconds(now),
                      workers=len(workers))
        wake_at = None
        with self.acct.lock:
            self._pull(now)
            while (worker := self.slots.idle()) is not None:
                plan = self.scheduler.schedule(now)
                for fv in plan.dropped:
                    self._drop(fv, DropReason.DEADLINE)
                for fv in plan.superseded:
                    self._drop(fv, DropReason.SUPERSEDED)
                if not plan.batch:
                    wake_at = plan.wake_at
                    break
                self._dispatch(worker, plan.batch, now)
        self.drop_log.flush()
        return wake_at

    def wake_slack(self) -> int:
        """After a step: how many more frames may become ready here without the core being woken for them. While an
        idle worker waits for a batch to fill (frames pending, fewer than max_batch), up to one short of a full
        batch: the core steps at the batch's wait limit anyway (budget.max_batch_wait_ms, earlier if a pending
        frame's deadline needs it), so a frame readied meanwhile waits at most that long (a frame that cannot wait
        even that, less than max_batch_wait_ms from its deadline, may miss it), and a wake-up a frame cost the
        thread that committed it a futex wake under the GIL (py-spy,
        16 RTSP cameras: ~40 % of the ingest I/O thread's GIL time). 0 otherwise: an empty pool (the first frame
        starts the wait), a batch already full, no idle worker (a finishing worker wakes the core itself)."""
        if not self.rings:
            return _NO_FRAMES
        pending = self.scheduler.pending()
        if pending == 0 or pending >= self.scheduler.max_batch:
            return 0
        with self.acct.lock:  # idle() is read under the ledger lock
            if self.slots.idle() is None:
                return 0
        return self.scheduler.max_batch - pending - 1

    def _pull(self, now: float) -> None:
        """Ledger lock held. An offline stream takes no more than its credit: results it has in the
        pipeline and at the publisher are bounded, so a stalled subscriber stops only that stream."""
        if not self._ready:
            return
        # only the rings that got frames since the last pull (or kept some: an offline one at its credit), in
        # attach order; each goes back in the set if it keeps READY frames
        rings = sorted(self._ready, key=lambda r: self._attached.get(r, -1))
        self._ready.clear()
        # a ring holds only its own stream's frames, so leaving out every ring is leaving out the stream's own
        held = self.acct.held_by_stream(exclude_prefix="ring:") if any(not r.live for r in rings) else None
        for ring in rings:
            stream = ring.stream
            if self.rings.get(stream) is not ring:  # detached meanwhile (its frames were dropped with it)
                continue
            limit = None
            if not ring.live:
                limit = self._credit - held[stream]
                if limit <= 0:
                    self._ready[ring] = None
                    continue
            taken = ring.take_ready(limit)
            if limit is not None and ring.ready():
                self._ready[ring] = None
            for fv in taken:
                if ring.live and not self.qos.keep(stream):
                    self._drop(fv, DropReason.INTERVAL)
                    continue
                if self._metrics:
                    self._metrics.observe(self.name, "decode", fv.meta.decode_s)
                    self._metrics.observe(self.name, "queue_wait", max(0.0, now - fv.meta.t_decoded))
                fv.t_queued = now
                self.scheduler.add(fv, deadline=fv.meta.deadline, now=now, key=fv.meta.stream)

    def _dispatch(self, worker: WorkerThread, frames: list[FrameRef], now: float) -> None:
        if self._metrics:
            for fv in frames:
                self._metrics.observe(self.name, "batch_wait", max(0.0, now - fv.t_queued))
        batch = Batch(self._next_batch, frames, t_dispatch=now, level=self.qos.level)
        self._next_batch += 1
        worker.submit(batch)

    # -- drops, abort -------------------------------------------------------------------------
    def _drop(self, fv: FrameRef, reason: DropReason) -> None:
        self.acct.drop(fv.meta.stream, reason)
        self.drop_log.note(fv.meta.stream, reason)
        fv.release()

    def abort(self, *, drop: Optional[DropReason] = None, fail: Optional[FailReason] = None) -> None:
        """Every frame this pool holds ends now: the rings' and the scheduler's, the batches on the
        workers (their threads are abandoned) and the output stage's. Results already at the
        publisher are left to it."""
        end = (lambda fv: self.acct.drop(fv.meta.stream, drop)) if drop else (lambda fv: self.acct.fail(fv.meta.stream, fail))
        with self.acct.lock:
            frames = self.scheduler.remove(lambda fv: True)
            for ring in self.rings.values():
                ring.close()
                frames += ring.take_ready()
            frames += self.slots.take_all()
            for fv in frames:
                end(fv)
                fv.release()
        self.output.abort(drop=drop, fail=fail)
