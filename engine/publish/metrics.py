"""Prometheus metrics: per-stream frame counters read from `Accounting` at scrape time
(so they are the same numbers the status line prints) and per-stage latency histograms."""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from typing import Any, Callable, Iterable, Optional
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.frames.accounting import Accounting
from engine.security.binds import is_loopback_host
from engine.security.ports import MovedPort, in_use
from engine.util.memory import heap_bytes

log = logging.getLogger("vidar.metrics")

STAGES = ("decode", "queue_wait", "batch_wait", "inference", "publish")
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.017, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


STREAM_COUNTERS = {  # name -> help; values come from the engine's per-stream counters
    "ring_overwrites": "Live frames overwritten in a full ring",
    "decode_errors": "Corrupt packets skipped (the decoder resyncs at the next keyframe)",
    "reconnects": "Network sessions that ended and were reconnected",
    "events_dropped": "Events dropped: more than 64 of a stream's events were held back by a subscriber at its HWM",
    "publish_missed": "Messages sent while a subscriber's queue was full: that subscriber missed them, the others "
                      "received them (live streams; the slow subscriber is named in the log)",
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
        lag = GaugeMetricFamily("vidar_stream_lag_seconds", "A live network stream's lag behind its camera: its last "
                                "packet's arrival minus its time on the camera's clock (streams/clock.py)",
                                labels=["stream"])
        for stream, seconds in counters.get("lag_s", {}).items():
            lag.add_metric([stream], seconds)
        yield lag
        if "ingest" in counters:
            ctx = GaugeMetricFamily("vidar_ingest_cuda_contexts", "Ingest processes holding a CUDA context of their own "
                                    "(a stream decoding with NVDEC opened there; held for the process's life)")
            ctx.add_metric([], counters["ingest"].get("cuda_contexts", 0))
            yield ctx
        nvdec = GaugeMetricFamily("vidar_decode_fallback", "A stream that could decode with NVDEC (decode auto on a "
                                  "CUDA machine) decodes on the CPU (1), and why", labels=["stream", "reason"])
        for stream, why in counters.get("decode_fallback", {}).items():
            nvdec.add_metric([stream, why[:200]], 1)
        yield nvdec
        if "decoder_threads_stuck" in counters:
            stuck = CounterMetricFamily("vidar_decoder_threads_stuck", "Decoder threads of removed streams still "
                                        "blocked after the reap bound (a read that cannot be interrupted), let go")
            stuck.add_metric([], counters["decoder_threads_stuck"])
            yield stuck
        if "slow_subscribers" in counters:
            slow = GaugeMetricFamily("vidar_publish_slow_subscribers", "Subscribers whose queue is full now (not "
                                     "reading); each is named in the log with how long")
            slow.add_metric([], counters["slow_subscribers"])
            yield slow
        if "control_malformed" in counters:
            bad = CounterMetricFamily("vidar_control_malformed_requests", "Control requests refused for their shape "
                                      "(not one msgpack frame after the empty delimiter) or payload (not msgpack)")
            bad.add_metric([], counters["control_malformed"])
            yield bad
        if "streams_forgotten" in counters:  # an ended stream's own series go with it; this counts them
            gone = CounterMetricFamily("vidar_streams_forgotten", "Streams forgotten after they ended by themselves "
                                       "(ended_keep_s, max_ended), by final state", labels=["state"])
            for state, n in counters["streams_forgotten"].items():
                gone.add_metric([state], n)
            yield gone
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


class _FallbackCollector:
    """vidar_gpu_fallback: 1 for each GPU piece a pool runs without (Pool.fallbacks), the reason a label (one per
    pool and piece: bounded)."""

    def __init__(self, fallbacks: Callable[[], dict]):
        self._fallbacks = fallbacks

    def collect(self):
        fam = GaugeMetricFamily("vidar_gpu_fallback", "A GPU piece a pool runs without (1), and why",
                                labels=["pool", "piece", "reason"])
        for pool, pieces in self._fallbacks().items():
            for piece, reason in pieces.items():
                fam.add_metric([pool, piece, reason[:200]], 1)
        yield fam


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
                 qos: Callable[[], dict] = dict, fallbacks: Callable[[], dict] = dict):
        self.registry = CollectorRegistry()  # per engine: tests run several engines in one process
        self.registry.register(_AccountingCollector(accountings, stream_counters))
        self.registry.register(_QosCollector(qos))
        self.registry.register(_FallbackCollector(fallbacks))
        self.registry.register(_HeapCollector())
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, open fds, CPU seconds
        self.stage = Histogram("vidar_stage_seconds", "Time spent per frame in each stage",
                               ["pool", "stage"], buckets=_BUCKETS, registry=self.registry)
        self._children: dict[tuple[str, str], Any] = {}  # (pool, stage) -> the histogram's child
        self._server = None
        self.moved: Optional[MovedPort] = None  # the default port was taken: served on a free one instead

    def observe(self, pool: str, stage: str, seconds: float) -> None:
        # labels() builds a key and takes the metric's lock on every call (~2 us, twice a frame, measured by
        # benchmarks/bench_host.py --profile); the children are fixed, so each is looked up once. Races
        # only ever store the same child twice.
        child = self._children.get((pool, stage))
        if child is None:
            child = self._children[(pool, stage)] = self.stage.labels(pool, stage)
        child.observe(seconds)

    def serve(self, host: str, port: int, token: Optional[str] = None, *, movable: bool = False) -> None:
        """Serve /metrics on its own threads. Without a token, requests must name a loopback host (a
        DNS-rebinding page gets 403, as from the view); with one, they carry `Authorization: Bearer`.
        `movable`: metrics.port is its default, left unset: taken, it moves to a port the OS picks
        (engine/security/ports.py), and `moved` says so."""
        self._server = serve_registry(self.registry, host, port, token, movable=movable)
        if movable and self._server.server_port != port and port != 0:
            self.moved = MovedPort("metrics.port", _http_url(host, port), _http_url(host, self._server.server_port))
            log.warning("%s", self.moved.note())
        log.info("metrics on %s%s", _http_url(host, self._server.server_port),
                 " (Authorization: Bearer <metrics.token>)" if token else "")

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


