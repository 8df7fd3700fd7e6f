"""G7: SIGTERM/SIGINT drain within shutdown_timeout_s, one eos per stream, exit 0; nothing left behind.
SIGKILL leaves no orphan processes (the ingest processes exit when the engine dies)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from engine.publish.client import Subscriber
from tests.support.net import free_port

VIDAR = [sys.executable, "-m", "engine.cli", "run"]


def start_engine(tmp_path, streams=3, **sections):
    port = free_port()
    cfg = {"streams": [{"id": f"c{i}", "url": "synthetic://shapes?size=320x240&fps=30"} for i in range(streams)],
           "models": {"classify": {"name": "test_vit", "weights": "random", "max_batch": 4}},
           "budget": {"latency_ms": 300}, "shutdown_timeout_s": 5,
           "publish": {"endpoint": f"tcp://127.0.0.1:{port}"}, "metrics": {"enabled": False}, "view": {"port": 0},
           "control": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}, **sections}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sub = Subscriber(f"tcp://127.0.0.1:{port}", ["classify.", "event."])
    proc = subprocess.Popen(VIDAR + [str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = 0
    t_end = time.monotonic() + 60
    while results < 30 and time.monotonic() < t_end:  # under load: results flowing on every stream
        m = sub.recv(1)
        results += bool(m and m["type"] == "classify")
    assert results >= 30, proc.stderr.read() if proc.poll() is not None else "no results"
    return proc, sub


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_and_exits_zero(tmp_path, sig):
    shm_before = set(os.listdir("/dev/shm"))
    proc, sub = start_engine(tmp_path)
    t0 = time.monotonic()
    proc.send_signal(sig)
    eos = []
    while len(eos) < 3 and time.monotonic() - t0 < 10:
        m = sub.recv(1)
        if m and m["type"] == "event" and m["kind"] == "eos":
            eos.append(m["stream"])
    rc = proc.wait(15)
    took = time.monotonic() - t0
    sub.close()
    assert rc == 0, proc.stderr.read()
    assert took < 5 + 2  # shutdown_timeout_s plus process exit
    assert sorted(eos) == ["c0", "c1", "c2"]
    # nothing of this engine left in /dev/shm; another engine's ingest segments (vidar-<run>-<stream>-<n>, streams
    # not named c0..c2), such as a test run beside this one, are not this test's
    left = {n for n in set(os.listdir("/dev/shm")) - shm_before
            if not (n.startswith("vidar-") and n.split("-")[2:3] not in (["c0"], ["c1"], ["c2"]))}
    assert left == set(), left


def test_sigkill_leaves_no_orphans(tmp_path):
    """SIGKILL of the engine: its ingest processes (ingest.processes auto) and multiprocessing's forkserver and
    resource tracker end by themselves (each watches its parent): nothing is orphaned, and the shared-memory
    segments of its slots are not left in /dev/shm (the ingest processes remove their names)."""
    shm_before = set(os.listdir("/dev/shm"))
    proc, sub = start_engine(tmp_path, streams=2, ingest={"processes": "auto"})
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "no ingest process: the engine's streams should decode in processes"
    finally:
        proc.kill()
        proc.wait(10)
        sub.close()
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert alive == [], f"orphans left by a SIGKILLed engine: {alive}"
    assert not [p for p in psutil.process_iter(["ppid"]) if p.info["ppid"] == proc.pid]
    left = [n for n in set(os.listdir("/dev/shm")) - shm_before
            if n.startswith("vidar-") and n.split("-")[2:3] in (["c0"], ["c1"])]
    assert left == [], f"segments a SIGKILLed engine left in /dev/shm: {left}"