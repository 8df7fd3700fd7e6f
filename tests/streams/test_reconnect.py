"""G1/G2: dead, hung and refused RTSP streams come back on their own, without disturbing the others.
A real GStreamer RTSP server on 127.0.0.1, and tests/support/tcp_proxy.py in front of it for network faults."""

import logging
import subprocess
import threading
import time

import psutil
import pytest

from engine.core.engine import Engine
from engine.models.noop import NoopRunner
from engine.testing.clips import write_clip
from engine.testing.wait import wait_for
from tests.support.engines import engine_config
from tests.support.net import free_port
from tests.support.rtsp import SERVER, SYSTEM_PY, require_server
from tests.support.tcp_proxy import FaultProxy

pytestmark = pytest.mark.rtsp


def start_server(port):
    p = subprocess.Popen([SYSTEM_PY, str(SERVER), "--port", str(port), "--pattern", "--fps", "15",
                          "--size", "160x120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    assert line.startswith("READY"), line
    return p


@pytest.fixture
def server():
    require_server()
    port = free_port()
    procs = [start_server(port)]
    yield port, procs
    for p in procs:
        p.terminate()
        p.wait(5)


def engine_with(url_or_urls, endpoint, **source):
    streams = [{"id": "cam", "url": url_or_urls, "mode": "live"},
               {"id": "other", "url": "synthetic://shapes?size=64x64&fps=30", "mode": "live"}]
    cfg = engine_config(streams, endpoint, budget={"latency_ms": 1000},
                        source={"open_timeout_s": 2, "stall_timeout_s": 2, **source})
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    return eng


def published(eng, sid):
    return eng.pools["classify"].acct.snapshot(sid).published


def test_server_killed_and_restarted(server, endpoint):
    """The server down for 4 s under a backoff from 0.25 s capped at 2 s: refused attempts, then the pause under
    way at the restart, as with the defaults (0.5 s, a 30 s cap) after ~30 s of outage, in a few seconds (the
    backoff's shape itself: test_port_closed_backs_off_to_the_cap_quietly)."""
    port, procs = server
    cap, down_s = 2.0, 4.0
    eng = engine_with(f"rtsp://user:hunter2@127.0.0.1:{port}/test", endpoint, reconnect_initial_s=0.25,
                      reconnect_max_s=cap)
    ingest = eng.streams["cam"].ingest
    try:
        assert wait_for(lambda: published(eng, "cam") > 10, 15)
        procs[0].kill()
        procs[0].wait(5)
        t_kill = time.monotonic()
        assert wait_for(lambda: ingest.state == "reconnecting", 2 + 1)  # stall_timeout_s + 1 s
        detected = time.monotonic() - t_kill
        other_before, t_other = published(eng, "other"), time.monotonic()
        time.sleep(max(0.0, down_s - (time.monotonic() - t_kill)))
        refused = len(ingest.attempts) - 1  # the attempts since the session ended (the first one: at the start)
        procs.append(start_server(port))
        t_back = time.monotonic()
        seen = published(eng, "cam")
        # the pause under way (<= cap), then the server's first session (it builds its pipeline): ~1-4 s here
        assert wait_for(lambda: published(eng, "cam") > seen + 5, cap + 6)
        resumed = time.monotonic() - t_back
        assert refused >= 2, list(ingest.attempts)  # the outage spanned attempts that failed
        assert ingest.reconnects == 1
        # ~30 fps all along: at least 60 % of that over the outage (a margin for a loaded machine)
        assert published(eng, "other") - other_before > 18 * (time.monotonic() - t_other)
        gaps = [b - a for a, b in zip(ingest.attempts, list(ingest.attempts)[1:])]
        assert gaps and max(gaps) <= cap * 1.2 + 2
    finally:
        eng.stop()
    print(f"server killed: detected after {detected:.2f} s, resumed {resumed:.2f} s after the restart")
    for text in [str(eng.describe()), str(eng.stream_counters())]:
        assert "hunter2" not in text


def test_blackhole_mid_stream_and_at_connect(server, endpoint):
    port, _ = server
    with FaultProxy("127.0.0.1", port).start() as proxy:
        eng = engine_with(f"rtsp://127.0.0.1:{proxy.port}/test", endpoint, reconnect_initial_s=0.5,
                          reconnect_max_s=2)
        ingest = eng.streams["cam"].ingest
        try:
            assert wait_for(lambda: published(eng, "cam") > 10, 15)
            threads = threading.active_count()
            proxy.set_mode("blackhole")  # the server hangs: no byte either way, no error
            t0 = time.monotonic()
            assert wait_for(lambda: ingest.state == "reconnecting", 2 * 2 + 2)
            stalled_after = time.monotonic() - t0
            n0 = len(ingest.attempts)
            time.sleep(8)  # connects into the black hole time out (open_timeout_s), paced by the backoff
            attempts = list(ingest.attempts)[n0:]
            assert 2 <= len(attempts) <= 5
            proxy.set_mode("pass")
            seen = published(eng, "cam")
            assert wait_for(lambda: published(eng, "cam") > seen + 5, 2 + 2 + 2 + 3)
            assert threading.active_count() <= threads + 1  # no reader thread left stuck behind
        finally:
            eng.stop()
    assert stalled_after >= 1.5 and stalled_after <= 5.5


def test_port_closed_backs_off_to_the_cap_quietly(endpoint, caplog):
    """Connection refused for 6 s, from 0.125 s with the cap at 2 s (the defaults, 0.5 s and a 30 s cap, show
    the same shape over ~90 s: 0.5, 1, 2, ... capped; 6 s reach the cap twice and keep `make test` short)."""
    port = free_port()  # nothing listens: connection refused all along
    cap, window = 2.0, 6.0
    cfg = engine_config([{"id": "cam", "url": f"rtsp://admin:s3cret@127.0.0.1:{port}/x", "mode": "live"}], endpoint,
                        source={"reconnect_initial_s": 0.125, "reconnect_max_s": cap})
    eng = Engine(cfg, models={"classify": NoopRunner()})
    proc = psutil.Process()
    with caplog.at_level(logging.INFO):
        eng.start()
        ingest = eng.streams["cam"].ingest
        cpu0 = sum(proc.cpu_times()[:2])
        time.sleep(window)
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        eng.stop()
    gaps = [b - a for a, b in zip(ingest.attempts, list(ingest.attempts)[1:])]
    assert gaps[0] < 1.0  # the first retry within 1 s
    pauses = list(ingest.backoff)
    assert cap * 0.8 <= max(pauses) <= cap * 1.2  # the backoff reached the cap (with jitter)
    assert all(b >= a * 1.3 or b >= cap * 0.8 for a, b in zip(pauses, pauses[1:]))  # exponential until the cap
    assert all(g <= p + 0.5 for g, p in zip(gaps, pauses))  # attempts follow the schedule
    assert len(ingest.attempts) <= 8  # 0, 0.125, 0.375, 0.875, 1.875, 3.875, 5.875 s (jitter: up to 20 % sooner)
    assert cpu < 0.1 * window  # idle while waiting
    lines = [r for r in caplog.records if "cam" in r.getMessage() and "connect" in r.getMessage()]
    assert len(lines) <= 2  # aggregated (one line per 30 s): not a line per attempt
    assert "s3cret" not in caplog.text


@pytest.mark.timeout(60)
def test_server_that_ends_every_session_at_once_is_retried_with_growing_pauses(tmp_path, endpoint, caplog):
    """Accepts, plays two frames, hangs up: backs off like a refusal (it used to be retried every ~0.5 s)."""
    require_server()
    clip = write_clip(tmp_path / "two.mp4", 2)
    port = free_port()
    server = subprocess.Popen([SYSTEM_PY, str(SERVER), "--port", str(port), "--file", str(clip)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert server.stdout.readline().startswith("READY")
    initial, cap = 0.2, 3.2
    with caplog.at_level(logging.INFO):
        eng = engine_with(f"rtsp://127.0.0.1:{port}/test", endpoint, reconnect_initial_s=initial, reconnect_max_s=cap)
        ingest = eng.streams["cam"].ingest
        try:
            assert wait_for(lambda: len(ingest.attempts) >= 7, 40), list(ingest.attempts)
        finally:
            eng.stop()
            server.terminate()
            server.wait(5)
    attempts = list(ingest.attempts)
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert ingest.reconnects >= 6  # every attempt connected: these are ended sessions, not refusals
    # the pauses double (0.2, 0.4, ... 3.2): gaps (open + session + pause) grow by at least half of that
    assert gaps[4] - gaps[0] >= 0.5 * (2 ** 4 - 1) * initial, [round(g, 2) for g in gaps]
    pauses = list(ingest.backoff)
    assert all(p <= cap for p in pauses) and max(pauses) >= 0.8 * cap
    assert all(b >= 1.6 * a or b >= 0.8 * cap for a, b in zip(pauses, pauses[1:]))
    assert all(p <= g for p, g in zip(pauses, gaps))  # attempts follow the schedule
    lines = [r for r in caplog.records if "stream cam:" in r.getMessage()]
    assert len(lines) <= 2, [r.getMessage() for r in lines]  # aggregated, not a line per session
    print(f"gaps between attempts: {[round(g, 2) for g in gaps]}; pauses {[round(p, 2) for p in pauses]}")
