"""An engine actor's stop is followed by ray.kill, which skips the process's exit handlers: what multiprocessing
made for the ingest processes' forkserver must go with the stop (pymp-* folders piled up in /tmp, one per engine)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.timeout(60)
def test_a_stopped_engine_actor_leaves_no_multiprocessing_folder():
    code = textwrap.dedent("""
        import multiprocessing.util, os, signal
        from engine.cluster.engine_actor import EngineActor
        folder = multiprocessing.util.get_temp_dir()  # what starting the ingest processes' forkserver makes
        open(os.path.join(folder, "socket-stand-in"), "w").close()
        stopped = []
        actor = EngineActor.__new__(EngineActor)
        actor.engine = type("E", (), {"stop": lambda self, drain: stopped.append(drain)})()
        EngineActor.stop(actor)
        print(stopped, os.path.exists(folder), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # as ray.kill ends it: no exit handler runs
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert r.stdout.strip() == "[False] False", (r.stdout, r.stderr[-2000:])
