"""A live network stream on its camera's clock (streams/clock.py), with injected times: the clock's mapping of pts
onto this host's clock, the live edge's skip rule, and a NetworkSource's packets skipped to a fresh keyframe."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from streams.base import DecodedFrame
from streams.clock import MAX_DRIFT, CameraClock, LiveEdge
from streams.pyav import NetworkSource

pytestmark = pytest.mark.timeout(10)

T = 1 / 30  # a frame interval
DRIFT = 500e-6  # the most a camera's clock is followed when it runs slow: streams/clock.py MAX_DRIFT
T0 = 1000.0  # the monotonic time of pts 0, as the first packet's arrival says


def _steady(n, delays):
    """(pts, arrival) of n packets whose sending took `delays[k]` beyond the fastest path."""
    return [(k * T, T0 + k * T + delays[k % len(delays)]) for k in range(n)]


def _burst(n, on_time, held):
    """`on_time` packets arrive as sent, then `held` more wait (a slow reader) and come out together."""
    out = [(k * T, T0 + k * T) for k in range(on_time)]
    at = T0 + (on_time + held - 1) * T + 0.001
    return out + [(k * T, at) for k in range(on_time, on_time + held)]


# name -> (packets as (pts, arrival) or (pts, arrival, dts), expected lag of each packet, expected anchors)
CASES = {
    # jitter above the fastest packet is the only lag: the least delayed packet sets the offset
    "steady": (_steady(8, [0.0, 0.002, 0.0, 0.001]), [0.0, 0.002, 0.0, 0.001] * 2, 1),
    # a slow reader: packets that waited in the socket carry their wait, the newest of the burst ~0
    "late burst": (_burst(10, 5, 5), [0.0] * 5 + [4 * T + 0.001, 3 * T + 0.001, 2 * T + 0.001, T + 0.001, 0.001], 1),
    # a camera clock 300 ppm slow is followed (the offset creeps within MAX_DRIFT): no lag builds up
    "drift within bound": ([(k * 1.0, T0 + k * (1 + 300e-6)) for k in range(61)], [0.0] * 61, 1),
    # 2000 ppm is more than any clock drifts: a lag that grows like that is a backlog, only MAX_DRIFT is absorbed
    "drift beyond bound": ([(k * 1.0, T0 + k * (1 + 2000e-6)) for k in range(61)],
                           [k * (2000e-6 - DRIFT) for k in range(61)], 1),
    # the dts back to 0 (a server's clip looping, a camera's restart): a new anchor, not 5 frames of lag
    "discontinuity backwards": ([(k * T, T0 + k * T, k * T) for k in range(5)]
                                + [(k * T, T0 + (5 + k) * T, k * T) for k in range(3)], [0.0] * 8, 2),
    # without a dts, the pts back by more than B-frames reorder: a new anchor
    "discontinuity backwards, no dts": ([(k * T, T0 + k * T) for k in range(30)]
                                        + [(k * T, T0 + (30 + k) * T) for k in range(3)], [0.0] * 33, 2),
    # a jump forward by far more than the arrival time moved: a new anchor
    "discontinuity forward": ([(k * T, T0 + k * T) for k in range(5)]
                              + [(600 + k * T, T0 + (5 + k) * T) for k in range(3)], [0.0] * 8, 2),
    # B-frames: in decode order the pts goes back by a frame or two; that is no discontinuity, and a B-frame (sent
    # with the P-frame it is shown before, once that one was captured) is older than its arrival, by its pts
    "B-frame reordering": ([(0, T0), (3 * T, T0 + 3 * T), (T, T0 + 3 * T + 0.001), (2 * T, T0 + 3 * T + 0.002),
                            (6 * T, T0 + 6 * T), (4 * T, T0 + 6 * T + 0.001)],
                           [0.0, 0.0, 2 * T + 0.001, T + 0.002, 0.0, 2 * T + 0.001], 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_camera_clock_table(case):
    packets, lags, anchors = CASES[case]
    assert MAX_DRIFT == DRIFT
    clock = CameraClock()
    for (pts, arrival, *dts), lag in zip(packets, lags, strict=True):
        camera = clock.observe(pts, arrival, *dts)
        assert camera <= arrival  # never later than the arrival
        # the offset may creep up by DRIFT of the stream time since the least delayed packet, in these cases at
        # most 5 frame intervals before (the drift cases' expectations include their creep)
        assert arrival - camera == pytest.approx(lag, abs=1e-9 + DRIFT * 5 * T), (case, pts)
    assert clock.anchors == anchors


def test_a_new_session_starts_a_new_anchor():
    """A reconnect: the same pts come again, much later (or the server's pts start anywhere): reset, not lag."""
    clock = CameraClock()
    for pts, arrival in _steady(5, [0.0]):
        clock.observe(pts, arrival)
    clock.reset()
    assert clock.observe(0.0, T0 + 60) == T0 + 60
    assert clock.observe(T, T0 + 60 + T + 0.004) == pytest.approx(T0 + 60 + T)
    assert clock.anchors == 2


# -- the live edge ---------------------------------------------------------------------------------------
def _admit(edge, rows):
    """rows: (lag, keyframe, arrival) -> admitted or not, in order."""
    return [edge.admit(lag, key, at) for lag, key, at in rows]


def test_a_burst_that_drains_at_once_is_decoded_through():
    """A large keyframe took 3 budgets to send and the packets queued behind it came with it: all arrive within
    the hold, the lag falls back, nothing is skipped."""
    edge = LiveEdge(0.1)
    rows = [(0.0, False, 0.0), (0.3, True, 0.3), (0.27, False, 0.301), (0.24, False, 0.302), (0.0, False, 0.4)]
    assert _admit(edge, rows) == [True] * 5
    assert edge.skips == 0


def test_behind_past_the_hold_skips_until_a_keyframe_at_the_live_edge():
    edge = LiveEdge(0.2)  # hold: 0.2 s of packets all behind; resume: a keyframe within 0.1 s
    lag = [0.0, 0.1, 0.25, 0.3, 0.35, 0.41, 0.45, 0.3, 0.05, 0.02, 0.01, 0.0]
    key = [False, False, False, False, False, False, False, True, False, False, True, False]
    at = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.61, 0.62, 0.63, 0.7, 0.73]
    got = _admit(edge, zip(lag, key, at))
    # decoded until behind for 0.2 s (0.2 .. 0.4); skipped: P-frames, and a keyframe still in the backlog
    assert got == [True, True, True, True, False, False, False, False, False, False, True, True]
    assert edge.skips == 1 and not edge.skipping


