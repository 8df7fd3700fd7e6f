"""Ingest process handles, death and hang detection, and the restart policy (pure: no sockets here).

Death is seen by the process's exit (its sentinel, polled by the client's I/O thread), explained by its
signal or exit code; a process whose heartbeat stopped for `hang_after_s` (stuck in FFmpeg, SIGSTOPped) is
killed (SIGKILL) and then handled as dead, with "hung" as the reason (Frigate's watchdog: "stuck" is not
"dead", so heartbeats, not just sentinels). vLLM's MPClient watches sentinels the same way.

Policy (Frigate restarts a capture at most 5 times a minute, then gives up silently; vidar escalates): each
death counts against every stream the process held. A stream with more than `max_restarts` deaths within
`restart_window_s` is moved to a process of its own (quarantine: its neighbours stop dying with it); a
quarantined stream that again exceeds it fails alone, with the reason.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional


def exit_reason(exitcode: Optional[int]) -> str:
    """'killed by SIGKILL' / 'exit code 3' / 'still running'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


@dataclass(eq=False)
class IngestProcess:
    """One ingest process: index, generation (restarts of that index), handle, the streams it owns."""
    idx: int
    gen: int
    handle: Any                      # multiprocessing Process
    cmd: Any                         # the core's PUSH socket, connected to the process's command endpoint
    up: Any                          # the core's end of its uplink (uplink.Reader): what it sends
    dedicated: bool = False          # holds one quarantined stream
    streams: set = field(default_factory=set)
    cuda: bool = False  # it said it made a CUDA context (Heartbeat.cuda: an NVDEC stream opened there), held for life
    pid: Optional[int] = None        # as its Ready message says
    os_pid: Optional[int] = None     # its handle's, taken at start: the handle may be closed before Ready came
    ready: bool = False
    started_at: float = field(default_factory=time.monotonic)
    last_beat: float = field(default_factory=time.monotonic)
    kill_reason: str = ""            # why the core killed it (hung), when it did
    pending: list = field(default_factory=list)  # commands queued until it is Ready
    pidfd: Optional[int] = None      # the process itself (pidfd_open): readable once it has exited
    bad_commands: int = 0            # commands it could not decode or apply (its heartbeat says)

    # Whether it is alive is asked of the process itself, through a pidfd, never of multiprocessing's handle: the
    # handle learns of an exit from the forkserver (its status pipe), and a killed forkserver reads there as
    # "exit code 255" for every process it started while they run on (and the handle's kill() is then a no-op).
    # A pidfd also names this process only, never a later one that reused its pid.
    def open_pidfd(self) -> None:
        """Its pidfd, when one can be had (retried by the caller while None: out of descriptors, say)."""
        if self.pidfd is not None:
            return
        try:
            fd = os.pidfd_open(self.handle.pid)
        except (OSError, AttributeError):  # it exited already (ESRCH), no descriptor left, or no pidfd here
            return
        if self.handle.exitcode is not None:  # it exited before the open: the pid may name another process now
            os.close(fd)
            return
        self.pidfd = fd

    def _exited(self, timeout_s: float) -> bool:
        # poll, not select: select refuses descriptors of 1024 and above, which an engine with many cameras and
        # clients (vidar run raises the descriptor limit) reaches
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        return bool(p.poll(max(0, int(timeout_s * 1000))))

    def alive(self) -> bool:
        if self.pidfd is None:
            return self.handle.is_alive()
        return not self._exited(0)

    def wait(self, timeout: float) -> bool:
        """Until it has exited or `timeout` s passed; whether it has exited."""
        if self.pidfd is None:
            self.handle.join(timeout)
            return not self.handle.is_alive()
        return self._exited(timeout)

    def kill(self) -> None:
        if self.pidfd is None:
            self.handle.kill()
            return
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:  # exited already
            pass

    def exit_reason(self) -> str:
        """Why it ended: the core's kill reason, or its signal or exit code (as the forkserver reported it)."""
        if self.kill_reason:
            return self.kill_reason
        self.handle.join(0.1)  # the forkserver's report of its status may trail its exit by a moment
        code = self.handle.exitcode
        if code == 255:  # what multiprocessing reads when the forkserver's status pipe broke
            return "exit code 255, or an exit whose status was lost with the forkserver that started it"
        return exit_reason(code)

    def forget(self) -> None:
        """Its pidfd closed (it has exited and been handled). Taken before it is closed: never closed twice."""
        fd, self.pidfd = self.pidfd, None
        if fd is not None:
            os.close(fd)

    @property
    def label(self) -> str:
        # never asked of the handle: a process that died before its Ready is reaped (its handle closed, which
        # makes `handle.pid` raise) before its streams are told why, in a log line that names it
        return f"ingest-{self.idx} (pid {self.pid or self.os_pid})"

    def hung(self, now: float, hang_after_s: float, start_timeout_s: float) -> Optional[str]:
        """Why this process counts as hung now, or None."""
        if not self.ready:
            if now - self.started_at > start_timeout_s:
                return f"not ready within ingest.start_timeout_s={start_timeout_s:g} s"
            return None
        if now - self.last_beat > hang_after_s:
            return f"hung: no heartbeat for {now - self.last_beat:.1f} s (ingest.hang_after_s={hang_after_s:g})"
        return None


class RestartPolicy:
    """Per stream: deaths within the window; decides restart, quarantine, or fail."""

    def __init__(self, max_restarts: int, window_s: float, clock=time.monotonic):
        self.max_restarts, self.window_s, self._clock = max_restarts, window_s, clock
        self._deaths: dict[str, deque] = {}
        self.isolated: set[str] = set()

    def died(self, stream: str) -> str:
        """'restart' | 'isolate' | 'fail' for a stream whose process just died."""
        now = self._clock()
        d = self._deaths.setdefault(stream, deque())
        d.append(now)
        while d and now - d[0] > self.window_s:
            d.popleft()
        if len(d) <= self.max_restarts:
            return "restart"
        d.clear()
        if stream in self.isolated:
            return "fail"
        self.isolated.add(stream)
        return "isolate"

    def forget(self, stream: str) -> None:
        self._deaths.pop(stream, None)
        self.isolated.discard(stream)
