"""The control plane: asyncio on uvloop for the process lifecycle, signals and the status line.

It never decodes and never runs a model: the engine's threads do. It starts the engine,
prints a status line per stream every `status.interval_s` (a progress bar for finite
streams), stops on SIGINT/SIGTERM, and exits when every finite stream has published its eos.
Exit codes: 0 all streams ended well (or stopped by a signal), 1 a stream failed, 2 bad configuration
found while starting (unknown model, missing or mismatched weights, busy port, no GPU for device
cuda, missing CURVE key), 3 engine dead at run time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import sys
import time
from typing import Optional, TextIO

from engine.core.engine import Engine
from engine.core.stream_table import lag_of
from engine.errors import ConfigError, VidarError, WeightsError

log = logging.getLogger("vidar")

EXIT_OK, EXIT_STREAM_FAILED, EXIT_CONFIG, EXIT_DEAD = 0, 1, 2, 3


class StatusPrinter:
    """Rates from the difference of two accounting snapshots, so the line shows the last interval."""

    def __init__(self, engine: Engine, out: TextIO = sys.stdout):
        self.engine, self.out = engine, out
        self._last: dict[tuple[str, str], tuple[float, int, int]] = {}  # (pool, stream): one stream feeds several pools
        self.lines()  # baseline snapshot: the first printed rates cover the first interval

    def lines(self) -> list[str]:
        now = time.monotonic()
        out = []
        listed = self.engine.streams
        entries = [e for e in listed.values() if e.state != "removing"]
        for key in [k for k in self._last if k[1] not in listed]:  # forgotten streams: kept bounded
            del self._last[key]
        for name, pool in self.engine.pools.items():
            for entry in [e for e in entries if name in e.pools]:
                out.append(self._line(name, pool, entry, now))
        return out

    def _line(self, name: str, pool, entry, now: float) -> str:
        sid = entry.id
        s = pool.acct.snapshot(sid)
        t0, ing0, done0 = self._last.get((name, sid), (now, s.ingested, s.published))
        dt = max(now - t0, 1e-9)
        fin, fout = (s.ingested - ing0) / dt, (s.published - done0) / dt
        self._last[(name, sid)] = (now, s.ingested, s.published)
        drops = ", ".join(f"{k} {v}" for k, v in sorted(s.dropped.items())) or "none"
        fails = ", ".join(f"{k} {v}" for k, v in sorted(s.failed.items())) or "0"
        lat = "-" if math.isnan(s.p50_ms) else f"p50 {s.p50_ms:.0f} ms  p99 {s.p99_ms:.0f} ms"
        total = entry.ingest.total_frames if entry.ingest else None
        if entry.cfg.mode == "offline" and total:
            done = s.published + sum(s.dropped.values()) + sum(s.failed.values())
            filled = int(20 * min(done, total) / total)
            return (f"[{name}] {sid:<10} [{'#' * filled}{'.' * (20 - filled)}] {done}/{total} frames  "
                    f"{fout:5.1f} fps  {lat}  failed {fails}")
        k = pool.qos.interval(sid)
        qos = f"  1 in {k}" if k > 1 else ""  # the degradation ladder samples this stream
        lag = lag_of(entry)  # a live network stream's lag behind its camera (streams/clock.py)
        behind = f"  behind live {lag:.2f} s" if lag is not None else ""
        return (f"[{name}] {sid:<10} {entry.display_state:<12} in {fin:5.1f} fps  out {fout:5.1f} fps{qos}{behind}  "
                f"{lat}  in-flight {s.in_flight}  dropped: {drops}  failed: {fails}")

    def print(self) -> None:
        for line in self.lines():
            print(line, file=self.out, flush=True)


#: what a client of a moved port passes, by key (a second engine on a machine: engine/security/ports.py)
_CLIENTS = {"publish.endpoint": "subscribers connect there: vidar subscribe {}",
            "control.endpoint": "control clients pass it: vidar control list --endpoint {}",
            "metrics.port": "scrape {}", "view.port": "open {}"}


def print_endpoints(engine: Engine, view=None, out: TextIO = sys.stdout) -> None:
    """Where the engine listens, as bound, once it has started; then each default port that was taken and moved,
    loudly, with what its clients pass."""
    where = engine.endpoints()
    names = {"publish.endpoint": "results on", "control.endpoint": "control on", "metrics.port": "metrics on"}
    print("vidar: " + ", ".join(f"{names[k]} {v}" for k, v in where.items()), file=out, flush=True)
    if view is not None:
        print(f"vidar: live view on {view.url}" + (f" (log in: {view.login_url})" if view.login_url else ""),
              file=out, flush=True)
    moved = engine.moved_ports + ([view.moved] if view is not None and view.moved is not None else [])
    for m in moved:
        print(f"vidar: PORT MOVED: {m.note()}; {_CLIENTS[m.key].format(m.bound)}", file=out, flush=True)


async def _main(engine: Engine) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await loop.run_in_executor(None, engine.start)  # stops what it started if it fails
    except (ConfigError, WeightsError) as err:  # found while starting: one line, naming the key
        print(f"vidar: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except VidarError as err:
        log.error("%s", err)
        return EXIT_DEAD
    print(f"vidar: {engine.budget_note}", flush=True)
    view = None
    if engine.view is not None:
        from engine.view.server import ViewServer
        view = ViewServer(engine, engine.cfg.view)
        try:
            await view.start()
        except ConfigError as err:
            print(f"vidar: {err}", file=sys.stderr, flush=True)
            await loop.run_in_executor(None, lambda: engine.stop(drain=False))
            return EXIT_CONFIG
    print_endpoints(engine, view)
    control = None
    if engine.control_socket is not None:
        from engine.control.control_socket import serve
        from engine.executor.supervise import SupervisedTask
        f = engine.cfg.faults
        control = SupervisedTask("control socket", lambda: serve(engine, engine.control_socket, stop),
                                 max_failures=f.max_failures, window_s=f.window_s)
    status = StatusPrinter(engine)
    interval = engine.cfg.status.interval_s
    next_status = time.monotonic() + interval
    code, dead = EXIT_OK, None
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.1)
        except asyncio.TimeoutError:
            pass
        if engine.check_dead():
            log.error("%s", engine.dead_reason)
            code = EXIT_DEAD
            break
        # the control plane's own tasks: restarted when they end by themselves, engine death when they keep
        # ending (never an engine that runs on without its control socket or its view's state)
        dead = None if stop.is_set() else next(
            (why for why in (control and control.health(), view and view.health()) if why), None)
        if dead:
            log.error("engine dead: %s", dead)
            code = EXIT_DEAD
            break
        if engine.finished():
            break
        if time.monotonic() >= next_status:
            status.print()
            next_status += interval
    if stop.is_set():
        log.info("signal received: draining (up to %.1f s)", engine.cfg.shutdown_timeout_s)
    stop.set()  # also ends the control socket
    if control is not None:
        try:
            await asyncio.wait_for(control.task, timeout=2)
        except (asyncio.TimeoutError, Exception) as err:
            if not isinstance(err, asyncio.TimeoutError):
                log.error("control socket: %s: %s", type(err).__name__, err)
    if view is not None:
        await view.stop()
    # every stream's eos names why it ended: engine death's cause (a control task that kept crashing, ...)
    why = f"engine dead: {dead}" if dead else "shutdown"
    await loop.run_in_executor(None, lambda: engine.stop(drain=code == EXIT_OK, reason=why))
    status.print()
    if code == EXIT_OK and engine.any_failed():
        code = EXIT_STREAM_FAILED
    return code


def run(engine: Engine) -> int:
    """Run the engine until its streams end or a signal arrives. Returns the exit code."""
    try:
        import uvloop
        runner: Optional[asyncio.Runner] = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # uvloop is optional off Linux/macOS
        runner = asyncio.Runner()
    with runner:
        return runner.run(_main(engine))