def test_a_keyframe_slow_to_send_resumes_when_the_packet_before_it_was_at_the_live_edge():
    """A keyframe's own lag includes the time it took to send; the packet before it says the backlog is gone."""
    edge = LiveEdge(0.05, hold_s=0.1)
    assert _admit(edge, [(0.2, False, 0.0), (0.3, False, 0.2)]) == [True, False]
    assert _admit(edge, [(0.01, False, 0.3), (0.09, True, 0.33)]) == [False, True]


def test_skipping_that_never_reaches_the_live_edge_gives_up_after_two_keyframes_and_the_time():
    edge = LiveEdge(0.1, hold_s=0.1, give_up_s=3.0)
    edge.admit(1.0, False, 0.0)
    edge.admit(1.0, False, 0.2)  # skipping from here
    assert edge.skipping and not edge.gave_up(0.2)
    edge.admit(1.0, True, 1.0)
    edge.admit(1.0, True, 2.0)
    assert not edge.gave_up(2.0)  # two late keyframes, but not yet 3 s
    assert edge.gave_up(3.3)


# -- a NetworkSource's packets ---------------------------------------------------------------------------
class _Demuxer:
    """A container whose demux yields the given packets; streams.pyav._now reads the scripted arrivals."""

    def __init__(self, packets):
        self._packets = packets

    def demux(self, stream):
        yield from self._packets

    def close(self):
        pass


def _source(monkeypatch, rows, budget_s=0.2):
    """A live NetworkSource fed `rows` of (pts in frames, keyframe, arrival): what it decodes, what it skipped."""
    tb = Fraction(1, 90000)
    packets = [SimpleNamespace(pts=round(k * T / tb), dts=round(k * T / tb), size=100, is_keyframe=key)
               for k, key, _ in rows]
    times = iter([(at, at + 1.7e9) for _, _, at in rows])
    monkeypatch.setattr("streams.pyav._now", lambda: next(times))
    src = NetworkSource("cam", "tcp://127.0.0.1:9")
    src.live, src.budget_s = True, budget_s
    skipped = []
    src.on_skipped = skipped.append
    src._container, src._stream = _Demuxer(packets), SimpleNamespace(time_base=tb)
    return src, skipped


def _cycle(start, at0, read_every, keyint=10, n=30):
    """Packets of n frames from `start`, keyframe every `keyint`, read every `read_every` s from at0 (a reader
    slower than the camera when read_every > T)."""
    return [(k, k % keyint == 0, at0 + i * read_every) for i, k in enumerate(range(start, start + n))]