# -- the endpoint -------------------------------------------------------------------------------------
# prometheus_client's start_http_server takes no app of ours (no Host or token check) and no bound on
# connections: a thread per connection, each waiting on its client for ever. Its WSGI app and its
# threading server are used as they are, behind the guard, the read timeout and the cap below.
READ_TIMEOUT_S = 10.0    # a client that has not sent its request within this is closed
MAX_CONNECTIONS = 32     # connections served at once; more are closed at once and counted


def _guard(app, token: Optional[str]):
    expected = f"Bearer {token}".encode() if token else None

    def guarded(environ, start_response):
        if expected is None:
            try:
                host = urlsplit("//" + environ.get("HTTP_HOST", "")).hostname or ""
            except ValueError:  # `Host: [`: not a host name at all
                return _deny(start_response, "400 Bad Request", "the Host header is not a host name")
            if not is_loopback_host(host):
                return _deny(start_response, "403 Forbidden", f"host {host!r} is not a loopback name (DNS rebinding?)")
        else:  # WSGI hands headers over as latin-1 strings: compare bytes, any bytes a client sent
            sent = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
            if not hmac.compare_digest(sent, expected):
                return _deny(start_response, "401 Unauthorized", "send Authorization: Bearer <metrics.token>")
        return app(environ, start_response)
    return guarded


def _deny(start_response, status: str, why: str) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
    return [f"vidar metrics: {why}\n".encode()]


class _Handler(WSGIRequestHandler):
    # socketserver sets it on the connection, per read; the server's reaper also holds each connection to
    # it as a deadline (a client trickling a byte every few seconds never hits a per-read timeout)
    timeout = READ_TIMEOUT_S

    def finish(self):
        try:
            super().finish()
        except OSError:  # the reaper shut the connection down under it
            pass

    def log_message(self, format, *args):  # no access log
        pass


class _Server(ThreadingWSGIServer):
    daemon_threads = True
    request_queue_size = 64  # listen backlog (socketserver's default is 5)

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0
        self._open: dict = {}  # connection -> its deadline (monotonic)
        self._open_lock = threading.Lock()
        self._closed = False
        super().__init__(*args, **kwargs)
        threading.Thread(target=self._reap, name="metrics-reaper", daemon=True).start()

    def _reap(self) -> None:
        """One thread for every connection's deadline (not a timer per connection)."""
        while not self._closed:
            time.sleep(0.2)
            now = time.monotonic()
            with self._open_lock:
                late = [c for c, t in self._open.items() if now > t]
                for c in late:
                    del self._open[c]
            for c in late:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def server_close(self) -> None:
        self._closed = True
        super().server_close()

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                log.warning("metrics: %d connections refused so far: more than %d open at once", self.refused,
                            MAX_CONNECTIONS)
            self.shutdown_request(request)
            return
        with self._open_lock:
            self._open[request] = time.monotonic() + _Handler.timeout
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def handle_error(self, request, client_address):
        """A client that timed out or went away is its own problem: no traceback on stderr."""
        import sys
        if isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
            return
        log.exception("metrics: request from %s failed", client_address[0])

    def _forget(self, request) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        self._slots.release()

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)


def serve_registry(registry: CollectorRegistry, host: str, port: int, token: Optional[str] = None, *,
                   movable: bool = False) -> "_Server":
    """/metrics of `registry` on its own threads, guarded (the engine's and a cluster head's). A port that
    cannot be bound is a BindError naming metrics.port; `movable` (the default port, left unset): a taken port
    is served on one the OS picks instead."""
    from engine.errors import BindError
    app = _guard(make_wsgi_app(registry), token)
    try:
        try:
            return _serve_guarded(host, port, app)
        except OSError as err:
            if not (movable and in_use(err)):
                raise
            return _serve_guarded(host, 0, app)
    except OSError as err:
        raise BindError("metrics.port", f"{host}:{port}",
                        f"metrics.port: cannot serve on {host}:{port}: {err} (another vidar running? set "
                        "metrics.port to a free port, or leave it unset: its default moves to a free port when "
                        "taken; or metrics.enabled: false)") from None


def _http_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def _serve_guarded(host: str, port: int, app) -> _Server:
    server_class = type("_Server", (_Server,), {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
    server = make_server(host.strip("[]"), port, app, server_class, handler_class=_Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
