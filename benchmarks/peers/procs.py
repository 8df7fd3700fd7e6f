"""Processes of benchmarks/bench_peers.py: a sink speaking the line protocol of sink.py, and ending a process
this benchmark started, by its pid (and, when it will not end, the processes below it, by theirs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any, Optional

PREFIX = "BENCH "  # sink.PREFIX (sink.py runs in other interpreters, so it is not imported here)


class Child:
    """A process whose stdout carries `BENCH {json}` lines among whatever else it prints (kept in its log);
    commands go to its stdin."""

    def __init__(self, argv: list[str], log_path: Path, env: Optional[dict[str, str]] = None,
                 cwd: Optional[Path] = None) -> None:
        self.log: IO[str] = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, cwd=cwd)
        self.events: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, name=f"read-{self.proc.pid}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith(PREFIX):
                self.log.write("[stdout] " + line)
                continue
            try:
                event = json.loads(line[len(PREFIX):])
            except ValueError:  # a cut line (the sink died mid-write): kept in the log, the reader goes on
                self.log.write("[bad protocol line] " + line)
                continue
            with self._cv:
                self.events.append(event)
                self._cv.notify_all()
        with self._cv:  # EOF: the process is gone, wake whoever waits
            self._cv.notify_all()

    def wait_event(self, name: str, timeout_s: float, after: int = 0) -> Optional[dict[str, Any]]:
        """The first event `name` beyond the first `after` events; None after `timeout_s` or if it exited."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while True:
                got = next((e for e in self.events[after:] if e.get("event") == name), None)
                left = end - time.monotonic()
                if got is not None or left <= 0 or self.proc.poll() is not None:
                    return got
                self._cv.wait(min(left, 0.5))

    def command(self, cmd: str, reply: str, timeout_s: float = 30.0) -> Optional[dict[str, Any]]:
        """Send `cmd`, wait for its `reply` event."""
        with self._cv:
            n = len(self.events)
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self.wait_event(reply, timeout_s, after=n)

    def close(self, timeout_s: float = 30.0) -> Any:
        """End it: stdin closed (a sink stops by itself on EOF, so it exits 0 when it can), then by signals if it
        has not within `timeout_s`; its exit code."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = stop(self.proc, signal.SIGTERM, 10)
        self.log.close()
        return rc


def stop(proc: subprocess.Popen, sig: int, timeout_s: float) -> Any:
    """Wait up to `timeout_s` for `proc` (our child) to exit after `sig`; then SIGKILL it and every process
    below it, each by its pid. The exit code, or 'killed'."""
    if proc.poll() is not None:
        return proc.returncode
    try:
        os.kill(proc.pid, sig)
        return proc.wait(timeout_s)
    except ProcessLookupError:
        return proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    import psutil

    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        below = []
    for p in [proc, *below]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)
    return "killed"
