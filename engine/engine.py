"""The engine: wires sources, rings, model pools and the publisher, and owns their lifecycle.

States: created -> starting -> running -> stopping -> stopped. `stop(drain=True)` stops the
decoders, lets the pools finish what they hold (up to `shutdown_timeout_s`), then aborts what
is left (counted as dropped(shutdown)); every stream gets exactly one eos.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import zmq

from streams import open_source
from streams.runner import SourceRunner

from .config import EngineConfig, StreamConfig
from .errors import ConfigError, EngineDeadError, SourceError
from .metrics import Metrics
from .pool import Pool
from .publisher import Publisher
from .ring import FrameRing
from .workers.base import Worker

log = logging.getLogger("vidar.engine")


@dataclass
class StreamState:
    cfg: StreamConfig
    ring: Optional[FrameRing] = None
    runner: Optional[SourceRunner] = None
    pools_done: set = None
    eos_sent: bool = False
    eos_queued: bool = False
    failed: bool = False
    reason: str = ""


class Engine:
    def __init__(self, cfg: EngineConfig, *, workers: Optional[dict[str, Worker]] = None,
                 ctx: Optional[zmq.Context] = None):
        self.cfg = cfg
        self.state = "created"
        self._injected = workers or {}
        self._ctx = ctx
        self.pools: dict[str, Pool] = {}
        self.streams: dict[str, StreamState] = {}
        self.publisher: Optional[Publisher] = None
        self.metrics: Optional[Metrics] = None
        self._lock = threading.Lock()
        self.dead_reason: Optional[str] = None

    # -- start ------------------------------------------------------------------------------
    def _build_workers(self) -> dict[str, list[Worker]]:
        workers = {k: (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in self._injected.items()}
        vit = self.cfg.models.vit
        if "vit" not in workers and vit is not None:
            from .workers.classify import ClassifierWorker
            first = ClassifierWorker(vit)  # loads the model once; the other instances share it
            workers["vit"] = [first] + [ClassifierWorker(vit, model=first.model, weights_tag=first.weights_tag)
                                        for _ in range(vit.workers - 1)]
        if not workers:
            raise ConfigError("models: no model pool configured; set models.vit")
        return workers

    def start(self) -> None:
        self.state = "starting"
        cfg = self.cfg
        self.metrics = Metrics(lambda: [p.acct for p in self.pools.values()], self._ring_overwrites)
        if cfg.metrics.enabled:
            self.metrics.serve(cfg.metrics.host, cfg.metrics.port)
        self.publisher = Publisher(cfg.publish, ctx=self._ctx,
                                   on_publish_latency=lambda s: self.metrics.observe("all", "publish", s))
        vit = cfg.models.vit
        for name, workers in self._build_workers().items():
            pool = Pool(name, workers, max_batch=vit.max_batch if vit else 1,
                        max_wait_s=cfg.budget.max_batch_wait_ms / 1e3, threads=vit.threads if vit else None,
                        publisher=self.publisher, metrics=self.metrics, on_stream_done=self._pool_done)
            pool.warmup()
            self.pools[name] = pool
        if cfg.publish.min_subscribers:
            log.info("waiting up to %.0f s for %d subscriber(s) on %s", cfg.publish.wait_subscribers_s,
                     cfg.publish.min_subscribers, self.publisher.endpoint)
            if not self.publisher.wait_subscribers(cfg.publish.min_subscribers, cfg.publish.wait_subscribers_s):
                raise EngineDeadError(f"publish.min_subscribers={cfg.publish.min_subscribers}: no subscriber "
                                      f"connected to {self.publisher.endpoint} within {cfg.publish.wait_subscribers_s} s")
        for pool in self.pools.values():
            pool.start()
        for scfg in cfg.streams:
            self._start_stream(scfg)
        self.state = "running"

    def _start_stream(self, scfg: StreamConfig) -> None:
        st = StreamState(cfg=scfg, pools_done=set())
        self.streams[scfg.id] = st
        pool = next(iter(self.pools.values()))  # one pool per stream for now; the SAM 2 pool will fan out
        st.ring = FrameRing(scfg.id, live=scfg.mode == "live", accounting=pool.acct,
                            memory_bytes=self.cfg.ring.memory_mb * 2 ** 20, min_slots=self.cfg.ring.min_slots,
                            max_slots=self.cfg.ring.max_slots, max_frame_pixels=self.cfg.ring.max_frame_pixels,
                            notify=pool.wake)
        try:
            source = open_source(scfg.id, scfg.url, open_timeout_s=self.cfg.source.open_timeout_s,
                                 read_timeout_s=self.cfg.source.read_timeout_s)
        except SourceError as err:  # bad URL syntax: this stream fails, the others run
            log.error("%s", err)
            self._emit(scfg.id, "error", err.reason)
            st.failed, st.reason = True, f"error: {err.reason}"
            st.ring.close()
            pool.add_ring(st.ring)
            return
        st.runner = SourceRunner(source, st.ring, live=scfg.mode == "live", loop=scfg.loop,
                                 budget_s=self.cfg.budget.latency_ms / 1e3, emit=self._emit,
                                 reconnect_initial_s=self.cfg.source.reconnect_initial_s,
                                 reconnect_max_s=self.cfg.source.reconnect_max_s)
        pool.add_ring(st.ring)
        st.runner.start()

    def _emit(self, stream: str, kind: str, reason: str) -> None:
        if self.publisher is not None:
            self.publisher.submit_event(stream, kind, reason)

    def _ring_overwrites(self) -> dict:
        return {s: st.ring.overwrites for s, st in list(self.streams.items()) if st.ring is not None}

    # -- stream completion -----------------------------------------------------------------
    def _pool_done(self, pool: str, stream: str) -> None:
        with self._lock:
            st = self.streams.get(stream)
            if st is None or st.eos_queued:
                return
            st.pools_done.add(pool)
            if st.pools_done < set(self.pools):
                return
            st.eos_queued = True
        reason = st.reason or (st.runner.end_reason if st.runner else "") or "end of stream"
        st.failed = st.failed or bool(st.runner and st.runner.failed)

        def sent() -> None:
            st.eos_sent = True
        self.publisher.submit_event(stream, "eos", reason, on_sent=sent)

    def finished(self) -> bool:
        """Every stream has ended and its eos was published."""
        return bool(self.streams) and all(st.eos_sent for st in self.streams.values())

    def check_dead(self) -> Optional[str]:
        for pool in self.pools.values():
            if pool.error is not None and self.dead_reason is None:
                self.dead_reason = f"pool {pool.name} crashed: {type(pool.error).__name__}: {pool.error}"
        return self.dead_reason

    # -- stop -------------------------------------------------------------------------------
    def stop(self, *, drain: bool = True) -> None:
        if self.state in ("stopping", "stopped"):
            return
        self.state = "stopping"
        timeout = self.cfg.shutdown_timeout_s
        t_end = time.monotonic() + timeout
        for st in self.streams.values():
            if st.runner:
                st.runner.stop()
        for st in self.streams.values():
            if st.runner and not st.runner.join(max(0.1, t_end - time.monotonic())):
                log.warning("stream %s: decoder thread did not stop in time (blocked in a read?)", st.cfg.id)
        for pool in self.pools.values():
            pool.stop(drain=drain, timeout=max(0.1, t_end - time.monotonic()))
        reason = self.dead_reason or "shutdown"
        for sid, st in self.streams.items():
            with self._lock:
                if st.eos_queued:
                    continue
                st.eos_queued = True
            self.publisher.submit_event(sid, "eos", st.runner.end_reason if st.runner and st.runner.failed
                                        else reason)
        if self.publisher:
            self.publisher.close(timeout=max(1.0, t_end - time.monotonic()))
        for pool in self.pools.values():
            for worker in pool.workers:
                worker.close()
        if self.metrics:
            self.metrics.close()
        self.state = "stopped"

    def any_failed(self) -> bool:
        return any(st.failed or (st.runner is not None and st.runner.failed) for st in self.streams.values())
