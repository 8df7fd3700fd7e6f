"""Prometheus metrics: per-stream frame counters read from `Accounting` at scrape time
(so they are the same numbers the status line prints) and per-stage latency histograms."""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .accounting import Accounting
from .memory import heap_bytes

log = logging.getLogger("vidar.metrics")

STAGES = ("decode", "queue_wait", "batch_wait", "inference", "publish")
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.017, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


STREAM_COUNTERS = {  # name -> help; values come from the engine's per-stream counters
    "ring_overwrites": "Live frames overwritten in a full ring",
    "decode_errors": "Corrupt packets skipped (the decoder resyncs at the next keyframe)",
    "reconnects": "Network sessions that ended and were reconnected",
    "events_dropped": "Events dropped: more than 64 of a stream's events were held back by a subscriber at its HWM",
    "object_failures": "Tracked objects whose step failed on a frame (their memory is left as it was)",
}


class _AccountingCollector:
    def __init__(self, accountings: Callable[[], Iterable[Accounting]], stream_counters: Callable[[], dict]):
        self._accountings, self._stream_counters = accountings, stream_counters

    def collect(self):
        ing = CounterMetricFamily("vidar_frames_ingested", "Frames written into a stream's ring", labels=["stream", "pool"])
        pub = CounterMetricFamily("vidar_frames_published", "Results published", labels=["stream", "pool"])
        drop = CounterMetricFamily("vidar_frames_dropped", "Frames dropped, by reason", labels=["stream", "pool", "reason"])
        fail = CounterMetricFamily("vidar_frames_failed", "Frames failed, by reason", labels=["stream", "pool", "reason"])
        infl = GaugeMetricFamily("vidar_frames_in_flight", "Frames ingested and not yet terminal", labels=["stream", "pool"])
        for acct in self._accountings():
            for stream in acct.streams():
                s = acct.snapshot(stream)
                ing.add_metric([stream, acct.pool], s.ingested)
                pub.add_metric([stream, acct.pool], s.published)
                infl.add_metric([stream, acct.pool], s.in_flight)
                for reason, n in s.dropped.items():
                    drop.add_metric([stream, acct.pool, reason], n)
                for reason, n in s.failed.items():
                    fail.add_metric([stream, acct.pool, reason], n)
        yield from (ing, pub, drop, fail, infl)
        counters = self._stream_counters()
        for name, help_text in STREAM_COUNTERS.items():
            fam = CounterMetricFamily(f"vidar_{name}", help_text, labels=["stream"])
            for stream, n in counters.get(name, {}).items():
                fam.add_metric([stream], n)
            yield fam
        view = CounterMetricFamily("vidar_view_frames", "Live view: frames its tap took, by outcome (shown; busy: "
                                   "replaced before encoding; unmatched: no result came; superseded: a newer frame "
                                   "was shown; results_overflow: results the view could not keep up with)",
                                   labels=["stream", "outcome"])
        for outcome, per_stream in counters.get("view_frames", {}).items():
            for stream, n in per_stream.items():
                view.add_metric([stream, outcome], n)
        yield view


class _QosCollector:
    def __init__(self, qos: Callable[[], dict]):
        self._qos = qos

    def collect(self):
        level = GaugeMetricFamily("vidar_qos_level", "Degradation ladder rung of a pool (0: as configured)",
                                  labels=["pool"])
        interval = GaugeMetricFamily("vidar_qos_interval", "A pool processes 1 live frame in this many", labels=["pool"])
        steps = CounterMetricFamily("vidar_qos_steps", "Degradation ladder steps, by direction", labels=["pool", "direction"])
        for pool, st in self._qos().items():
            level.add_metric([pool], st["rung"])
            interval.add_metric([pool], st["interval"])
            for direction in ("degraded", "restored"):
                steps.add_metric([pool, direction], st[direction])
        yield from (level, interval, steps)


class _HeapCollector:
    """glibc heap: in use and mmapped (grow with a leak), free inside the arenas (grows with
    fragmentation); with process_resident_memory_bytes this tells the two apart in production.
    A scrape takes each arena's lock for the walk: microseconds, every scrape interval."""

    def collect(self):
        heap = heap_bytes()
        if heap is None:  # not glibc
            return
        fam = GaugeMetricFamily("vidar_malloc_bytes", "glibc malloc heap, by state", labels=["state"])
        fam.add_metric(["in_use"], heap["in_use"])
        fam.add_metric(["free"], heap["free"])
        fam.add_metric(["mmapped"], heap["mmapped"])
        yield fam


class Metrics:
    def __init__(self, accountings: Callable[[], Iterable[Accounting]], stream_counters: Callable[[], dict],
                 qos: Callable[[], dict] = dict):
        self.registry = CollectorRegistry()  # per engine: tests run several engines in one process
        self.registry.register(_AccountingCollector(accountings, stream_counters))
        self.registry.register(_QosCollector(qos))
        self.registry.register(_HeapCollector())
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, open fds, CPU seconds
        self.stage = Histogram("vidar_stage_seconds", "Time spent per frame in each stage",
                               ["pool", "stage"], buckets=_BUCKETS, registry=self.registry)
        self._server = None

    def observe(self, pool: str, stage: str, seconds: float) -> None:
        self.stage.labels(pool, stage).observe(seconds)

    def serve(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server
        from .errors import ConfigError
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise ConfigError(f"metrics.port: cannot serve on {host}:{port}: {err} "
                              "(set metrics.port to a free port or metrics.enabled: false)") from None
        log.info("metrics on http://%s:%d/metrics", host, self._server.server_port)

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
