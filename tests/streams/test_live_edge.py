"""Honest capture time under ingest overload: a live network stream's frames carry their age on the camera's clock,
and a stream whose ingest cannot keep up skips to the live edge, every frame it skips counted.

The end-to-end test runs the product's path (an ingest process, MPEG-TS over TCP through PyAV) against a camera
whose frames carry the time they were sent (tests/support/ts_server.py), with a decoder at half the camera's
rate (tests/support/slow_decoder.py): by the camera's own clock, no published frame is older than its budget.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.frames.ingest import IngestThread
from engine.frames.lifecycle import DropReason
from engine.ingest import procs as ingest_procs
from engine.testing.wait import wait_for
from streams.base import DecodedFrame, Source
from streams.clock import MAX_DRIFT, LiveEdge
from tests.support.collector import Collector
from tests.support.ingest import balanced, ingest_engine, results_of, stop_engine
from tests.support.live_camera import start_camera


class _Skipping(Source):
    """A live network source that skips `skips[k]` frames (as NetworkSource does, through on_skipped) before
    handing over frame k."""

    network = True

    def __init__(self, skips):
        super().__init__("cam", "tcp://127.0.0.1:9")
        self.read_timeout_s, self._skips, self._used = 1.0, skips, False

    def open(self):
        pass

    def frames(self):
        if self._used:
            return
        self._used = True
        now, wall = time.monotonic(), time.time()
        for k, n in enumerate(self._skips):
            if n:
                self.on_skipped(n)
            yield DecodedFrame(np.zeros((4, 4, 3), np.uint8), k / 30, 0.001, now, wall)

    @property
    def lag_s(self):
        return 0.25


class _Ring:
    def __init__(self):
        self.seqs, self.dropped, self.wrote = [], [], threading.Event()

    def drop_at_source(self, n, reason):
        self.dropped.append((n, reason))

    def write(self, meta, rgb, stop=None, ready=None):
        self.seqs.append(meta.seq)
        self.wrote.set()
        return True

    def close(self):
        pass


@pytest.mark.timeout(10)
def test_frames_a_source_skipped_are_deadline_drops_and_seq_moves_on_by_as_many():
    """Nothing lost uncounted: every skipped frame is a `deadline` drop at the source, and seq counts it, so
    seq == written + dropped; the source's budget and lag pass through the ingest thread."""
    ring, src = _Ring(), _Skipping([0, 0, 5, 0, 3, 0])
    ingest = IngestThread(src, ring, live=True, loop=False, budget_s=0.5, emit=lambda *a: None, reconnect_initial_s=5)
    assert src.budget_s == 0.5 and ingest.lag_s == 0.25
    ingest.start()
    assert wait_for(lambda: len(ring.seqs) == 6, 5)
    ingest.stop()
    assert ingest.join(5)
    assert ring.dropped == [(5, DropReason.DEADLINE), (3, DropReason.DEADLINE)]
    assert ring.seqs == [0, 1, 7, 8, 12, 13] and ingest.skipped == 8
    offline = IngestThread(_Skipping([0]), _Ring(), live=False, loop=False, budget_s=0.5, emit=lambda *a: None)
    assert offline.source.budget_s is None and offline.lag_s is None  # offline: no budget, no lag


@pytest.mark.timeout(60)
def test_under_an_ingest_that_cannot_keep_up_no_published_frame_is_older_than_its_budget_by_the_cameras_clock(
        tmp_path, endpoint, monkeypatch):
    budget_s, fps, keyint = 0.2, 30, 15
    cam = start_camera(tmp_path, fps=fps, keyint=keyint)
    monkeypatch.setattr(ingest_procs, "TEST_IMPORTS", ["tests.support.slow_decoder"])
    sid = "slowdec-cam"
    col = Collector(endpoint, [sid])
    eng = ingest_engine([{"id": sid, "url": cam.url, "mode": "live"}], endpoint,
                        budget={"latency_ms": budget_s * 1e3}, ingest={"processes": 1})
    lags, gauges = [], []
    try:
        eng.start()
        assert wait_for(lambda: eng.pools["classify"].acct.snapshot(sid).published > 0, 20), "no frame published"
        t_first = time.monotonic()
        t_end = t_first + 4.0  # a few skip cycles: each is about a GOP (0.5 s) of decoding and one of skipping
        while time.monotonic() < t_end:
            lags.append(eng.describe()[sid]["lag_s"])
            gauges.append(eng.metrics.registry.get_sample_value("vidar_stream_lag_seconds", {"stream": sid}))
            time.sleep(0.05)
        snap = eng.pools["classify"].acct.snapshot(sid)
    finally:
        try:
            stop_engine(eng)
        finally:
            cam.stop()
    msgs = col.wait(10)
    results = results_of(msgs, sid)
    # about 4 a second: a GOP resumes at the live edge and the lag grows by a frame interval a frame decoded, so
    # the first 4-5 frames of each are within the budget; the rest are dropped, then skipped
    assert len(results) >= 5, len(results)

    # A frame's age by the camera's clock: published at t_capture + latency; sent at t0 + pts (the camera's
    # stamp). The engine's t_capture is the camera time it mapped the frame to: t0 + pts + e, where e is what no
    # clock at the receiver can see, the delay of the least delayed packet it anchored on (the TS demuxer and
    # the H.264 parser each hold a frame until the next one starts: about 2 frame intervals). e is measured on
    # the first published frame; after it, the clock's offset only falls, or creeps by at most MAX_DRIFT of the
    # stream time. Before the camera clock, e was each frame's wait in the socket: growing by 0.5 s a second here.
    first = results[0]
    e0 = first["t_capture"] - (cam.t0_wall + first["pts"])
    assert 0 <= e0 + 0.002 and e0 <= 3 / fps, f"anchored on a late packet: {e0 * 1e3:.1f} ms"  # (wall/monotonic: 2 ms)
    for r in results:
        age = r["t_capture"] + r["latency_ms"] / 1e3 - (cam.t0_wall + r["pts"])
        slack = e0 + MAX_DRIFT * (r["pts"] - first["pts"]) + 0.002  # the two clocks read beside each other: 2 ms
        assert age <= budget_s + slack, (f"seq {r['seq']} published {age * 1e3:.0f} ms after the camera sent it "
                                         f"(budget {budget_s * 1e3:.0f} ms + {slack * 1e3:.1f} ms)")

    # the frames it could not decode in time were dropped as `deadline` at the source, counted, and the ledger
    # balances: every seq was published, dropped or failed
    dropped = snap.dropped.get("deadline", 0)
    assert dropped > len(results) / 2, snap
    final = eng.pools["classify"].acct.snapshot(sid)
    assert final.ingested == final.published + sum(final.dropped.values()) + sum(final.failed.values()), final
    assert max(r["seq"] for r in results) < final.ingested
    balanced(eng)

    # it kept delivering: skipping brought it back to the live edge, again and again (without the skip, every
    # frame after the first fraction of a second would be past its deadline)
    t_capture_first = first["t_capture"]
    late = [r for r in results if r["t_capture"] - t_capture_first > 2.0]
    assert late, "nothing published in the run's last 2 s: the stream never got back to the live edge"

    # the lag behind the live edge was reported (list, the metric), and stayed bounded: it goes past the budget for
    # the hold before the stream skips, then back to the live edge
    seen = [x for x in lags if x is not None]
    assert seen and [g for g in gauges if g is not None], (lags, gauges)
    assert max(seen) > budget_s / 2, seen
    hold = LiveEdge(budget_s).hold_s
    assert max(seen) < 4 * (budget_s + hold), seen
