"""A stream's frame rate for placement: what its cost is multiplied by (placement.cost).

Three sources, best first: what the URL declares (synthetic://...&fps=N); a file's container rate
(a live file is paced at exactly that rate, so it is its real load); else `cluster.stream_fps`, an
estimate, which the engine's reports replace once they have measured the stream (`IngestRates`:
frames ingested between successive reports). Assuming 30 fps for every URL without `fps=` costed a
5 fps file at 6x its load and refused half of six such streams (issue 21).

`declared_fps` does I/O (it opens the file): the controller calls it once per stream, when it is
added and outside its lock, never in its heartbeat loop; the rest is pure.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from streams import redact_url
from streams.urls import file_path, url_scheme

log = logging.getLogger("vidar.cluster")

PROBE_S = 2.0  # the longest a file's probe may take (a hung network filesystem): then the estimate
ESTIMATE, URL, CONTAINER = "estimate", "url", "container"  # where a declared rate came from


def declared_fps(url: str, estimate: float, *, probe: bool = True, probe_s: float = PROBE_S) -> tuple[float, str]:
    """(fps, where it came from): the URL's `fps=` (synthetic), a file's container rate, else the
    estimate (network streams, and files that cannot be probed here within `probe_s`: logged).
    `probe=False`: no I/O (files get the estimate, silently)."""
    scheme = url_scheme(url)
    if scheme == "synthetic":  # the engine's own parser: `fps=1e3` and `fps=5&fps=1000` read as it reads them
        from streams.synthetic import SyntheticSource
        try:
            return SyntheticSource("rate", url).fps, URL
        except Exception:  # refused by the engine when added: nothing to cost
            return estimate, ESTIMATE
    if scheme != "file" or not probe:
        return estimate, ESTIMATE
    path = file_path(url)
    fps, why = _probe(path, probe_s)
    if fps is None:
        log.warning("%s: cannot read its frame rate on the head (%s): costed at the estimate cluster.stream_fps="
                    "%g until its engine measures it", redact_url(url), why, estimate)
        return estimate, ESTIMATE
    return fps, CONTAINER


def _probe(path: str, timeout_s: float) -> tuple[Optional[float], str]:
    """The container's average (else guessed) rate of the first video stream, read on a daemon thread
    so that a file system that hangs costs the caller `timeout_s`, not a hung request (the thread is
    left to finish on its own). (None, why) when it cannot be read."""
    out: dict = {}

    def read() -> None:
        try:
            import av
            if not stat.S_ISREG(os.stat(path).st_mode):  # a named pipe or a device: opening it could block
                out["why"] = "not a regular file"
                return
            with av.open("file:" + os.path.abspath(path)) as c:  # a path, never read as a protocol
                v = c.streams.video[0]
                rate = v.average_rate or v.guessed_rate
                out["fps"] = float(rate) if rate else None
                out["why"] = "" if rate else "the container gives no frame rate"
        except Exception as err:  # missing on this node, not a video, no video stream...
            out["why"] = f"{type(err).__name__}: {str(err)[:200]}"

    t = threading.Thread(target=read, name="vidar-probe", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return None, f"no answer within {timeout_s:g} s"
    fps = out.get("fps")
    return (fps if fps and fps > 0 else None), out.get("why", "")


def cost_fps(declared: tuple[float, str], measured: Optional[float]) -> float:
    """The rate a stream is costed at: its measured ingest rate where the declared one is only the
    estimate; a declared rate (URL, container) is exact and kept."""
    fps, origin = declared
    return measured if origin == ESTIMATE and measured is not None else fps


@dataclass
class _Window:
    engine: str
    samples: deque = field(default_factory=deque)  # (engine time s, frames ingested)


class IngestRates:
    """Each stream's measured ingest rate (frames a second its decoder delivered) from successive
    engine reports (`EngineActor.report`: per stream and pool `ingested`, the report's time `t`).

    Measured only while the stream runs and has taken frames (its opening is not its rate), over at
    least `min_span_s` (a few heartbeats: a 0.5 s interval holds 2-3 frames of a 5 fps stream) and at
    most `window_s`, so a source that changes its rate is followed. A stream that stops running, or
    starts again on another engine, starts a new window; its last rate stays until the new one has
    spanned `min_span_s`. Under a CPU-starved decoder the rate reads low: it is what the stream ingests.
    """

    def __init__(self, *, min_span_s: float, window_s: float):
        if not 0 < min_span_s <= window_s:
            raise ValueError(f"need 0 < min_span_s <= window_s, got {min_span_s}, {window_s}")
        self.min_span_s, self.window_s = min_span_s, window_s
        self.fps: dict[str, float] = {}
        self._win: dict[str, _Window] = {}

    def update(self, engine: str, report: dict, now: float) -> None:
        t = report.get("t", now)
        for sid, s in report.get("streams", {}).items():
            n = max((c.get("ingested", 0) for c in s.get("counts", {}).values()), default=0)
            win = self._win.get(sid)
            if s.get("state") != "running" or n == 0:
                self._win.pop(sid, None)
                continue
            if win is not None and win.engine == engine and t <= win.samples[-1][0]:
                continue  # the same report again
            if win is None or win.engine != engine or n < win.samples[-1][1]:  # a new incarnation
                self._win[sid] = _Window(engine, deque([(t, n)]))
                continue
            win.samples.append((t, n))
            while len(win.samples) > 2 and t - win.samples[1][0] >= self.window_s:
                win.samples.popleft()
            t0, n0 = win.samples[0]
            if t - t0 >= self.min_span_s:
                self.fps[sid] = (n - n0) / (t - t0)

    def forget(self, sid: str) -> None:
        self.fps.pop(sid, None)
        self._win.pop(sid, None)
