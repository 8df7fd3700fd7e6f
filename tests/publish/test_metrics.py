"""The Prometheus endpoint serves the same numbers as the accounting (and the status line)."""

import sys
import urllib.request

import pytest

from engine.core.engine import Engine
from engine.control.runtime import StatusPrinter
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.engines import engine_config
from tests.support.net import free_port


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_endpoint_matches_accounting(endpoint):
    port = free_port()
    cfg = engine_config([{"id": "m1", "url": "synthetic://shapes?size=96x64&fps=30&frames=30", "mode": "offline"}],
                        endpoint, metrics={"enabled": True, "port": port})
    eng = Engine(cfg, models={"classify": NoopRunner(per_frame_s=0.002)})
    eng.start()
    wait_for(eng.finished, 30)
    m = scrape(port)
    s = eng.pools["classify"].acct.snapshot("m1")
    lines = StatusPrinter(eng).lines()
    eng.stop()
    assert m['vidar_frames_ingested_total{pool="classify",stream="m1"}'] == s.ingested == 30
    assert m['vidar_frames_published_total{pool="classify",stream="m1"}'] == s.published == 30
    assert m['vidar_frames_in_flight{pool="classify",stream="m1"}'] == 0
    for stage in ("decode", "queue_wait", "batch_wait", "inference"):
        assert m[f'vidar_stage_seconds_count{{pool="classify",stage="{stage}"}}'] == 30
    assert m['vidar_stage_seconds_count{pool="all",stage="publish"}'] == 30
    assert "30/30 frames" in lines[0]
    if sys.platform.startswith("linux"):  # prometheus_client's process collector reads /proc
        assert m["process_resident_memory_bytes"] > 10 * 2 ** 20
        assert m["process_open_fds"] > 0


def test_malloc_gauges_follow_the_heap(endpoint):
    """vidar_malloc_bytes{state=in_use} follows allocations; free and mmapped are served too."""
    from engine.util.memory import heap_bytes
    if heap_bytes() is None:
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    port = free_port()
    cfg = engine_config([{"id": "m1", "url": "synthetic://shapes?size=96x64&fps=30&frames=3", "mode": "offline"}],
                        endpoint, metrics={"enabled": True, "port": port})
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    try:
        before = scrape(port)
        held = [bytearray(1000) for _ in range(20000)]  # ~20 MB in small blocks: from the arenas, not mmap
        after = scrape(port)
        del held
    finally:
        eng.stop()
    key = 'vidar_malloc_bytes{state="%s"}'
    assert after[key % "in_use"] - before[key % "in_use"] > 15 * 2 ** 20, (before, after)
    assert before[key % "free"] >= 0 and before[key % "mmapped"] >= 0
