"""The control plane: asyncio on uvloop for the process lifecycle, signals and the status line.

It never decodes and never runs a model: the engine's threads do. It starts the engine,
prints a status line per stream every `status.interval_s` (a progress bar for finite
streams), stops on SIGINT/SIGTERM, and exits when every finite stream has published its eos.
Exit codes: 0 all streams ended well (or stopped by a signal), 1 a stream failed, 3 engine dead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import sys
import time
from typing import Optional, TextIO

from .engine import Engine
from .errors import VidarError

log = logging.getLogger("vidar")

EXIT_OK, EXIT_STREAM_FAILED, EXIT_CONFIG, EXIT_DEAD = 0, 1, 2, 3


class StatusPrinter:
    """Rates from the difference of two accounting snapshots, so the line shows the last interval."""

    def __init__(self, engine: Engine, out: TextIO = sys.stdout):
        self.engine, self.out = engine, out
        self._last: dict[str, tuple[float, int, int]] = {}
        self.lines()  # baseline snapshot: the first printed rates cover the first interval

    def lines(self) -> list[str]:
        now = time.monotonic()
        out = []
        for pool in self.engine.pools.values():
            for sid, st in [(s, self.engine.streams[s]) for s in self.engine.live_streams()]:
                s = pool.acct.snapshot(sid)
                t0, ing0, done0 = self._last.get(sid, (now, s.ingested, s.published))
                dt = max(now - t0, 1e-9)
                fin, fout = (s.ingested - ing0) / dt, (s.published - done0) / dt
                self._last[sid] = (now, s.ingested, s.published)
                state = st.runner.state if st.runner else ("failed" if st.failed else "?")
                drops = ", ".join(f"{k} {v}" for k, v in sorted(s.dropped.items())) or "none"
                fails = ", ".join(f"{k} {v}" for k, v in sorted(s.failed.items())) or "0"
                lat = "-" if math.isnan(s.p50_ms) else f"p50 {s.p50_ms:.0f} ms  p99 {s.p99_ms:.0f} ms"
                total = st.runner.total_frames if st.runner else None
                if st.cfg.mode == "offline" and total:
                    done = s.published + sum(s.dropped.values()) + sum(s.failed.values())
                    filled = int(20 * min(done, total) / total)
                    out.append(f"[{pool.name}] {sid:<10} [{'#' * filled}{'.' * (20 - filled)}] {done}/{total} frames  "
                               f"{fout:5.1f} fps  {lat}  failed {fails}")
                else:
                    out.append(f"[{pool.name}] {sid:<10} {state:<12} in {fin:5.1f} fps  out {fout:5.1f} fps  {lat}  "
                               f"in-flight {s.in_flight}  dropped: {drops}  failed: {fails}")
        return out

    def print(self) -> None:
        for line in self.lines():
            print(line, file=self.out, flush=True)


async def _main(engine: Engine) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await loop.run_in_executor(None, engine.start)
    except VidarError as err:
        log.error("%s", err)
        await loop.run_in_executor(None, lambda: engine.stop(drain=False))
        return EXIT_DEAD
    control = None
    if engine.cfg.control.enabled:
        from .control import serve
        control = asyncio.create_task(serve(engine, engine.cfg.control.endpoint,
                                            engine.cfg.control.max_message_bytes, stop))
    status = StatusPrinter(engine)
    interval = engine.cfg.status.interval_s
    next_status = time.monotonic() + interval
    code = EXIT_OK
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.1)
        except asyncio.TimeoutError:
            pass
        if engine.check_dead():
            log.error("%s", engine.dead_reason)
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
            await asyncio.wait_for(control, timeout=2)
        except (asyncio.TimeoutError, Exception) as err:  # a bind error surfaces here
            if not isinstance(err, asyncio.TimeoutError):
                log.error("control socket: %s", err)
    await loop.run_in_executor(None, lambda: engine.stop(drain=code == EXIT_OK))
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
