"""engine.util.memory: the malloc arena cap takes effect (alone and through Engine.start), each check
paired with the same run uncapped so it can fail.

Each case runs in a fresh subprocess: glibc reads its arena cap once per process, so the pytest
process (many threads already) cannot tell anything.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.util.memory import _LIBC, heap_bytes, heap_stats

ROOT = Path(__file__).resolve().parents[2]
glibc = pytest.mark.skipif(_LIBC is None, reason="needs glibc's malloc")

# 12 threads alive at once, each allocating frame-sized and small blocks, like decoder threads
THREADS = """
import threading
import numpy as np
gate = threading.Barrier(12)
def work():
    gate.wait()
    for _ in range(20):
        frame = np.ones((240, 320, 3), np.uint8); small = [bytes(100) for _ in range(50)]
    gate.wait()
threads = [threading.Thread(target=work) for _ in range(12)]
[t.start() for t in threads]; [t.join() for t in threads]
"""

ALONE = """
import json, sys
from engine.util.memory import arena_count, limit_malloc_arenas
applied = limit_malloc_arenas(int(sys.argv[1]))
""" + THREADS + """
print(json.dumps({"applied": applied, "arenas": arena_count()}))
"""

# the wiring: a config's malloc_arenas reaches glibc through Engine.start, before the engine's threads
THROUGH_ENGINE = """
import json, sys
from engine.config import build_config
from engine.core.engine import Engine
from engine.util.memory import arena_count
from engine.models.noop import NoopRunner
import socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
cfg, _ = build_config({"streams": [{"id": "a", "url": "synthetic://shapes?size=64x48&fps=30&frames=5",
                                    "mode": "offline"}],
                       "publish": {"endpoint": f"tcp://127.0.0.1:{port}"}, "metrics": {"enabled": False},
                       "control": {"enabled": False}, "malloc_arenas": int(sys.argv[1])}, cuda_available=True)
eng = Engine(cfg, models={"classify": NoopRunner()})
eng.start()
""" + THREADS + """
n = arena_count()
eng.stop()
print(json.dumps({"arenas": n}))
"""


def child(code: str, n: int, **env_extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", code, str(n)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@glibc
@pytest.mark.timeout(120)
def test_arena_cap_bounds_arenas_and_default_does_not():
    capped, default = child(ALONE, 2), child(ALONE, 0)
    assert capped == {"applied": 2, "arenas": 2}
    assert default["applied"] is None and default["arenas"] > 2, default  # same threads, more arenas


@glibc
@pytest.mark.timeout(120)
def test_engine_applies_the_configured_cap():
    capped, default = child(THROUGH_ENGINE, 2), child(THROUGH_ENGINE, 0)
    assert capped["arenas"] <= 2, capped
    assert default["arenas"] > 2, default


@glibc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", [{"MALLOC_ARENA_MAX": "3"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=3"}])
def test_environment_wins(env):
    r = child(ALONE, 2, **env)
    assert r["applied"] == 3 and r["arenas"] == 3, r


@glibc
@pytest.mark.timeout(60)
def test_invalid_environment_value_does_not_disable_the_cap():
    r = child(ALONE, 2, MALLOC_ARENA_MAX="")
    assert r == {"applied": 2, "arenas": 2}


@pytest.mark.skipif(heap_bytes() is None, reason="needs glibc >= 2.33 (mallinfo2)")
def test_heap_stats_move_with_allocations():
    before = heap_stats()
    held = [bytearray(1000) for _ in range(20000)]  # ~20 MB in small blocks: from the arenas, not mmap
    during = heap_stats()
    del held
    assert before["arenas"] >= 1
    assert during["used_mb"] - before["used_mb"] > 15, (before, during)
    # (no check on mmap_mb: a large block comes from an arena's free space when there is enough,
    # whatever the mmap threshold, so where it lands depends on what ran before in this process)
