"""RTSP against a real server: Debian's GStreamer RTSP server on 127.0.0.1 (tests/support/rtsp_server.py).

`make test` installs the server's packages (scripts/install-rtsp-deps.sh) and sets
VIDAR_REQUIRE_RTSP=1, so there these tests fail rather than skip when the server is missing.
"""

import subprocess

import pytest

from engine.core.engine import Engine
from engine.models.noop import NoopRunner
from engine.testing.clips import write_clip
from engine.testing.wait import wait_for
from tests.support.collector import Collector
from tests.support.engines import engine_config
from tests.support.net import free_port
from tests.support.rtsp import SERVER, SYSTEM_PY, require_server

pytestmark = pytest.mark.rtsp


@pytest.fixture
def rtsp_server():
    require_server()
    procs = []

    def start(*args):
        port = free_port()
        p = subprocess.Popen([SYSTEM_PY, str(SERVER), "--port", str(port), *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        procs.append(p)
        line = p.stdout.readline().strip()
        assert line.startswith("READY "), f"server did not start: {line} {p.stderr.read() if p.poll() else ''}"
        return line.split()[1]

    yield start
    for p in procs:
        p.terminate()
        p.wait(5)


def test_rtsp_stream_yields_results(rtsp_server, endpoint):
    url = rtsp_server("--pattern", "--fps", "30", "--size", "320x240")
    cfg = engine_config([{"id": "cam1", "url": url, "mode": "live"}], endpoint,
                        budget={"latency_ms": 500}, publish={"min_subscribers": 1})
    col = Collector(endpoint, ["cam1"])
    eng = Engine(cfg)  # the real test_vit classifier
    eng.start()
    wait_for(lambda: eng.pools["classify"].acct.snapshot("cam1").published >= 20, 20, 0.1)
    eng.stop()
    col._t.join(2)
    col.sub.close()
    results = [m for m in col.msgs if m["type"] == "classify"]
    events = [m["kind"] for m in col.msgs if m["type"] == "event"]
    assert len(results) >= 20, eng.pools["classify"].acct.snapshot("cam1")
    assert events[0] == "started" and events[-1] == "eos"
    assert all(r["stream"] == "cam1" and len(r["topk"]) == 5 for r in results)
    seqs = [r["seq"] for r in results]
    assert seqs == sorted(seqs)


def test_rtsp_server_gone_is_a_disconnect_not_an_eos(rtsp_server, tmp_path, endpoint):
    """When the server's stream ends, PyAV's loop ends as at EOF: vidar reconnects instead of ending."""
    # plays the clip once per client (3 s), then ends the session; live, the first ~1 s goes to
    # FFmpeg's probe at open and is dropped (fflags=nobuffer, streams/pyav.py): ~2 s of frames a session
    clip = write_clip(tmp_path / "c.mp4", 90)
    url = rtsp_server("--file", str(clip))
    cfg = engine_config([{"id": "cam1", "url": url, "mode": "live"}], endpoint,
                        budget={"latency_ms": 500}, source={"reconnect_initial_s": 0.2})
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    ingest = eng.streams["cam1"].ingest
    wait_for(lambda: ingest.reconnects >= 2, 15, 0.1)
    published = eng.pools["classify"].acct.snapshot("cam1").published
    eng.stop()
    assert ingest.reconnects >= 2
    assert published >= 40  # frames from at least two sessions, seq continuing across them
