"""The live MPEG-TS camera of tests/support/ts_server.py (frames whose pts is the time they were sent), started in
its own process and ended by its handle. A decoder too slow for it: tests/support/slow_decoder.py."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.testing.clips import write_clip

SERVER = Path(__file__).resolve().parent / "ts_server.py"


@dataclass
class Camera:
    proc: subprocess.Popen
    port: int
    t0_mono: float   # frame pts p was sent at t0 + p (monotonic, system-wide)
    t0_wall: float   # the same moment on the wall clock
    fps: float
    keyint: int

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Ended by its handle: stdin closed (it exits by itself), killed if it has not within 5 s."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_camera(tmp: Path, *, fps: int = 30, keyint: int = 15, gops: int = 4, size=(64, 48)) -> Camera:
    """A camera serving a tiny clip of `gops` GOPs of `keyint` frames (H.264, no B-frames), looping."""
    clip = write_clip(tmp / "camera.h264", gops * keyint, size=size, fps=fps, gop=keyint, fmt="h264")
    proc = subprocess.Popen([sys.executable, str(SERVER), str(clip), str(fps), str(keyint)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port, t0_mono, t0_wall = proc.stdout.readline().split()
    except ValueError:
        proc.kill()
        proc.wait(5)
        raise RuntimeError("the test camera did not start") from None
    return Camera(proc, int(port), float(t0_mono), float(t0_wall), fps, keyint)