def test_a_slow_reader_skips_undecoded_packets_counted_and_resumes_at_a_fresh_keyframe(monkeypatch):
    rows = _cycle(0, T0, read_every=2 * T, n=12)  # a reader at half the camera's rate: lag grows by T a frame
    # it stops decoding; the backlog is read at once (demux only) up to the camera's present, frame 24
    drained = T0 + 24 * T
    rows += [(k, k % 10 == 0, drained + (k - 12) * 0.0005) for k in range(12, 25)]
    rows += [(k, k % 10 == 0, T0 + k * T + 0.003) for k in range(25, 42)]  # then in step with the camera
    src, skipped = _source(monkeypatch, rows)
    decoded = [round(p.pts * float(src._stream.time_base) / T) for p, _ in src._packets()]
    lag_at = {k: (at - T0 - k * T) for k, _, at in rows}
    behind = [k for k in range(12) if lag_at[k] > 0.2]
    first_skipped = next(k for k in range(42) if k not in decoded)
    # decoded while within the budget and through the hold (0.2 s of packets behind it), then skipped
    assert behind and first_skipped > behind[0]
    assert lag_at[first_skipped] > 0.2
    # back at the first keyframe read at the live edge (frame 20 was read from the backlog, 4 intervals late)
    assert decoded == list(range(first_skipped)) + list(range(30, 42))
    assert sum(skipped) == 42 - len(decoded) and set(skipped) == {1}  # every packet not decoded, counted once
    assert src.lag_s == pytest.approx(0.003, abs=MAX_DRIFT * 42 * T)  # the last packet's: at the live edge
    assert not src.fell_behind


def test_frames_carry_their_packets_time_on_the_camera_clock_never_later_than_arrival(monkeypatch):
    rows = [(k, k == 0, T0 + k * T) for k in range(4)] + [(4, False, T0 + 4 * T + 0.15)]  # the last one waited
    src, _ = _source(monkeypatch, rows, budget_s=1.0)
    got = list(src._packets())
    tb = float(src._stream.time_base)
    for packet, (t_mono, t_wall) in got:
        frame = DecodedFrame(np.zeros((2, 2, 3), np.uint8), packet.pts * tb, 0.001, t_mono, t_wall)
        cam_mono, cam_wall = src.capture_time(frame)
        k = round(packet.pts * tb / T)
        assert cam_mono == pytest.approx(T0 + k * T, abs=MAX_DRIFT * T) and cam_mono <= t_mono
        assert t_wall - cam_wall == pytest.approx(t_mono - cam_mono, abs=1e-6)  # the same moment on the wall clock
    # a frame whose pts no packet carried (the first RTSP frame can lack one): its arrival stands
    lone = DecodedFrame(np.zeros((2, 2, 3), np.uint8), 99.0, 0.001, T0 + 5, T0 + 5 + 1.7e9)
    assert src.capture_time(lone) == (T0 + 5, T0 + 5 + 1.7e9)


def test_a_session_that_cannot_get_back_to_the_live_edge_ends_to_reconnect(monkeypatch):
    """Even demuxing alone stays seconds behind (each packet read 2 intervals apart): after two late keyframes
    and 3 s of skipping the session ends, saying why, so that the reconnect drops the backlog."""
    rows = _cycle(0, T0, read_every=2 * T, n=300)
    src, skipped = _source(monkeypatch, rows)
    decoded = list(src._packets())
    assert src.fell_behind and "behind the live edge" in src.session_error
    assert len(decoded) + sum(skipped) < 300  # it stopped reading
    assert sum(skipped) > 0


def test_a_reconnect_is_a_new_anchor(monkeypatch):
    """The new session's pts need not follow the old one's (here they went on by 2 s while the reconnect took 5 s):
    its first packet is at the live edge, not 3 s behind."""
    rows = [(k, k == 0, T0 + k * T) for k in range(10)] + [(60 + k, k == 0, T0 + 5 + k * T) for k in range(10)]
    src, skipped = _source(monkeypatch, rows)
    first, second = src._container._packets[:10], src._container._packets[10:]
    src._container = _Demuxer(first)
    assert len(list(src._packets())) == 10
    src._container = _Demuxer(second)
    assert len(list(src._packets())) == 10 and skipped == []
    assert src.lag_s == pytest.approx(0.0, abs=1e-9)


def test_a_stop_ends_a_skipping_session(monkeypatch):
    """A skipping session yields no frame: the ingest thread's stop (cancel) is seen between skipped packets."""
    rows = _cycle(0, T0, read_every=2 * T, n=300)
    src, skipped = _source(monkeypatch, rows)
    src.on_skipped = lambda n: (skipped.append(n), src.cancel())
    list(src._packets())
    assert skipped == [1] and not src.fell_behind


def test_files_and_offline_network_streams_are_unchanged(monkeypatch):
    rows = _cycle(0, T0, read_every=2 * T, n=40)
    src, skipped = _source(monkeypatch, rows)
    src.live = False  # offline: every frame is wanted, and its arrival is its capture time
    assert len(list(src._packets())) == 40 and skipped == [] and src.lag_s is None
