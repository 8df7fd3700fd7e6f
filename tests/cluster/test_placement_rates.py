"""The rate a stream is costed at when it is placed (engine/cluster/rates.py), without Ray: a file's
container rate, a network stream's estimate until the engine's reports have measured it, then the
measurement; and which refusals wait (pending) rather than fail (placement.fits_idle).

Issue 21: six live 5 fps files were costed at the 30 fps estimate (6x their load) and half refused.
"""

import logging
import threading

import pytest

from engine.cluster.placement import EngineLoad, choose, fits_idle
from engine.cluster.rates import CONTAINER, ESTIMATE, URL, IngestRates, cost_fps, declared_fps
from engine.testing.clips import write_clip

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def clip5(tmp_path_factory):
    return write_clip(tmp_path_factory.mktemp("rates") / "five.mp4", 10, size=(160, 120), fps=5)


def test_a_file_is_costed_at_its_container_rate_a_network_url_at_the_estimate(clip5, tmp_path, caplog):
    assert declared_fps(str(clip5), 30) == (5.0, CONTAINER)
    assert declared_fps(f"file://{clip5}", 30) == (5.0, CONTAINER)
    assert declared_fps("synthetic://shapes?size=96x64&fps=12", 30) == (12.0, URL)
    assert declared_fps("rtsp://cam/stream?fps=12", 30) == (30, ESTIMATE)  # a camera's query is not its rate
    assert declared_fps("http://cam/video.mp4", 30) == (30, ESTIMATE)     # never opened by the controller
    with caplog.at_level(logging.WARNING, logger="vidar.cluster"):
        assert declared_fps(str(tmp_path / "absent.mp4"), 30) == (30, ESTIMATE)
    assert "absent.mp4: cannot read its frame rate on the head" in caplog.text and "stream_fps=30" in caplog.text
    assert declared_fps(str(clip5), 30, probe=False) == (30, ESTIMATE)  # no I/O asked for


def test_a_probe_that_hangs_falls_back_to_the_estimate_without_waiting_for_it(clip5, monkeypatch, caplog):
    """A file on a file system that hangs: the caller gets the estimate after `probe_s`, while the probe
    is still blocked (released only afterwards), so no request waits for the file system."""
    import av
    release, entered = threading.Event(), threading.Event()

    def hang(*a, **k):
        entered.set()
        release.wait()
        raise OSError("released")
    monkeypatch.setattr(av, "open", hang)
    try:
        with caplog.at_level(logging.WARNING, logger="vidar.cluster"):
            got = declared_fps(str(clip5), 30, probe_s=0.2)
        assert entered.is_set() and not release.is_set()
    finally:
        release.set()
    assert got == (30, ESTIMATE) and "no answer within 0.2 s" in caplog.text


