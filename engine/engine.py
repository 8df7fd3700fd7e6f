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

from streams import open_source, redact_url
from streams.runner import SourceRunner

from .config import EngineConfig, StreamConfig
from .errors import ConfigError, EngineDeadError, SourceError
from .fanout import RingGroup
from .memory import limit_malloc_arenas
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
    removed: bool = False
    reason: str = ""


class Engine:
    def __init__(self, cfg: EngineConfig, *, workers: Optional[dict[str, Worker]] = None,
                 worker_factories: Optional[dict] = None, ctx: Optional[zmq.Context] = None):
        self.cfg = cfg
        self.state = "created"
        self._injected = workers or {}
        self._factories = dict(worker_factories or {})
        self._ctx = ctx
        self.pools: dict[str, Pool] = {}
        self.streams: dict[str, StreamState] = {}
        self.publisher: Optional[Publisher] = None
        self.metrics: Optional[Metrics] = None
        self._lock = threading.Lock()
        self.dead_reason: Optional[str] = None
        self.decoder = None  # SAM 2's shared decoder stage, when that pool is configured
        self.curve = None    # CURVE authenticator, when security.curve is on

    # -- start ------------------------------------------------------------------------------
    def _pool_specs(self) -> list[dict]:
        """(name, workers, scheduling options, stage 2) of each configured pool."""
        cfg, specs = self.cfg, []
        injected = {k: (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in self._injected.items()}
        vit = cfg.models.classify
        if vit is not None:
            workers = injected.get("vit")
            if workers is None:
                from .workers.classify import ClassifierWorker
                first = ClassifierWorker(vit)  # loads the model once; the other instances share it
                workers = [first] + [ClassifierWorker(vit, model=first.model, weights_tag=first.weights_tag)
                                     for _ in range(vit.workers - 1)]
                self._factories.setdefault("vit", lambda: ClassifierWorker(vit, model=first.model,
                                                                           weights_tag=first.weights_tag))
            specs.append({"name": "vit", "workers": workers, "max_batch": vit.max_batch, "threads": vit.threads})
        sam = cfg.models.sam2
        if sam is not None:
            from .workers.sam2 import Sam2EncoderWorker, Sam2Stage
            from .workers.sam2_tracker import DecoderStage
            workers = injected.get("sam2")
            if workers is None:
                first = Sam2EncoderWorker(sam)
                workers = [first] + [Sam2EncoderWorker(sam, model=first.model, weights_tag=first.weights_tag)
                                     for _ in range(sam.encoders - 1)]
                self._factories.setdefault("sam2", lambda: Sam2EncoderWorker(sam, model=first.model,
                                                                              weights_tag=first.weights_tag))
            self.decoder = DecoderStage(workers[0].model)
            specs.append({"name": "sam2", "workers": workers, "max_batch": sam.max_batch, "threads": sam.threads,
                          "stage2": Sam2Stage(self.decoder, self._emit)})
        if not specs:
            raise ConfigError("models: no model pool configured; set models.vit or models.sam2")
        return specs

    def start(self) -> None:
        self.state = "starting"
        cfg = self.cfg
        # before this engine starts threads (process-wide; `vidar run` has done it already)
        limit_malloc_arenas(cfg.malloc_arenas)
        self.metrics = Metrics(lambda: [p.acct for p in self.pools.values()], self.stream_counters)
        if cfg.metrics.enabled:
            self.metrics.serve(cfg.metrics.host, cfg.metrics.port)
        if cfg.security.curve:
            from .security import Curve
            self.curve = Curve(self._ctx or zmq.Context.instance(), cfg.security.server_key,
                               cfg.security.authorized_clients)
        self.publisher = Publisher(cfg.publish, ctx=self._ctx, curve=self.curve,
                                   on_publish_latency=lambda s: self.metrics.observe("all", "publish", s))
        for spec in self._pool_specs():
            pool = Pool(spec["name"], spec["workers"], max_batch=spec["max_batch"],
                        max_wait_s=cfg.budget.max_batch_wait_ms / 1e3, threads=spec["threads"],
                        publisher=self.publisher, metrics=self.metrics, on_stream_done=self._pool_done,
                        stage2=spec.get("stage2"), worker_factory=self._factories.get(spec["name"]),
                        max_failures=cfg.faults.max_failures, failure_window_s=cfg.faults.window_s,
                        batch_timeout_s=cfg.faults.batch_timeout_s)
            pool.warmup()
            self.pools[spec["name"]] = pool
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
        from .workers.sam2_tracker import Prompt
        for o in cfg.objects:
            self.decoder.add_object(o.stream, Prompt(o.id, box=o.box, points=o.points))
        self.state = "running"

    def _start_stream(self, scfg: StreamConfig) -> None:
        st = StreamState(cfg=scfg, pools_done=set())
        self.streams[scfg.id] = st
        rings = [FrameRing(scfg.id, live=scfg.mode == "live", accounting=pool.acct,
                           memory_bytes=self.cfg.ring.memory_mb * 2 ** 20, min_slots=self.cfg.ring.min_slots,
                           max_slots=self.cfg.ring.max_slots, max_frame_pixels=self.cfg.ring.max_frame_pixels,
                           notify=pool.wake) for pool in self.pools.values()]
        st.ring = rings[0] if len(rings) == 1 else RingGroup(rings)
        if self.decoder is not None:
            self.decoder.add_stream(scfg.id)
        try:
            source = open_source(scfg.id, scfg.url, open_timeout_s=self.cfg.source.open_timeout_s,
                                 read_timeout_s=self.cfg.source.stall_timeout_s / 2,
                                 max_frame_pixels=self.cfg.ring.max_frame_pixels)
        except SourceError as err:  # bad URL syntax: this stream fails, the others run
            log.error("%s", err)
            self._emit(scfg.id, "error", err.reason)
            st.failed, st.reason = True, f"error: {err.reason}"
            st.ring.close()
            source = None
        if source is not None:
            st.runner = SourceRunner(source, st.ring, live=scfg.mode == "live", loop=scfg.loop,
                                     budget_s=self.cfg.budget.latency_ms / 1e3, emit=self._emit,
                                     reconnect_initial_s=self.cfg.source.reconnect_initial_s,
                                     reconnect_max_s=self.cfg.source.reconnect_max_s,
                                     backoff_reset_after_s=self.cfg.source.backoff_reset_after_s)
        for pool, ring in zip(self.pools.values(), rings):
            pool.add_ring(ring)
        if st.runner:
            st.runner.start()

    # -- run-time changes (the control socket) ------------------------------------------------
    def add_stream(self, scfg: StreamConfig) -> None:
        from .control import ControlError
        with self._lock:
            if scfg.id in self.streams and not self.streams[scfg.id].removed:
                raise ControlError(f"add_stream: stream id {scfg.id!r} is already running; remove it first")
            self.streams.pop(scfg.id, None)
        self._start_stream(scfg)
        log.info("stream %s added (%s)", scfg.id, redact_url(scfg.url))

    def remove_stream(self, stream: str, timeout: float = 5.0) -> None:
        """Stop a stream: its decoder thread ends, frames still queued are dropped (stream_removed),
        its tracker state is freed and one eos goes out."""
        from .control import ControlError
        st = self.streams.get(stream)
        if st is None or st.removed:
            raise ControlError(f"remove_stream: unknown stream {stream!r}; streams: {sorted(self.live_streams())}")
        st.removed, st.reason = True, "removed"
        if st.runner:
            st.runner.stop()
            st.runner.join(timeout)
        for pool in self.pools.values():
            pool.remove_stream(stream, timeout)
        if self.decoder is not None:
            self.decoder.remove_stream(stream)
        with self._lock:
            queued, st.eos_queued = st.eos_queued, True
        if not queued:
            self.publisher.submit_event(stream, "eos", "removed")
        log.info("stream %s removed", stream)

    def live_streams(self) -> list[str]:
        return [s for s, st in self.streams.items() if not st.removed]

    def describe(self) -> dict:
        objects = self.decoder.list() if self.decoder is not None else {}
        out = {}
        for sid in self.live_streams():
            st = self.streams[sid]
            out[sid] = {"url": redact_url(st.cfg.url), "mode": st.cfg.mode,
                        "state": st.runner.state if st.runner else ("failed" if st.failed else "?"),
                        "pools": {name: {"published": pool.acct.snapshot(sid).published,
                                         "dropped": pool.acct.snapshot(sid).dropped}
                                  for name, pool in self.pools.items()}}
            if sid in objects:
                out[sid]["objects"] = objects[sid]["objects"] + objects[sid]["pending"]
        return out

    def _emit(self, stream: str, kind: str, reason: str) -> None:
        if self.publisher is not None:
            self.publisher.submit_event(stream, kind, reason)

    def stream_counters(self) -> dict[str, dict[str, int]]:
        """Per-stream counters outside the frame accounting (metrics and the status line)."""
        out: dict[str, dict[str, int]] = {"ring_overwrites": {}, "decode_errors": {}, "reconnects": {}}
        for sid, st in list(self.streams.items()):
            if st.ring is not None:
                out["ring_overwrites"][sid] = st.ring.overwrites
            if st.runner is not None:
                out["decode_errors"][sid] = st.runner.source.decode_errors
                out["reconnects"][sid] = st.runner.reconnects
        return out

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
        reason = self.dead_reason or st.reason or (st.runner.end_reason if st.runner else "") or "end of stream"
        st.failed = st.failed or bool(st.runner and st.runner.failed)

        def sent() -> None:
            st.eos_sent = True
        self.publisher.submit_event(stream, "eos", reason, on_sent=sent)

    def finished(self) -> bool:
        """Every stream has ended and its eos was published (removed streams count as ended)."""
        return bool(self.streams) and all(st.eos_sent or st.removed for st in self.streams.values())

    def check_dead(self) -> Optional[str]:
        for pool in self.pools.values():
            if pool.error is not None and self.dead_reason is None:
                self.dead_reason = (f"engine dead: {pool.error}" if isinstance(pool.error, EngineDeadError) else
                                    f"engine dead: pool {pool.name} crashed: {type(pool.error).__name__}: {pool.error}")
        return self.dead_reason

    # -- stop -------------------------------------------------------------------------------
    def stop(self, *, drain: bool = True) -> None:
        if self.state in ("stopping", "stopped"):
            return
        self.state = "stopping"
        timeout = self.cfg.shutdown_timeout_s
        t_end = time.monotonic() + timeout
        for st in self.streams.values():
            if not st.reason and not st.eos_queued:
                st.reason = self.dead_reason or "shutdown"  # the eos says why, whichever thread sends it
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
        if self.curve is not None:
            self.curve.stop()
        self.state = "stopped"

    def any_failed(self) -> bool:
        return any(st.failed or (st.runner is not None and st.runner.failed) for st in self.streams.values())
