"""`vidar cluster run`: the head's side. Connects to Ray, starts (or adopts) the controller, hands it the
config's streams and prompts, and serves the cluster's one results endpoint (the proxy) and one
control socket (forwarded to the controller), printing a status line per stream.

Exit codes as `vidar run`: 0 streams ended or stopped by a signal, 1 a stream failed, 2 bad
configuration found while starting (Ray missing or unreachable, busy ports, a stream no engine can
take), 3 the controller is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

import zmq

from engine.config import ClusterConfig, EngineConfig
from engine.control.control_socket import serve_blocking
from engine.security.sockets import bind_control_socket
from engine.errors import ConfigError
from engine.cluster.proxy import ResultsProxy

log = logging.getLogger("vidar.cluster")

EXIT_OK, EXIT_STREAM_FAILED, EXIT_CONFIG, EXIT_DEAD = 0, 1, 2, 3
CALL_S = 30.0
START_S = 180.0  # the controller's and the engines' processes start (imports, models)
HEAD_RESOURCE = "node:__internal_head__"  # Ray gives it to the head node only


def import_ray():
    """Ray, configured for loopback clusters (shared/STACK.md: without this Ray rewrites 127.0.0.1 to the
    machine's address and hangs). Ray is an optional extra: `pip install -e '.[cluster]'`."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise ConfigError("cluster: Ray is not installed; install the extra: pip install -e '.[cluster]'") from None
    return ray


def connect(address: Optional[str], namespace: str):
    ray = import_ray()
    if not ray.is_initialized():
        kwargs = {"namespace": namespace, "log_to_driver": False}
        if address and address.split(":")[0] in ("127.0.0.1", "localhost"):
            kwargs["_node_ip_address"] = "127.0.0.1"
        try:
            if address:
                _probe(address)
            ray.init(address=address or "auto", **kwargs)
        except (ConnectionError, RuntimeError, ValueError, OSError) as err:
            raise ConfigError(f"cluster.address: cannot reach the Ray head at {address or 'auto'}: {err} (start it "
                              "with `vidar cluster up --head`; a head that died took the vidar cluster with it: "
                              "README, Scale-out, known limits)") from None
    return ray


def _probe(address: str, timeout: float = 5.0) -> None:
    """A TCP connect to the head's GCS port first: `ray.init` against a head that is gone retries for
    minutes (measured: `vidar cluster status` still waiting after 300 s), a refused connect fails at once."""
    import socket
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return  # not HOST:PORT (e.g. ray://...): left to ray.init
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
        pass


def controller(ray, tree: dict, cc: ClusterConfig, create: bool = True):
    """(the controller, whether it ran already)."""
    from engine.cluster.controller import CONTROLLER, Controller
    from engine.cluster.engine_actor import NORMAL_PRIORITY
    try:
        return ray.get_actor(CONTROLLER, namespace=cc.namespace), True
    except ValueError:
        if not create:
            raise ConfigError(f"no vidar cluster runs in namespace {cc.namespace!r} (start one with "
                              "`vidar cluster run CONFIG`)") from None
    # detached, named, restarted by Ray when it dies: the desired state it holds is in Ray's KV. On the
    # head's node: anywhere else it would die with a GPU node and be restarted (a new process importing
    # the engine: tens of seconds) just when that node's streams need re-placing (measured: no relocation
    # within 40 s when it happened to sit on the node the test removed). Ray gives the head, and only
    # the head, the resource node:__internal_head__; Ray Train places its own detached state actor with
    # it the same way (a soft NodeAffinitySchedulingStrategy to the head was measured to land elsewhere).
    return ray.remote(Controller).options(
        name=CONTROLLER, namespace=cc.namespace, lifetime="detached", max_restarts=-1,
        max_task_retries=-1, max_concurrency=16, num_cpus=0, runtime_env=NORMAL_PRIORITY,
        resources={HEAD_RESOURCE: 0.001}).remote(tree), False



class ClusterDriver:
    def __init__(self, tree: dict, cfg: EngineConfig, *, ctx: Optional[zmq.Context] = None):
        self.tree, self.cfg = tree, cfg
        self.cc = cfg.cluster or ClusterConfig()
        self._ctx = ctx or zmq.Context.instance()
        self.proxy: Optional[ResultsProxy] = None
        self.controller = None
        self.adopted = False
        self._ctl = None  # ControlSocket, bound at start
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Raises ConfigError for what is wrong at start (nothing left running)."""
        from engine.security.binds import exposure_warning
        if self.cfg.security.allow_insecure_bind and (warning := exposure_warning(self.cfg)):
            log.warning("%s", warning)  # the config refused these without the flag (engine/binds.py)
        ray = connect(self.cc.address, self.cc.namespace)
        self.ray = ray
        try:
            self.proxy = ResultsProxy(self.cc.publish.endpoint, self.cc.publish.hwm, self._ctx)
            # bound as an engine's control socket (a ROUTER: no message shape can wedge it; peers that send
            # nothing valid are closed), with the engine config's message cap
            self._ctl = bind_control_socket(self.cc.control.endpoint, self.cfg.control.max_message_bytes,
                                            ctx=self._ctx, key="cluster.control.endpoint")
            self.controller, self.adopted = controller(ray, self.tree, self.cc)
            if self.adopted:  # a cluster runs already: its config stays; ours adds what it lacks
                log.warning("a vidar cluster runs already in namespace %r: adopting it (its engines keep their "
                            "config; `vidar cluster down` stops it)", self.cc.namespace)
            try:  # a new controller is a new Python process importing the engine: slow on a busy machine
                ray.get(self.controller.ping.remote(), timeout=START_S)
            except ray.exceptions.GetTimeoutError:
                raise ConfigError(f"cluster: the controller did not start within {START_S:g} s "
                                  "(is the cluster overloaded? `ray status` shows its resources)") from None
            for name, why in self._wait_engines().get("pending", {}).items():
                log.warning("engine %s: %s", name, why)
            self._follow()
            for s in self.cfg.streams:
                self._apply({"op": "add_stream", "stream": s.model_dump(exclude_none=True)}, f"streams.{s.id}")
            for o in self.cfg.objects:
                self._apply({"op": "add_object", **o.model_dump(exclude_none=True)}, f"objects.{o.stream}.{o.id}")
        except BaseException:
            self.stop()
            raise
        if self.cfg.metrics.enabled:
            self._serve_metrics()
        for target in (self._serve_control, self._follow_loop):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)

    def _wait_engines(self, timeout: float = 2 * START_S) -> dict:
        """Until every engine the controller started is up (model loading takes a while); the last
        list_engines reply (with the engines that will not start, and why)."""
        end = time.monotonic() + timeout
        while True:
            reply = self.engines()
            starting = [n for n, why in reply.get("pending", {}).items() if why.startswith("starting")]
            if reply.get("ok") and reply["engines"] and not starting:
                return reply
            if time.monotonic() > end:
                raise ConfigError(f"cluster: no engine came up within {timeout:g} s: {reply.get('pending') or reply}")
            time.sleep(0.5)

    def _serve_metrics(self) -> None:
        from prometheus_client import CollectorRegistry

        from engine.publish.metrics import serve_registry
        registry = CollectorRegistry()
        registry.register(_ClusterCollector(self))
        m = self.cfg.metrics  # guarded as an engine's: the Host check, or metrics.token
        self._metrics = serve_registry(registry, m.host, m.port, m.token)

    def _apply(self, req: dict, where: str) -> None:
        reply = self.control(req)
        if not reply["ok"] and "already running" not in reply["error"]:  # adopting a running cluster
            raise ConfigError(f"{where}: {reply['error']}")
        if reply.get("pending"):  # no room now: the controller places it when the reports show some
            log.warning("%s: pending: %s", where, reply["pending"])

    def control(self, req: dict) -> dict:
        try:
            return self.ray.get(self.controller.control.remote(req), timeout=CALL_S)
        except Exception as err:
            return {"ok": False, "error": f"the controller did not answer: {type(err).__name__}"}

    def engines(self) -> dict:
        return self.control({"op": "list_engines"})

    def _follow(self) -> None:
        reply = self.engines()
        if reply.get("ok"):
            self.proxy.follow({e["publish"] for e in reply["engines"].values()})

    def _follow_loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self._follow()
            except Exception:  # the proxy must keep following the engines: logged, tried again
                log.exception("cluster: following the engines' endpoints failed; retrying")

    def _serve_control(self) -> None:
        def handle(req: object) -> dict:
            if not isinstance(req, dict):
                return {"ok": False, "error": "a request is a map"}
            return self.control(req)
        serve_blocking(self._ctl, handle, self._stop)

    def status_lines(self) -> list[str]:
        reply = self.control({"op": "list"})
        if not reply.get("ok"):
            return [f"[cluster] {reply.get('error')}"]
        out = []
        for sid, s in reply["streams"].items():
            pub = sum(c["published"] for c in s["counts"].values())
            where = f"on {s['engine']}" if s["engine"] else f"waiting: {s.get('waiting', 'moving')}"
            out.append(f"[cluster] {sid:<10} {s['state']:<12} {where}  published {pub}  "
                       f"relocations {s['relocations']}  objects {s['objects']}")
        return out

    def finished(self) -> Optional[int]:
        """An exit code once every stream has ended (offline), else None."""
        reply = self.control({"op": "list"})
        streams = reply.get("streams", {}) if reply.get("ok") else {}
        if streams and all(s["state"] in ("ended", "failed") for s in streams.values()):
            return EXIT_STREAM_FAILED if any(s["state"] == "failed" for s in streams.values()) else EXIT_OK
        return None

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2)
        if self.controller is not None and not self.adopted:  # never tear down a cluster this run did not start
            try:
                self.ray.get(self.controller.shutdown.remote(), timeout=CALL_S)
                self.ray.kill(self.controller, no_restart=True)
            except Exception:
                pass
        if getattr(self, "_metrics", None) is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
        if self.proxy is not None:
            self.proxy.close()
        if self._ctl is not None:
            self._ctl.close(0)


class _ClusterCollector:
    """The head's metrics: what relocations cost, per stream, and the proxy's traffic (each engine
    serves its own frame metrics on its node; `vidar cluster status` lists their ports)."""

    def __init__(self, driver: ClusterDriver):
        self.driver = driver

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        reloc = CounterMetricFamily("vidar_cluster_relocations", "Times a stream was started on another engine",
                                    labels=["stream"])
        lost = CounterMetricFamily("vidar_cluster_lost", "What relocations lost: frames in flight at the dead "
                                   "engine's last report, SAM 2 memory banks, decoder sessions", labels=["stream", "what"])
        streams = self.driver.control({"op": "list"}).get("streams", {})
        for sid, s in streams.items():
            reloc.add_metric([sid], s["relocations"])
            for what in ("in_flight", "sam2_banks", "decoder_sessions"):
                lost.add_metric([sid, what], s["lost"].get(what, 0))
        engines = GaugeMetricFamily("vidar_cluster_engines", "Engines answering their heartbeat")
        engines.add_metric([], len(self.driver.engines().get("engines", {})))
        proxy = CounterMetricFamily("vidar_cluster_proxy_messages", "Messages through the results proxy",
                                    labels=["outcome"])
        proxy.add_metric(["forwarded"], self.driver.proxy.forwarded)
        proxy.add_metric(["missed"], self.driver.proxy.missed)  # by a full subscriber (the others got them)
        yield from (reloc, lost, engines, proxy)


def run(tree: dict, cfg: EngineConfig) -> int:
    driver = ClusterDriver(tree, cfg)
    try:
        driver.start()
    except ConfigError as err:
        print(f"vidar: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    print(f"vidar: cluster results on {driver.proxy.endpoint}, control on {driver.cc.control.endpoint}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    code = EXIT_OK
    next_status = time.monotonic()
    while not stop.wait(0.5):
        try:
            driver.ray.get(driver.controller.ping.remote(), timeout=CALL_S)
        except Exception as err:
            log.error("the cluster controller is gone: %s", err)
            code = EXIT_DEAD
            break
        done = driver.finished()
        if done is not None:
            code = done
            break
        if time.monotonic() >= next_status:
            for line in driver.status_lines():
                print(line, flush=True)
            next_status += cfg.status.interval_s
    if code != EXIT_DEAD:
        for line in driver.status_lines():  # the final counts, as `vidar run` prints them
            print(line, flush=True)
    driver.stop()
    return code
