"""An engine freezes what its start-up built out of Python's cyclic collector (engine/util/gc_pause.py): a full
collection in a running engine walks only what was made since, instead of every object torch, timm and the
pools left (70-130 ms with the GIL held, measured in a 48-stream engine). Process-wide state, so each case runs in
a fresh interpreter and never depends on what earlier tests left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import gc, json, socket, time
from engine.config import build_config
from engine.core.engine import Engine
from engine.models.noop import NoopRunner
from engine.util import gc_pause
import torch, timm  # what a real engine process holds: the collector's work without the freeze

def full_collection_ms():
    t = time.perf_counter(); gc.collect(); return (time.perf_counter() - t) * 1e3

def engine():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    cfg, _ = build_config({"streams": [{"id": "a", "url": "synthetic://shapes?size=64x48&fps=30", "mode": "live"}],
                           "publish": {"endpoint": f"tcp://127.0.0.1:{port}"}, "metrics": {"enabled": False},
                           "control": {"enabled": False}, "ingest": {"processes": 0}}, cuda_available=False)
    return Engine(cfg, models={"classify": NoopRunner()})

out = {"before": gc.get_freeze_count()}
a, b = engine(), engine()
a.start(); b.start()
out["frozen"] = gc.get_freeze_count()
out["running_ms"] = min(full_collection_ms() for _ in range(3))
a.stop()
out["one_stopped"] = gc.get_freeze_count()
b.stop()
out["stopped"] = gc.get_freeze_count()
out["stopped_ms"] = min(full_collection_ms() for _ in range(3))
out["engines"] = gc_pause.engines()
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_running_engine_keeps_start_up_objects_out_of_full_collections():
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["before"] == 0 and out["frozen"] > 10_000  # torch, timm and two engines' pools, frozen
    assert out["one_stopped"] > 10_000  # the other engine still runs: nothing given back yet
    assert out["stopped"] == 0 and out["engines"] == 0  # the last one to stop unfroze
    # the same objects, the same process: a full collection costs a fraction of what it does unfrozen
    assert out["running_ms"] * 5 < out["stopped_ms"], out