def _report(t, state="running", **ingested):
    return {"t": t, "streams": {s: {"state": state, "counts": {"noop": {"ingested": n}, "other": {"ingested": n // 2}}}
                                for s, n in ingested.items()}}


def test_a_network_stream_is_costed_at_the_estimate_until_measured_then_at_its_measurement():
    """Successive reports give each stream's ingest rate; it replaces the estimate only (a container's
    rate is exact). Opening is not measured (no frames yet), nor time spent not running; a stream that
    starts again on another engine keeps its last rate until the new window has spanned min_span_s."""
    rates = IngestRates(min_span_s=2.0, window_s=10.0)
    estimate, container = (30.0, ESTIMATE), (5.0, CONTAINER)
    rates.update("a", _report(0.0, cam=0, clip=0), now=0)
    rates.update("a", _report(0.5, cam=4, clip=2), now=0)    # first frames: the window starts here
    rates.update("a", _report(2.0, cam=22, clip=10), now=0)
    assert rates.fps == {} and cost_fps(estimate, rates.fps.get("cam")) == 30  # 1.5 s: not yet measured
    rates.update("a", _report(2.5, cam=28, clip=12), now=0)
    assert rates.fps["cam"] == pytest.approx(12.0) and rates.fps["clip"] == pytest.approx(5.0)
    assert cost_fps(estimate, rates.fps["cam"]) == pytest.approx(12.0)
    assert cost_fps(container, 4.0) == 5.0  # measured or not, a container's rate is kept
    rates.update("a", _report(2.5, cam=99), now=0)  # the same report time again: ignored
    assert rates.fps["cam"] == pytest.approx(12.0)
    rates.update("a", _report(3.0, state="reconnecting", cam=30), now=0)
    rates.update("b", _report(10.0, cam=3), now=0)   # moved: counts from 0 on engine b
    rates.update("b", _report(11.0, cam=9), now=0)
    assert rates.fps["cam"] == pytest.approx(12.0)  # the old rate until the new window is long enough
    rates.update("b", _report(12.0, cam=15), now=0)
    assert rates.fps["cam"] == pytest.approx(6.0)
    for t in range(13, 30):                          # the source slows to 2 fps: followed within window_s
        rates.update("b", _report(float(t), cam=15 + 2 * (t - 12)), now=0)
    assert rates.fps["cam"] == pytest.approx(2.0)
    rates.update("b", {"streams": {"cam": {"state": "running", "counts": {"noop": {"ingested": 53}}}}}, now=31.0)
    assert rates.fps["cam"] == pytest.approx(2.0)  # a report without `t` (an older engine): the controller's clock
    rates.forget("cam")
    assert "cam" not in rates.fps


def _e(name, busy, frame_s=0.05, labels=None, draining=False):
    return EngineLoad(name, "node-" + name, labels or {}, {"noop": busy}, {"noop": 0.0}, {"noop": frame_s},
                      draining=draining)


def test_the_rate_decides_the_placement():
    """Two engines at 0.5 of 0.9, 50 ms a frame: a 5 fps file fits (0.25); costed at the 30 fps estimate
    it would need 1.5 of an idle engine and is refused (not pending: it could never fit)."""
    engines = [_e("a", 0.5), _e("b", 0.5)]
    got, why = choose(engines, stream="f", pools=["noop"], fps=5.0, max_load=0.9, fps_from=CONTAINER)
    assert got is not None and why == ""
    got, why = choose(engines, stream="f", pools=["noop"], fps=30.0, max_load=0.9, fps_from=ESTIMATE)
    assert got is None and "(30 fps (estimate) into ['noop'])" in why and "0.50 + 1.50 = 2.00 > 0.9" in why
    assert not fits_idle(engines, pools=["noop"], fps=30.0, max_load=0.9)


@pytest.mark.parametrize("engines, fps, pin, fits", [
    ([_e("a", 0.8), _e("b", 0.85)], 10, None, True),        # full now, would fit idle: waits for room
    ([_e("a", 0.0)], 20, None, False),                       # 1.0 of an idle engine: never fits
    ([_e("a", 0.0, frame_s=0.01), _e("b", 0.0)], 20, None, True),  # a faster engine could take it
    ([], 10, None, True),                                    # no engine yet: one may come
    ([_e("a", 0.0, draining=True)], 20, None, True),         # none may take it now: may change
    ([_e("a", 0.0, labels={"zone": "x"}), _e("b", 0.0, frame_s=0.01)], 20, "zone=x", False),  # b lacks the label
])
def test_which_refusals_wait(engines, fps, pin, fits):
    assert fits_idle(engines, pools=["noop"], fps=fps, max_load=0.9, pin=pin) is fits


def test_the_controller_costs_a_stream_at_its_declared_rate_else_the_estimate_until_measured():
    """The controller's choice (Controller._fps, what placement and relocation use), without Ray: the rate
    kept when the stream was added, replaced by the reports' measurement only where it was the estimate."""
    from engine.cluster.controller import Controller
    from engine.config import ClusterConfig
    ctl = object.__new__(Controller)
    ctl.cc, ctl.rates = ClusterConfig(stream_fps=30), IngestRates(min_span_s=2.0, window_s=10.0)
    ctl.state = {"rates": {"clip": [5.0, CONTAINER], "cam": [30.0, ESTIMATE]}}
    clip, cam = {"url": "/videos/five.mp4"}, {"url": "rtsp://cam.local/s1"}
    assert ctl._fps("clip", clip) == (5.0, CONTAINER) and ctl._fps("cam", cam) == (30.0, ESTIMATE)
    for t, n in ((0.0, 1), (1.0, 13), (2.0, 25)):
        ctl.rates.update("a", _report(t, cam=n, clip=n), now=0)
    assert ctl._fps("cam", cam) == (pytest.approx(12.0), "measured")
    assert ctl._fps("clip", clip) == (5.0, CONTAINER)  # the file's own rate stays
    assert ctl._fps("old", {"url": "synthetic://shapes?fps=7"}) == (7.0, URL)  # state from before rates were kept


@pytest.mark.timeout(30)
def test_a_named_pipe_is_never_opened_and_a_synthetic_rate_is_read_as_the_engine_reads_it(tmp_path):
    """Opening a FIFO with no writer blocks for ever: the head does not open it (a thread a request).
    `fps=1e3` and a repeated `fps=` are read by the engine's own parser, not a regex."""
    import os
    import time

    from engine.cluster.rates import declared_fps
    fifo = tmp_path / "live.pipe"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    assert declared_fps(str(fifo), 30, probe_s=20) == (30, "estimate")
    assert time.monotonic() - t0 < 5  # not the probe's timeout: it was never opened
    assert declared_fps("synthetic://shapes?fps=1e3", 30) == (1000.0, "url")
    assert declared_fps("synthetic://shapes?fps=5&fps=1000", 30) == (1000.0, "url")
    assert declared_fps("synthetic://shapes?fps=1.2.3", 30) == (30, "estimate")


def test_a_stream_an_engine_refuses_is_retried_with_backoff_not_every_heartbeat(monkeypatch):
    """An engine that refuses a stream (not for room: its own error) costs a call of up to 20 s under the
    controller's lock: the stream is tried again with growing pauses, capped, and at every beat once
    placed. Without Ray: _start_on is replaced by a fake engine."""
    from engine.cluster import controller as ctl_module
    from engine.cluster.controller import Controller, _NotPlaced
    from engine.config import ClusterConfig
    ctl = object.__new__(Controller)
    ctl.cc = ClusterConfig(heartbeat_s=0.5)
    ctl.state = {"streams": {"cam": {"id": "cam", "url": "rtsp://cam/s"}}, "assign": {}}
    ctl.engines, ctl.starting, ctl.moving = {}, {}, {}
    ctl.unplaced, ctl.unplaced_since, ctl.refused_backoff = {}, {}, {}
    ctl._event = lambda *a: None
    now = [1000.0]
    monkeypatch.setattr(ctl_module.time, "monotonic", lambda: now[0])
    tries = []
    ctl._start_on = lambda sid, scfg, **kw: tries.append(now[0]) or _NotPlaced("engine e0 refused it", False)
    for _ in range(400):  # 200 s of heartbeats
        ctl._place_unassigned()
        now[0] += 0.5
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[0] == 1.0 and gaps == sorted(gaps) and max(gaps) == ctl_module.REFUSED_MAX_S, gaps
    assert len(tries) < 20  # not 400
    ctl._start_on = lambda sid, scfg, **kw: tries.append(now[0]) or None  # the engine takes it now
    now[0] += ctl_module.REFUSED_MAX_S
    ctl._place_unassigned()
    assert "cam" not in ctl.refused_backoff and "cam" not in ctl.unplaced
