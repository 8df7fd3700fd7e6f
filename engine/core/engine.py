"""The engine: builds the publisher, the pools and the core from a config, and runs their lifecycle.

States: created -> starting -> running -> stopping -> stopped. Run-time changes (streams, objects)
go through `control(request)`, the one path the control socket and the CLI use too: stream ops are
applied by the core thread, object ops by the output thread of the pool that serves them (SAM 2's),
each between steps. `stop(drain=True)` stops the decoders, lets the pools finish what they hold (up
to `shutdown_timeout_s`), then drops what is left (shutdown); every stream gets exactly one eos.
The engine names no model family: pools come from `engine/models/registry.py`.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import zmq

from engine.security.binds import exposure_error, exposure_warning
from engine.config import EngineConfig, ring_needs, ring_shortfalls
from engine.core.loop import EngineCore
from engine.core.requests import AddStream, Stop
from engine.errors import ConfigError, ControlError, EngineDeadError
from engine.frames.lifecycle import DropReason
from engine.util import gc_pause
from engine.util.memory import limit_malloc_arenas
from engine.publish.metrics import Metrics
from engine.executor.pool import Pool
from engine.publish.publisher import Publisher
from engine.core.stream_table import StreamTable, lag_of
from streams.nvdec import cpu_fallback
from engine.models.base import ModelRunner
from engine.sched.tuning import usable_cores
from engine.models.registry import auto_plan, build_pool
from engine.sched.budget_auto import PoolTiming, choose_budget, runs_on_gpu
from engine.security.ports import left_default

log = logging.getLogger("vidar.engine")


class Engine:
    def __init__(self, cfg: EngineConfig, *, models: Optional[dict[str, ModelRunner | list[ModelRunner]]] = None,
                 model_factories: Optional[dict] = None, ctx: Optional[zmq.Context] = None,
                 keep_ended: bool = False):
        """`keep_ended`: streams that end stay listed until removed (a cluster's engines: their controller
        reconciles against `list` and removes them); by default they go after `ended_keep_s` or beyond
        `max_ended` (engine/core/stream_table.py)."""
        self.cfg = cfg
        self._keep_ended = keep_ended
        self.state = "created"
        self._injected = {k: (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in (models or {}).items()}
        self._factories = dict(model_factories or {})
        self._ctx = ctx
        self.pools: dict[str, Pool] = {}
        self.publisher: Optional[Publisher] = None
        self.metrics: Optional[Metrics] = None
        self.table: Optional[StreamTable] = None
        self.core: Optional[EngineCore] = None
        self.curve = None  # CURVE authenticator, when security.curve is on
        self.control_socket = None  # bound at start when control.enabled (served by the runtime)
        self.view = None  # the live view's hub when view.enabled (its web server runs in the runtime)
        self.ingest = None  # engine/ingest/client.IngestHub when ingest.processes != 0
        self._frozen = False  # counted in gc_pause (start-up objects out of the cyclic collector) until stop
        self.budget_note = ""  # budget.latency_ms as chosen at start, and how (engine/sched/budget_auto.py)

    # -- start ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Build everything; raises ConfigError/WeightsError for bad configuration (nothing left running)."""
        self.state = "starting"
        try:
            self._start()
        except BaseException:
            self.stop(drain=False)
            raise
        self.state = "running"

    def _start(self) -> None:
        cfg = self.cfg
        # the config checked this when it was read; again here for configs built without its checks
        # (model_copy: a cluster's engines bind their publisher and metrics on their node's address)
        exposed = exposure_error(cfg)
        if exposed:
            raise ConfigError(exposed)
        if cfg.security.allow_insecure_bind and (warning := exposure_warning(cfg)):
            log.warning("%s", warning)
        limit_malloc_arenas(cfg.malloc_arenas)  # before this engine starts threads (`vidar run` did it already)
        self.metrics = Metrics(lambda: [p.acct for p in self.pools.values()], self.stream_counters,
                               lambda: {name: p.qos.state() for name, p in self.pools.items()},
                               lambda: {name: p.fallbacks() for name, p in self.pools.items()})
        # a port left at its default that another engine holds moves to a free one (engine/security/ports.py)
        if cfg.metrics.enabled:
            self.metrics.serve(cfg.metrics.host, cfg.metrics.port, cfg.metrics.token,
                               movable=left_default(cfg.metrics, "port"))
        if cfg.security.curve:
            from engine.security.keys import Curve
            self.curve = Curve(self._ctx or zmq.Context.instance(), cfg.security.server_key,
                               cfg.security.authorized_clients)
        if cfg.control.enabled:
            from engine.security.sockets import bind_control_socket
            self.control_socket = bind_control_socket(cfg.control.endpoint, cfg.control.max_message_bytes, curve=self.curve,
                                       ctx=self._ctx, movable=left_default(cfg.control, "endpoint"))
        self.publisher = Publisher(cfg.publish, ctx=self._ctx, curve=self.curve,
                                   on_publish_latency=lambda s: self.metrics.observe("all", "publish", s),
                                   movable=left_default(cfg.publish, "endpoint"))
        if cfg.view.enabled:
            from engine.view.hub import ViewHub
            self.view = ViewHub(cfg.view)
            self.publisher.listener = self.view.on_message
        configured = cfg.models.configured()
        cores = usable_cores()
        live = not cfg.streams or any(s.mode == "live" for s in cfg.streams)
        for name, pcfg in configured.items():
            plan = None
            if name not in self._injected:  # injected models (tests, benchmarks) are taken as they are
                pcfg, plan = auto_plan(name, pcfg, cores=cores, pools=len(configured), live=live)
            spec = build_pool(name, pcfg, self._injected.get(name), self._factories.get(name))
            spec.plan = plan
            # the budget is given at warm-up: `auto` is chosen from the pools' batch 1 times first
            self.pools[name] = Pool(spec, publisher=self.publisher, faults=cfg.faults,
                                    max_wait_s=cfg.budget.max_batch_wait_ms / 1e3, credit=cfg.publish.queue_size,
                                    metrics=self.metrics, wake=self._wake, qos=cfg.qos)
        self._choose_budget(configured)
        for pool in self.pools.values():
            pool.warmup(cfg.budget.latency_ms / 1e3)
        batches = {name: p.scheduler.max_batch for name, p in self.pools.items()}
        for line in ring_needs(cfg, batches):
            log.info("%s", line)
        for warning in ring_shortfalls(cfg, batches):
            log.warning("%s", warning)
        if cfg.publish.min_subscribers:
            log.info("waiting up to %.0f s for %d subscriber(s) on %s", cfg.publish.wait_subscribers_s,
                     cfg.publish.min_subscribers, self.publisher.endpoint)
            if not self.publisher.wait_subscribers(cfg.publish.min_subscribers, cfg.publish.wait_subscribers_s):
                raise EngineDeadError(f"publish.min_subscribers={cfg.publish.min_subscribers}: no subscriber "
                                      f"connected to {self.publisher.endpoint} within {cfg.publish.wait_subscribers_s} s")
        if cfg.ingest.processes != 0:
            self._start_ingest(cores)
        self.table = StreamTable(cfg, self.pools, self.publisher, self._emit, self._wake, frames_ready=self._frames_ready,
                                 view=self.view,
                                 keep_ended=self._keep_ended, ingest_hub=self.ingest)
        supervised = [self.publisher.health] + ([self.view.health] if self.view is not None else [])
        if self.ingest is not None:
            supervised.append(self.ingest.health)
        self.core = EngineCore(self.pools, self.table, shutdown_timeout_s=cfg.shutdown_timeout_s,
                               supervised=supervised)
        for pool in self.pools.values():
            pool.start()
        self.core.start()
        for i, scfg in enumerate(cfg.streams):
            try:
                self.core.submit(AddStream(scfg)).result(30)
            except ControlError as err:  # refused as an add_stream would be: a config error here (exit 2)
                raise ConfigError(f"streams.{i} ({scfg.id}): {str(err).removeprefix('add_stream: ')}") from None
        for o in cfg.objects:
            req = {"op": "add_object", **o.model_dump(exclude_none=True)}
            reply = self.control(req)
            if not reply["ok"]:
                raise ConfigError(f"objects: {reply['error']}")
        gc_pause.freeze_startup()  # models, pools and streams built: later collections skip them (gc_pause.py)
        self._frozen = True

    def _choose_budget(self, configured: dict) -> None:
        """budget.latency_ms `auto`: chosen now, from where each pool runs and, for a pool on the CPU, its batch
        1's warm-up time (engine/sched/budget_auto.py), and written into the config, so every reader after this
        (the pools' deadlines and `max_batch: auto`, the streams, the ingest processes, the view) sees the one
        value. Said at start either way (`budget_note`)."""
        budget = self.cfg.budget
        timings = {}
        if budget.configured_ms is None:
            import torch
            cuda = torch.cuda.is_available()
            for name, pool in self.pools.items():
                on_gpu = runs_on_gpu(getattr(configured[name], "device", None), cuda)
                timings[name] = PoolTiming(on_gpu, None if on_gpu else pool.batch1_s())
        choice = choose_budget(budget.configured_ms, timings)
        if budget.configured_ms is None:
            budget.choose(choice.latency_ms)
        self.budget_note = choice.note
        log.info("%s", choice.note)

    @property
    def moved_ports(self) -> list:
        """The ports left at their default that were taken and moved to a free one (engine/security/ports.py)."""
        socks = (self.metrics, self.control_socket, self.publisher)
        return [s.moved for s in socks if s is not None and getattr(s, "moved", None) is not None]

    def endpoints(self) -> dict[str, str]:
        """Where this engine listens, as bound (a moved default port shows where it went): config key ->
        endpoint. The live view is served by the runtime (engine/control/runtime.py), which adds it."""
        out = {}
        if self.publisher is not None:
            out["publish.endpoint"] = self.publisher.endpoint
        if self.control_socket is not None:
            out["control.endpoint"] = self.control_socket.endpoint
        if self.metrics is not None and self.metrics.port is not None:
            host = self.cfg.metrics.host
            out["metrics.port"] = f"http://{f'[{host}]' if ':' in host else host}:{self.metrics.port}/metrics"
        return out

    def _start_ingest(self, cores: int) -> None:
        """Ingest processes (engine/ingest): their slots live in /dev/shm, which must hold ring.total_memory_mb
        (a container's default 64 MB would end in SIGBUS in a writer, not an error: checked here, exit 2)."""
        from engine.frames.budget import total_memory_bytes
        from engine.ingest.client import IngestHub
        from engine.ingest.slots import shm_shortfall
        why = shm_shortfall(total_memory_bytes(self.cfg.ring.total_memory_mb))
        if why:
            raise ConfigError(why)
        self.ingest = IngestHub(self.cfg, emit=self._emit, cores=cores)

    def _wake(self) -> None:
        if self.core is not None:
            self.core.wake()

    def _frames_ready(self, n: int = 1) -> None:
        """The rings' notify: n frames committed (EngineCore.frames_ready may let them wait for the step due)."""
        if self.core is not None:
            self.core.frames_ready(n)

    def _emit(self, stream: str, kind: str, reason: str) -> None:
        if self.publisher is not None:
            self.publisher.submit_event(stream, kind, reason)

    # -- run-time control -------------------------------------------------------------------------------
    def control(self, request: object, timeout: float = 10.0) -> dict:
        """One control request, as the control socket takes it; never raises (errors are replies)."""
        from engine.core.ops import handle
        from engine.util.request_fields import text_error
        # every way in (control socket, view API, cluster) passes here: text that is not UTF-8 stops here
        bad_text = text_error(request)
        if bad_text is not None:
            op = request.get("op") if isinstance(request, dict) else None
            return {"ok": False, "error": f"{op[:40]}: {bad_text}" if isinstance(op, str) and op.isascii() else bad_text}
        return handle(self, request, timeout)

    def pool_serving(self, op: str) -> Optional[Pool]:
        return next((p for p in self.pools.values() if p.spec.processor and op in p.spec.processor.ops), None)

    def describe(self) -> dict:
        out = {}
        extras = {name: p.spec.processor.describe() for name, p in self.pools.items() if p.spec.processor}
        fallbacks = {name: p.fallbacks() for name, p in self.pools.items()}  # per pool, once: not per stream
        for entry in self.table.snapshot() if self.table else []:
            if entry.state == "removing":
                continue
            d = self.table.describe(entry)
            d["pools"] = {name: {"published": (s := self.pools[name].acct.snapshot(entry.id)).published,
                                 "dropped": s.dropped} for name in entry.pools}
            for name in entry.pools:  # a GPU piece the pool runs without, with why (only when one fell back)
                if fallbacks[name]:
                    d["pools"][name]["fallbacks"] = fallbacks[name]
            for extra in extras.values():
                d.update(extra.get(entry.id, {}))
            out[entry.id] = d
        return out

    def ended_streams(self) -> list[dict]:
        """Final state of the last `max_ended` streams forgotten after they ended by themselves, oldest first."""
        return self.table.ended() if self.table else []

    def live_streams(self) -> list[str]:
        return [e.id for e in self.table.snapshot() if e.state != "removing"] if self.table else []

    @property
    def streams(self) -> dict:
        """stream id -> its entry (rings, ingest thread, state); read-only view for status lines and tests."""
        return {e.id: e for e in self.table.snapshot()} if self.table else {}

    def stream_counters(self) -> dict[str, dict[str, int]]:
        """Per-stream counters outside the frame accounting (metrics and the status line)."""
        out: dict[str, dict] = {"ring_overwrites": {}, "decode_errors": {}, "reconnects": {}, "lag_s": {},
                                "decode_fallback": {}}
        for entry in self.table.snapshot() if self.table else []:
            out["ring_overwrites"][entry.id] = sum(r.overwrites for r in entry.rings.values())
            if entry.ingest is not None:
                out["decode_errors"][entry.id] = entry.ingest.source.decode_errors
                out["reconnects"][entry.id] = entry.ingest.reconnects
                if (lag := lag_of(entry)) is not None:  # a gauge, for live network streams only
                    out["lag_s"][entry.id] = lag
                if (why := cpu_fallback(entry.ingest.source)) is not None:  # NVDEC possible, the CPU decodes
                    out["decode_fallback"][entry.id] = why
        if self.publisher is not None:
            out["events_dropped"] = dict(self.publisher.stats.events_dropped)
            out["publish_missed"] = dict(self.publisher.stats.missed)
            out["slow_subscribers"] = len(self.publisher.slow_subscribers())
        if self.control_socket is not None:
            out["control_malformed"] = self.control_socket.malformed
        if self.ingest is not None:
            out["ingest"] = self.ingest.counters()
        if self.table is not None:
            out["decoder_threads_stuck"] = self.table.stuck_decoders
            out["streams_forgotten"] = dict(self.table.forgotten)
        if self.view is not None:
            out["view_frames"] = self.view.counters()
        for pool in self.pools.values():
            if pool.spec.processor is not None:
                for name, values in pool.spec.processor.counters().items():
                    out.setdefault(name, {}).update(values)
        return out

    def audit(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Pools whose counters and frame holders disagree (a leaked or double-counted frame)."""
        return {name: bad for name, p in self.pools.items() if (bad := p.acct.audit())}

    # -- state ------------------------------------------------------------------------------------------------
    def finished(self) -> bool:
        """Every stream has ended and its eos was published (removed streams, and ended streams forgotten
        since, count as ended)."""
        entries = self.table.snapshot() if self.table else []
        forgotten = self.table is not None and any(self.table.forgotten.values())
        return (bool(entries) or forgotten) and all(e.eos_sent for e in entries)

    def check_dead(self) -> Optional[str]:
        return self.core.dead if self.core else None

    @property
    def dead_reason(self) -> Optional[str]:
        return self.check_dead()

    def any_failed(self) -> bool:
        """A stream failed: one still listed, or one forgotten since it failed (exit code 1)."""
        if self.table is None:
            return False
        return self.table.forgotten["failed"] > 0 or \
            any(e.failed or (e.ingest is not None and e.ingest.failed) for e in self.table.snapshot())

    # -- stop -------------------------------------------------------------------------------------------------
    def stop(self, *, drain: bool = True, reason: str = "shutdown") -> None:
        """Stop every stream (each eos says `reason`: the runtime passes engine death's cause), then the
        engine's threads and sockets."""
        if self.state in ("stopping", "stopped"):
            return
        self.state = "stopping"
        try:
            self._stop(drain, reason)
        finally:  # even when a close raised: the process is not left frozen (engine/util/gc_pause.py)
            if self._frozen:
                self._frozen = False
                gc_pause.engine_stopped()

    def _stop(self, drain: bool, reason: str) -> None:
        t_end = time.monotonic() + self.cfg.shutdown_timeout_s
        if self.core is not None and self.core.alive:
            self.core.submit(Stop(drain, reason))
            if not self.core.join(self.cfg.shutdown_timeout_s + 2.0):
                log.error("engine core did not stop in time")
        elif self.core is not None:  # the core died or never ran: this thread is the owner now
            self.core.end_all(stop=self.core.dead or reason, drop=DropReason.SHUTDOWN)
        for name, pool in self.pools.items():
            if not pool.stop(max(0.1, t_end - time.monotonic())):
                log.warning("pool %s: a worker still runs a batch after shutdown_timeout_s=%g s (the process may "
                            "abort if it exits now)", name, self.cfg.shutdown_timeout_s)
        for entry in self.table.snapshot() if self.table else []:
            if entry.ingest and not entry.ingest.join(max(0.1, t_end - time.monotonic())):
                log.warning("stream %s: decoder thread did not stop in time (blocked in a read?)", entry.id)
        if self.ingest is not None:
            self.ingest.close(timeout=max(1.0, t_end - time.monotonic()))
        if self.publisher:
            self.publisher.close(timeout=max(1.0, t_end - time.monotonic()))
        if self.metrics:
            self.metrics.close()
        if self.view is not None:
            self.view.close()
        if self.control_socket is not None:
            self.control_socket.close(0)
        if self.curve is not None:
            self.curve.stop()
        self.state = "stopped"

