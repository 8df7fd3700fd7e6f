"""`make run` keeps up on the machine it runs on (issue 34 item 5): the demo's rate is chosen at start from the
model's measured speed (synthetic fps=auto), said in the start log, and every frame of the demo stream is
published. Runs `vidar run configs/demo.yaml` as `make run` does (ingest processes, the live view, metrics),
on free ports, for PUBLISHED_S seconds of results."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.publish.client import Subscriber
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED_S = 12.0  # ~180 frames at the 15 fps this machine picks; more seconds add test time, not cover

pytestmark = pytest.mark.timeout(240)


def test_the_demo_publishes_every_frame_at_the_rate_it_chose():
    pub = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "engine.cli", "run", str(ROOT / "configs/demo.yaml"), "--set", f"publish.endpoint={pub}",
           "--set", f"control.endpoint=tcp://127.0.0.1:{free_port()}", "--set", "view.port=0",
           "--set", f"metrics.port={free_port()}"]
    sub = Subscriber(pub, ["classify.demo", "event.demo"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    seqs, first = [], None
    try:
        deadline = time.monotonic() + 180  # start: the model is built and its batch sizes are timed
        while time.monotonic() < deadline and (first is None or time.monotonic() - first < PUBLISHED_S):
            msg = sub.recv(1.0)
            if msg is None:
                assert proc.poll() is None, proc.stdout.read()[-3000:]
                continue
            if msg["type"] == "classify":
                first = first or time.monotonic()
                seqs.append(msg["seq"])
    finally:
        sub.close()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    chosen = re.search(r"stream demo: synthetic fps=auto -> .*: (\d+) fps", out)
    assert chosen, out[-3000:]
    fps = int(chosen.group(1))
    # every frame of the window published, in order: no drop of any kind (the status lines say "dropped: none")
    status = [line for line in out.splitlines() if line.startswith("[classify] demo")]
    assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs))), (chosen.group(0), status[:3], seqs[:40])
    assert len(seqs) >= 0.8 * fps * PUBLISHED_S, (len(seqs), fps)
    assert status and all("dropped: none" in line for line in status), "\n".join(status[-5:])
