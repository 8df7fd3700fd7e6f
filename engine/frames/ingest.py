"""The per-stream decoder thread: open, pace, stamp, write into the ring, reconnect.

One ingest thread per stream, so a slow or dead stream only ever stalls itself. It stamps every
frame with stream id, sequence number, pts and capture time, sets its deadline (live: capture
+ budget) and writes it into the stream's ring. The capture time is when the frame's last
packet arrived (network; live, its pts on the camera's clock, never later: streams/clock.py), when it
was due (paced live files and synthetic streams: never "now, after sleeping"), or when it was decoded
(offline). A live network source tells it of the frames it discarded unseen to skip to the live edge:
counted as `deadline` drops at the source, seq moving on by as many. A live frame already past its deadline when
it is ready to write is dropped there (`deadline`, as the scheduler would), never copied. Files end (or
loop); network streams whose session ends reconnect, paced by streams/backoff.py. Events go out
through `emit`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from engine.errors import SourceError
from engine.frames.lifecycle import DropReason, FrameMeta
from engine.util.threads import OwnThread

from streams.backoff import Backoff
from streams.base import DecodedFrame, Source
from streams.convert import NV12Planes
from streams.urls import redact_url

if TYPE_CHECKING:  # not at run time: an ingest process (engine/ingest/process.py) runs this without torch
    from engine.frames.ring import FrameRing

log = logging.getLogger("vidar.source")

Emit = Callable[[str, str, str], None]  # (stream, kind, reason)


class IngestThread(OwnThread):
    def __init__(self, source: Source, ring: FrameRing, *, live: bool, loop: bool, budget_s: float,
                 emit: Emit, reconnect_initial_s: float = 0.5, reconnect_max_s: float = 30.0,
                 backoff_reset_after_s: float = 10.0):
        self.source, self.ring = source, ring
        self.stream = source.stream_id
        self.live, self.loop, self.budget_s = live, loop, budget_s
        source.live = live  # before any open: a live source trades completeness for freshness
        source.budget_s = budget_s if live else None  # a live network source skips to the live edge past it
        source.on_skipped = self._skipped
        # live into slots lent to an ingest process (engine/ingest/process.RemoteRing): a frame decoded while every
        # slot is in use is dropped, so the source does not convert it; an in-engine ring takes every frame
        source.wants = ring.has_slot if live and hasattr(ring, "has_slot") else None
        self._takes_planes = getattr(ring, "takes_planes", False)  # RemoteRing: NV12Planes written into the slot
        self._emit = emit
        self._policy = Backoff(reconnect_initial_s, reconnect_max_s, backoff_reset_after_s)
        self._troubles, self._last_log = 0, -math.inf  # failed opens and short sessions since a good session
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"source-{self.stream}", daemon=True)
        self.state = "starting"
        self.end_reason = ""
        self.failed = False
        self.seq = 0
        self._session_frames = 0  # frames the current (or last) session wrote into the ring
        self.reconnects = 0
        self.attempts: deque = deque(maxlen=64)  # monotonic times of connection attempts (bounded)
        self.backoff: deque = deque(maxlen=64)   # the pauses chosen after failed attempts and ended sessions
        self.total_frames: Optional[int] = None
        self.skipped = 0  # frames the source discarded unseen to reach the live edge (counted as deadline drops)

    @property
    def lag_s(self) -> Optional[float]:
        """How far behind its camera a live network stream is read (seconds); None for other streams."""
        return self.source.lag_s if self.live and self.source.network else None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.ring.close()  # wakes a writer blocked on back-pressure
        self.source.cancel()  # and a blocked open or read (a named pipe with no writer)

    # -- thread body ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.source.network:
                self._run_network()
            else:
                self._run_finite()
        except SourceError as err:
            if self._stop.is_set():  # an open the stop cancelled: a removal, not a failure
                self.end_reason = "stopped"
            else:
                self._fail(err.reason)
        except Exception as err:  # a bug or an unexpected library error: contain it to this stream
            # The message (and so the traceback's last line) may quote the URL: both are redacted.
            log.error("stream %s: decoder thread crashed:\n%s", self.stream,
                      redact_url("".join(traceback.format_exception(err)).rstrip()))
            self._fail(redact_url(f"internal error: {type(err).__name__}: {err}"))
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
        elif self._short_of_declared():
            # FFmpeg ends a truncated file like a complete one; its index says how many frames it held
            why = f"{self._session_frames} of the {self.total_frames} frames the file declares (truncated?)"
            log.warning("stream %s: ended early: %s", self.stream, why)
            self.end_reason = f"ended early: {why}"
        else:
            self.end_reason = "end of stream"

    def _short_of_declared(self) -> bool:
        """The last pass delivered clearly fewer frames than the container declares (2 % slack for
        declarations estimated from duration x rate)."""
        total = self.total_frames
        return bool(total) and self._session_frames < total - max(1, int(0.02 * total))

    def _run_network(self) -> None:
        failures = 0  # failed opens in a row
        while not self._stop.is_set():
            self.attempts.append(time.monotonic())
            try:
                self.source.open()
            except SourceError as err:
                failures += 1
                self._trouble(f"cannot connect: {err.reason}")
                self.state = "reconnecting"
                if failures == 1:
                    self._emit(self.stream, "reconnecting", err.reason)
                self._pause(self._policy.after_failure())
                continue
            first = self.reconnects == 0 and self.state == "starting"
            self.state = "running"
            self._emit(self.stream, "started" if first else "connected", f"connected to {self.source.display_url}")
            if failures:
                log.info("stream %s: connected after %d failed attempts", self.stream, failures)
            failures = 0
            delivered_s = self._pump()
            self.source.close()
            if self._stop.is_set():
                break
            # The decode loop ended: for a network stream that is a disconnect (server gone), not an eos.
            self.reconnects += 1
            self.state = "reconnecting"
            self._disconnected(delivered_s)
            self._pause(self._policy.after_session(delivered_s))
        self.end_reason = "stopped"

    def _disconnected(self, delivered_s: float) -> None:
        if self.source.fell_behind:  # the source ended the session itself, to start again at the live edge
            why = self.source.session_error
        elif self.source.session_error:
            why = f"no packet for {2 * self.source.read_timeout_s:g} s or connection lost: {self.source.session_error}"
        else:
            why = "stream ended (server closed the session)"
        self._emit(self.stream, "reconnecting", why)
        if delivered_s >= self._policy.reset_after_s:
            self._troubles = 0
            log.warning("stream %s: disconnected (%s); reconnecting", self.stream, why)
        else:  # a server that drops every session at once: as quiet as one that refuses
            self._trouble(f"session ended after {delivered_s:.1f} s of frames: {why}")

    def _trouble(self, what: str) -> None:
        """A failed open or a short session: logged the first time, then at most every 30 s."""
        self._troubles += 1
        now = time.monotonic()
        if self._troubles == 1 or now - self._last_log > 30:
            log.warning("stream %s: %s (%d failed attempts or short sessions so far); retrying with backoff",
                        self.stream, what, self._troubles)
            self._last_log = now

    def _pause(self, seconds: float) -> None:
        self.backoff.append(seconds)
        self._stop.wait(seconds)

    def _pump(self) -> float:
        """Read one session's frames into the ring (paced in live mode for non-network sources).

        Returns for how long the session delivered frames (first to last frame), in seconds.
        """
        pacer = _Pacer(self.source.fps) if self.live and not self.source.network else None
        first = last = None
        self._session_frames = 0
        for frame in self.source.frames():
            if self._stop.is_set():
                break
            due = None
            if pacer is not None:
                due = pacer.due(frame.pts)
                wait = due - time.monotonic()
                if wait > 0 and self._stop.wait(wait):
                    break
            t_mono, t_wall = self._capture_time(frame, due)
            if self.live and t_mono + self.budget_s < time.monotonic():
                # Past its deadline before it is even written (a source that fell behind, a slow decode): the
                # scheduler would drop it unseen (deadline); dropped here, counted the same, and the copy into a
                # slot, the descriptor and the scheduling are not spent on it, when the cores are short.
                self.ring.drop_at_source(1, DropReason.DEADLINE)
                self.seq += 1
                self._session_frames += 1
                continue
            if frame.unconverted:  # no slot was free when it was decoded (Source.wants): dropped as write() would
                self.ring.drop_at_source(1, DropReason.RING_FULL)
                self.seq += 1
                self._session_frames += 1
                continue
            meta = FrameMeta(self.stream, self.seq, frame.pts, t_wall, decode_s=frame.decode_s,
                             deadline=t_mono + self.budget_s if self.live else math.inf, t_capture_mono=t_mono,
                             colour=frame.colour)
            # NVDEC frames are NV12 in GPU memory (rgb None), valid once `ready` fires on the GPU
            pixels = frame.rgb if frame.nv12 is None else frame.nv12
            if isinstance(pixels, NV12Planes) and not self._takes_planes:
                pixels = np.asarray(pixels)  # an in-engine ring takes arrays; an ingest process's writes planes itself
            if not self.ring.write(meta, pixels, self._stop, frame.ready):
                break
            self.seq += 1
            self._session_frames += 1
            last = time.monotonic()
            first = last if first is None else first
        return last - first if first is not None else 0.0

    def _skipped(self, n: int) -> None:
        """The source discarded n frames unseen (packets skipped to reach the live edge, streams/clock.py): they
        were past their deadline, so they are counted as the scheduler would have, and seq moves on by n so
        that what got in and what is accounted for stay equal. Called on this thread (inside frames())."""
        if not self.skipped:  # once a stream: under a lasting overload it skips every few seconds
            lag = self.source.lag_s
            log.warning("stream %s: %s behind its camera, past its budget of %.0f ms (the ingest cannot keep up): "
                        "skipping undecoded to a keyframe at the live edge; skipped frames count as deadline drops",
                        self.stream, f"{lag:.2f} s" if lag is not None else "further", self.budget_s * 1e3)
        self.ring.drop_at_source(n, DropReason.DEADLINE)
        self.seq += n
        self.skipped += n

    def _capture_time(self, frame: DecodedFrame, due: Optional[float]) -> tuple[float, float]:
        """(monotonic, wall) moment the frame counts as captured; its deadline is counted from it."""
        if self.source.network:
            return self.source.capture_time(frame)
        now_mono, now_wall = time.monotonic(), time.time()
        if due is None:  # offline: when it was decoded
            return now_mono, now_wall
        return due, now_wall - (now_mono - due)  # paced: when it was due, even if this thread ran late


class _Pacer:
    """Live files and synthetic streams play in real time: frame k is due at t_start + (pts_k - pts_0).

    t_start is when the first frame was ready. A stream that fell more than a second behind
    (decoding slower than real time) starts again from now: late frames are due when they
    were due (their deadlines tell), but no burst follows to catch up.
    """

    def __init__(self, fps: Optional[float]):
        self.fps = fps
        self.t_start: Optional[float] = None
        self.pts0 = 0.0
        self.k = 0

    def due(self, pts: float) -> float:
        now = time.monotonic()
        if self.t_start is None:
            self.t_start, self.pts0 = now, pts
        # pts going backwards (a broken file): fall back to the frame index
        offset = pts - self.pts0 if pts >= self.pts0 else (self.k / self.fps if self.fps else 0.0)
        self.k += 1
        t = self.t_start + offset
        if t < now - 1.0:
            self.t_start, self.pts0 = now, pts
            t = now
        return t
