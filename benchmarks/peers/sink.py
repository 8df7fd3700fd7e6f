"""What every system's sink shares: a tally of the frames it was handed, a frame's age by the camera's clock, and
the line protocol the driver (benchmarks/bench_peers.py) speaks with it.

Standard library only: the three sinks run in three interpreters (vidar's subscriber in vidar's venv, the peers
in .venv-peers) and each imports this file from its own folder (sys.path[0]).

Protocol: the sink writes `BENCH {json}` lines on stdout (the prefix keeps them apart from what a peer library
prints there itself): `{"event": "started"}` once the system is built, `{"event": "allseen"}` once every stream
delivered a frame. It reads commands on stdin: `mark` -> a `mark` report; `stop` -> a `final` report, then the
sink shuts its system down and exits.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Callable, Hashable, Optional

PREFIX = "BENCH "


def emit(obj: dict[str, Any]) -> None:
    """One protocol line (stdout is shared with the peers' own prints: the prefix marks ours)."""
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def pct(sorted_values: list[float], q: float) -> Optional[float]:
    """The q-th percentile of sorted values (nearest rank), None for none."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q / 100))]


class Tally:
    """Distinct frames per stream, frames that were not newer than the last one (never expected), the newest
    frame number seen (the intake where a system numbers every frame it takes off the network), and latencies
    since the last report. Thread-safe: a peer's sink callback and the command thread both touch it."""

    def __init__(self, streams: list[Hashable]) -> None:
        self.streams = list(streams)
        self.count = {s: 0 for s in self.streams}
        self.last_id: dict[Hashable, int] = {}
        self.not_newer = 0
        self.lat_ms: list[float] = []
        self.age_ms: list[float] = []
        self.extra: dict[str, Any] = {}
        self.allseen_sent = False
        self._lock = threading.Lock()

    def add(self, stream: Hashable, frame_id: Optional[int], lat_ms: Optional[float] = None,
            age_ms: Optional[float] = None) -> None:
        """A frame handed to the sink. `frame_id` None: the system numbers nothing (counted as distinct)."""
        with self._lock:
            if frame_id is not None:
                if frame_id <= self.last_id.get(stream, -1):
                    self.not_newer += 1
                    return
                self.last_id[stream] = frame_id
            self.count[stream] = self.count.get(stream, 0) + 1
            if lat_ms is not None:
                self.lat_ms.append(lat_ms)
            if age_ms is not None:
                self.age_ms.append(age_ms)
            all_seen = not self.allseen_sent and all(self.count.get(s) for s in self.streams)
            self.allseen_sent |= all_seen
        if all_seen:
            emit({"event": "allseen", "t": time.time()})

    def report(self) -> dict[str, Any]:
        """Counts so far; latency percentiles of the frames since the previous report (so a mark-to-mark window
        holds only its own frames)."""
        with self._lock:
            lat, self.lat_ms = sorted(self.lat_ms), []
            age, self.age_ms = sorted(self.age_ms), []
            out = {"t": time.time(), "count": {str(k): v for k, v in self.count.items()},
                   "last_id": {str(k): v for k, v in self.last_id.items()}, "not_newer": self.not_newer,
                   "extra": dict(self.extra)}
        out.update(lat_n=len(lat), lat_p50_ms=pct(lat, 50), lat_p99_ms=pct(lat, 99),
                   lat_max_ms=lat[-1] if lat else None, age_p50_ms=pct(age, 50), age_p99_ms=pct(age, 99))
        return out


class CameraClock:
    """A frame's age by the camera's clock (the RTSP server's), estimated from its pts where the frame carries no
    send time: the server sends its clip in real time from the session's start, so the frame with pts p left it
    at start + p, and age = receive - start - p. `start` is anchored on the stream's freshest frame so far (the
    smallest receive - pts): of all of them it waited least in the socket (not at all if the reader kept up at
    any moment), so its receive - pts is start plus its latency inside the system, taken from its own stamp. A reader
    that keeps up has age ~ latency; one that falls behind the live edge, its backlog queued in the socket before
    the system stamps anything, has age grow with the backlog. The anchor is the minimum so far: a frame before
    the freshest one is dated against a later start (its age under-, never over-estimated). pts going back (a
    new session: the clip starts again) or new_session starts a new anchor."""

    def __init__(self) -> None:
        self._anchor: dict[Hashable, tuple[float, float]] = {}  # stream -> (receive - pts, that frame's latency)
        self._last_pts: dict[Hashable, float] = {}

    def new_session(self, stream: Hashable) -> None:
        self._anchor.pop(stream, None)
        self._last_pts.pop(stream, None)

    def age(self, stream: Hashable, pts: float, latency_s: float, now: float) -> float:
        """The age in s of a frame of `stream` with `pts` (s), received at `now` (s) with `latency_s` by the
        system's own stamp."""
        if pts < self._last_pts.get(stream, pts):
            self._anchor.pop(stream, None)
        self._last_pts[stream] = pts
        offset = now - pts
        anchor = self._anchor.get(stream)
        if anchor is None or offset < anchor[0]:
            anchor = self._anchor[stream] = (offset, latency_s)
        return offset - anchor[0] + anchor[1]


def serve_commands(tally: Tally, on_stop: Callable[[], None]) -> threading.Thread:
    """Answer `mark` and `stop` from stdin on a thread of its own; `on_stop` runs after the final report (also
    when stdin closes: the driver died, so the sink must not outlive it)."""

    def loop() -> None:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "mark":
                emit({"event": "mark", **tally.report()})
            elif cmd == "stop":
                emit({"event": "final", **tally.report()})
                break
        on_stop()

    th = threading.Thread(target=loop, name="bench-commands", daemon=True)
    th.start()
    return th
