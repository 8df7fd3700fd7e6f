"""The per-stream decoder thread: open, pace, stamp, write into the ring, reconnect.

One runner per stream, so a slow or dead stream only ever stalls itself. It stamps every
frame with stream id, sequence number, pts and capture time, sets its deadline (live) and
writes it into the stream's ring. Files end (or loop); network streams whose session ends
reconnect with capped exponential backoff and jitter. Events go out through `emit`.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from typing import Callable, Optional

from engine.errors import SourceError
from engine.frame import FrameMeta
from engine.ring import FrameRing

from .base import Source

log = logging.getLogger("vidar.source")

Emit = Callable[[str, str, str], None]  # (stream, kind, reason)


class SourceRunner:
    def __init__(self, source: Source, ring: FrameRing, *, live: bool, loop: bool, budget_s: float,
                 emit: Emit, reconnect_initial_s: float = 0.5, reconnect_max_s: float = 30.0):
        self.source, self.ring = source, ring
        self.stream = source.stream_id
        self.live, self.loop, self.budget_s = live, loop, budget_s
        self._emit = emit
        self.reconnect_initial_s, self.reconnect_max_s = reconnect_initial_s, reconnect_max_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"source-{self.stream}", daemon=True)
        self.state = "starting"
        self.end_reason = ""
        self.failed = False
        self.seq = 0
        self.reconnects = 0
        self.attempts: deque = deque(maxlen=64)  # monotonic times of connection attempts (bounded)
        self.backoff: deque = deque(maxlen=64)   # the pauses chosen after failed attempts (bounded)
        self.total_frames: Optional[int] = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.ring.close()  # wakes a writer blocked on back-pressure

    def join(self, timeout: Optional[float] = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- thread body ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.source.network:
                self._run_network()
            else:
                self._run_finite()
        except SourceError as err:
            self._fail(err.reason)
        except Exception as err:  # a bug or an unexpected library error: contain it to this stream
            log.exception("stream %s: decoder thread crashed", self.stream)
            self._fail(f"internal error: {type(err).__name__}: {err}")
        finally:
            self.source.close()
            self.ring.close()
            if self.state != "failed":
                self.state = "ended"

    def _fail(self, reason: str) -> None:
        self.failed = True
        self.state = "failed"
        self.end_reason = f"error: {reason}"
        log.error("stream %s: %s", self.stream, reason)
        self._emit(self.stream, "error", reason)

    def _run_finite(self) -> None:
        self.source.open()
        self.total_frames = self.source.total_frames
        self.state = "running"
        self._emit(self.stream, "started", f"opened {self.source.display_url}")
        while not self._stop.is_set():
            self._pump()
            if not self.loop or self._stop.is_set():
                break
            self.source.open()  # loop: start the file again; seq keeps counting
        if self._stop.is_set():
            self.end_reason = "stopped"
        elif self.source.session_error:  # a truncated or unreadable file: what was readable was delivered
            log.warning("stream %s: ended early: %s", self.stream, self.source.session_error)
            self.end_reason = f"ended early: {self.source.session_error}"
        else:
            self.end_reason = "end of stream"

    def _run_network(self) -> None:
        delay = self.reconnect_initial_s
        failures, last_log = 0, 0.0
        while not self._stop.is_set():
            self.attempts.append(time.monotonic())
            try:
                self.source.open()
            except SourceError as err:
                failures += 1
                now = time.monotonic()
                if failures == 1 or now - last_log > 30:  # aggregated: not a line per attempt
                    log.warning("stream %s: cannot connect (%d attempts so far): %s", self.stream, failures, err.reason)
                    last_log = now
                self.state = "reconnecting"
                if failures == 1:
                    self._emit(self.stream, "reconnecting", err.reason)
                pause = delay * random.uniform(0.8, 1.2)  # jitter: cameras behind one switch don't retry in step
                self.backoff.append(pause)
                self._stop.wait(pause)
                delay = min(delay * 2, self.reconnect_max_s)
                continue
            first = self.reconnects == 0 and self.state == "starting"
            self.state = "running"
            self._emit(self.stream, "started" if first else "connected", f"connected to {self.source.display_url}")
            if failures:
                log.info("stream %s: connected after %d failed attempts", self.stream, failures)
            failures, delay = 0, self.reconnect_initial_s
            self._pump()
            self.source.close()
            if self._stop.is_set():
                break
            # The decode loop ended: for RTSP that is a disconnect (server gone), not an eos.
            self.reconnects += 1
            self.state = "reconnecting"
            why = (f"no packet for {2 * self.source.read_timeout_s:g} s or connection lost: {self.source.session_error}"
                   if self.source.session_error else "stream ended (server closed the session)")
            log.warning("stream %s: disconnected (%s); reconnecting", self.stream, why)
            self._emit(self.stream, "reconnecting", why)
            self._stop.wait(min(1.0, delay))  # first retry within 1 s
        self.end_reason = "stopped"

    def _pump(self) -> None:
        """Read one session's frames into the ring, paced in live mode for non-network sources."""
        pace = self.live and not self.source.network
        t_start = time.monotonic()
        pts0: Optional[float] = None
        fps = self.source.fps
        for k, frame in enumerate(self.source.frames()):
            if self._stop.is_set():
                return
            if pace:
                pts0 = frame.pts if pts0 is None else pts0
                offset = frame.pts - pts0 if frame.pts >= pts0 else (k / fps if fps else 0.0)
                wait = t_start + offset - time.monotonic()
                if wait > 0:
                    if self._stop.wait(wait):
                        return
                elif wait < -1.0:  # fell behind by a second (slow decode): re-anchor, never burst
                    t_start, pts0 = time.monotonic(), frame.pts
            now_wall, now_mono = time.time(), time.monotonic()
            captured = frame.decode_s if self.source.network else 0.0  # network: it arrived before decoding
            meta = FrameMeta(self.stream, self.seq, frame.pts, now_wall - captured,
                             decode_s=frame.decode_s,
                             deadline=(now_mono - captured + self.budget_s) if self.live else math.inf)
            if not self.ring.write(meta, frame.rgb, self._stop):
                return
            self.seq += 1
