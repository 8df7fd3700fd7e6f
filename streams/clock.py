"""A live network stream on its camera's clock: each frame's real age, and the skip to the live edge.

Why: a packet's arrival (when it came out of the demuxer) is when the ingest read it, not when the camera sent
it. An ingest that cannot keep up leaves packets in the kernel's socket buffer, and a frame stamped at its
arrival looks fresh however long it waited there (measured at 48 RTSP cameras on 2 cores: 30 s behind the live
edge per minute while `latency_ms` said 40 ms). The camera's own clock, the pts its packets carry, does not
move with the reader: mapped onto this host's monotonic clock it says when each frame was sent.

CameraClock maps a session's pts (seconds) to the monotonic clock with offset = min over the session of
(arrival - pts): a packet can arrive late, never early, so the least delayed packet seen fixes the offset (its
own network and sender delay is not known, so ages are never over-stated). Clocks drift, so the offset may
creep up by at most `drift` (500 ppm) of the stream time since that packet: a camera whose clock runs slow is
followed, a backlog (which raises arrival - pts by far more) is not. A discontinuity (the dts going back at all,
or without a dts the pts going back by more than B-frame reordering can; or a jump forward by far more than the
arrival time moved) re-anchors; so does a new session (a reconnect). The pts, not the dts, is mapped: a B-frame
is sent after the frame it is shown before, so it is older than its arrival says, and its pts says by how much.
Capture time = pts mapped, never later than the arrival. Lag behind the live edge = arrival - camera time of the
packet just read: how long it waited before the ingest took it.

Not RTCP sender reports: PyAV does not expose them. It exposes `InputContainer.start_time_realtime`, FFmpeg's
wall time of pts 0 computed once from the session's first sender report (RTSP only, and only once a report has
come): a wall time on the camera's clock, which only matches this host's to within a budget (milliseconds)
when both are NTP-disciplined to that accuracy, and never updated afterwards (no drift). The min-offset needs
neither: only that the camera's clock advances at about the rate of ours.

LiveEdge: decoding is the cost, demuxing is cheap. A stream whose packets have stayed behind by more than the
budget for a while (`hold_s`: a burst that drains at once, a large keyframe, is decoded through) stops decoding
and discards packets, each one a frame lost (counted by the caller as a `deadline` drop at the source), until a
keyframe comes with the lag back under `resume` (half the budget): decoding resumes from that keyframe. Skipping
that does not reach the live edge within a couple of keyframes and `give_up_s` means the demuxer itself cannot
keep up, or the clock is wrong (a pts jump too small to see): the session is ended, and the reconnect drops the
whole socket backlog at once and starts a new anchor.

Pure: times are passed in, so tests drive them with a table of cases (tests/streams/test_clock.py).
"""

from __future__ import annotations

import math
from typing import Optional

#: how much slower than this host's a camera's clock may run and still be followed (of stream time): crystal
#: oscillators are within +-100 ppm; 500 leaves margin, and hides at most 30 ms a minute of a growing backlog.
#: A clock that runs fast needs nothing: its arrival - pts falls, and the offset follows the minimum down.
MAX_DRIFT = 500e-6
#: without a dts, a pts that goes back by more than this from the highest seen is a discontinuity, not B-frame
#: reordering (H.264 reorders at most 16 frames: 0.53 s at 30 fps; cameras use 0-2). A smaller jump back is
#: taken for lag: skipping then cannot reach the live edge, and LiveEdge's give-up reconnects (a new anchor).
REORDER_S = 0.6
#: a pts that jumps forward by this much more than the arrival time moved is a discontinuity
JUMP_S = 5.0


class CameraClock:
    """One session's pts (seconds) -> this host's monotonic clock. `observe` each packet in demux order."""

    def __init__(self, *, drift: float = MAX_DRIFT, reorder_s: float = REORDER_S, jump_s: float = JUMP_S):
        self.drift, self.reorder_s, self.jump_s = drift, reorder_s, jump_s
        self.anchors = 0  # how many times the clock was (re-)anchored: 1 for a session without discontinuity
        self.reset()

    def reset(self) -> None:
        """A new session (a reconnect): its pts start from wherever the server starts them."""
        self._offset: Optional[float] = None  # the lowest arrival - pts seen since the anchor
        self._pts_at = 0.0                    # the pts at which that lowest was seen (drift counts from it)
        self._max_pts = -math.inf
        self._last_pts = self._last_arrival = 0.0
        self._last_dts: Optional[float] = None

    def observe(self, pts_s: float, arrival: float, dts_s: Optional[float] = None) -> float:
        """A packet of pts `pts_s` (and dts `dts_s`, when the demuxer has one) came out of the demuxer at `arrival`
        (monotonic): its camera time, <= arrival."""
        if self._offset is None or self._discontinuity(pts_s, arrival, dts_s):
            self._anchor(pts_s, arrival, dts_s)
            return arrival
        allowed = self._offset + self.drift * max(0.0, pts_s - self._pts_at)
        seen = arrival - pts_s
        self._last_pts, self._last_arrival, self._last_dts = pts_s, arrival, dts_s
        if pts_s > self._max_pts:
            self._max_pts = pts_s
        if seen <= allowed:  # the least delayed packet so far (drift included): the offset follows it
            self._offset, self._pts_at = seen, pts_s
            return arrival
        return pts_s + allowed  # it arrived late by seen - allowed

    def _discontinuity(self, pts_s: float, arrival: float, dts_s: Optional[float]) -> bool:
        last_dts = self._last_dts
        if dts_s is not None and last_dts is not None:  # decode order: the dts never goes back in one timeline
            return dts_s < last_dts or (dts_s - last_dts) - (arrival - self._last_arrival) > self.jump_s
        if pts_s < self._max_pts - self.reorder_s:
            return True
        return (pts_s - self._last_pts) - (arrival - self._last_arrival) > self.jump_s

    def _anchor(self, pts_s: float, arrival: float, dts_s: Optional[float]) -> None:
        self.anchors += 1
        self._offset, self._pts_at = arrival - pts_s, pts_s
        self._max_pts = self._last_pts = pts_s
        self._last_arrival, self._last_dts = arrival, dts_s

    def camera_time(self, pts_s: float) -> Optional[float]:
        """`pts_s` on this host's monotonic clock by the current offset (None before the first packet)."""
        return None if self._offset is None else pts_s + self._offset


class LiveEdge:
    """Whether to decode a live stream's next packet, from its lag behind the camera (see the module docstring).

    `admit` each packet with data in demux order: False means discard it (a frame lost, for the caller to count).
    `gave_up` says skipping has not reached the live edge for long enough that the session should end.
    """

    def __init__(self, budget_s: float, *, resume: float = 0.5, hold_s: Optional[float] = None,
                 give_up_s: float = 3.0, give_up_keyframes: int = 2):
        self.budget_s = budget_s
        self.resume_s = budget_s * resume
        # behind for this long (arrival time) before skipping: a burst that arrives together (a keyframe that took
        # a while to send, the packets queued behind it) is drained by the next read and is not a backlog
        self.hold_s = max(budget_s, 0.1) if hold_s is None else hold_s
        self.give_up_s, self.give_up_keyframes = give_up_s, give_up_keyframes
        self.skipping = False
        self.skips = 0  # times it started skipping (a run of discarded packets each)
        self._behind_since: Optional[float] = None  # arrival of the first packet of the current run behind budget
        self._skip_since = 0.0
        self._late_keyframes = 0  # keyframes passed while skipping (each too late to resume at)
        self._prev_lag = math.inf

    def admit(self, lag_s: float, keyframe: bool, arrival: float) -> bool:
        prev, self._prev_lag = self._prev_lag, lag_s
        if self.skipping:
            # at a keyframe, the packet before it shows whether the backlog is drained: a keyframe's own lag
            # includes the time it took to send (large at high resolutions), which skipping cannot shorten
            if keyframe and min(lag_s, prev) <= self.resume_s:
                self.skipping, self._behind_since = False, None
                return True
            self._late_keyframes += keyframe
            return False
        if lag_s <= self.budget_s:
            self._behind_since = None
            return True
        if self._behind_since is None:
            self._behind_since = arrival
        if arrival - self._behind_since < self.hold_s:
            return True  # decoded; the frame is dropped as `deadline` if it is past its budget when ready
        self.skipping, self.skips = True, self.skips + 1
        self._skip_since, self._late_keyframes = arrival, 0
        return False

    def gave_up(self, arrival: float) -> bool:
        """Skipping for `give_up_s` and through `give_up_keyframes` keyframes without reaching the live edge."""
        return (self.skipping and self._late_keyframes >= self.give_up_keyframes
                and arrival - self._skip_since >= self.give_up_s)


class LiveSession:
    """One session of a live network source on its camera's clock: each demuxed packet goes through `packet`
    (feeding the clock and the live edge), each decoded frame's capture time comes from `capture`."""

    #: packets whose frame has not come out yet: bounded as streams.pyav._Arrivals is
    LIMIT = 64

    def __init__(self, budget_s: Optional[float], time_base: float, clock: Optional[CameraClock] = None):
        self.clock = clock or CameraClock()
        self.edge = LiveEdge(budget_s) if budget_s else None
        self.time_base = time_base
        self.lag_s: Optional[float] = None   # the last packet's: arrival - camera time, seconds
        self.skipped = 0                     # packets (frames) discarded since this connection opened
        self._camera: dict[float, float] = {}  # pts (seconds, as frames carry it) -> camera time (monotonic)

    def packet(self, pts: Optional[int], keyframe: bool, arrival: float, dts: Optional[int] = None) -> bool:
        """A packet with data came out of the demuxer at `arrival`: True to decode it, False to discard it."""
        if pts is None or not self.time_base:  # no camera time: the arrival stands (as before this clock)
            return True
        pts_s = pts * self.time_base  # as streams.pyav.frame_pts computes a frame's pts: the same float
        camera = self.clock.observe(pts_s, arrival, None if dts is None else dts * self.time_base)
        lag = arrival - camera
        self.lag_s = lag
        if self.edge is not None and not self.edge.admit(lag, keyframe, arrival):
            self.skipped += 1
            return False
        cams = self._camera
        cams[pts_s] = camera
        if len(cams) > self.LIMIT:
            del cams[next(iter(cams))]  # the oldest: a packet whose frame never came out
        return True

    def capture(self, pts_s: float, arrival: float, arrival_wall: float) -> tuple[float, float]:
        """A decoded frame's capture time (monotonic, wall): its packet's camera time, never later than its
        arrival; the arrival when its pts is not one a packet carried (a frame without a pts)."""
        camera = self._camera.pop(pts_s, None)
        if camera is None or camera >= arrival:
            return arrival, arrival_wall
        return camera, arrival_wall - (arrival - camera)

    def gave_up(self, arrival: float) -> bool:
        return self.edge is not None and self.edge.gave_up(arrival)
