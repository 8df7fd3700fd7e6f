"""What an engine leaves in /dev/shm and /tmp, removed when it dies however it dies (SIGKILL included), and what
engines that died before it left, removed when it starts.

Names carry their owner: a run is `<token>p<pid>s<start>`, the engine's pid and its start time in clock ticks
since boot (/proc/<pid>/stat field 22), so `vidar-<run>-...` in /dev/shm (segments) and /tmp (the run's folder)
tell a live owner from a dead one even after its pid was reused.

At death: a small watcher process (`python -m engine.ingest.janitor`), started before the engine makes anything,
blocks reading a pipe only the engine writes to. The pipe's end of file comes when the engine has exited,
whatever ended it; the watcher then removes every name of the run, and the forkserver's folder (multiprocessing's
`pymp-*`, which only the engine's exit handlers would remove). A clean close writes one byte first: the run's
names are already gone then, and the forkserver folder is left to the process's own exit.

Why a process of its own, not the ingest processes (which watched the engine before): at start-up, or between
a segment's creation and its first Slots, no ingest process knows the segment; and a child that unlinks what the
engine owns is a child that can unlink what the engine has just lent again (issue 41 item 6). Only the engine
and its watcher remove names, and the watcher only once the engine is gone.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from typing import Optional

log = logging.getLogger("vidar.ingest")

SHM_DIR = "/dev/shm"
TMP_DIR = "/tmp"
_RUN = re.compile(r"^vidar-([0-9a-f]{8})p(\d+)s(\d+)-")


def start_ticks(pid: int) -> Optional[int]:
    """The process's start time (clock ticks since boot), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def new_run() -> str:
    return f"{secrets.token_hex(4)}p{os.getpid()}s{start_ticks(os.getpid()) or 0}"


def _owner_alive(name: str) -> Optional[bool]:
    """Whether the engine that named `name` runs; None for a name that is not a run's."""
    m = _RUN.match(name)
    if m is None:
        return None
    return start_ticks(int(m.group(2))) == int(m.group(3))


def sweep_dead(shm_dir: str = SHM_DIR, tmp_dir: str = TMP_DIR) -> list[str]:
    """Remove what engines that are gone left (their runs' segments and folders); the names removed."""
    removed = []
    for folder in (shm_dir, tmp_dir):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if _owner_alive(name) is False:
                _remove(os.path.join(folder, name))
                removed.append(os.path.join(folder, name))
    return removed


def sweep_run(run: str, shm_dir: str = SHM_DIR, tmp_dir: str = TMP_DIR) -> list[str]:
    removed = []
    for folder in (shm_dir, tmp_dir):
        try:
            names = [n for n in os.listdir(folder) if n.startswith(f"vidar-{run}-")]
        except OSError:
            continue
        for name in names:
            _remove(os.path.join(folder, name))
            removed.append(os.path.join(folder, name))
    return removed


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


class Watcher:
    """The engine's side: the watcher process and the pipe it reads."""

    def __init__(self, run: str, forkserver_dir: str = ""):
        r, self._w = os.pipe()
        try:
            # its own session: a Ctrl-C or a stop sent to the engine's process group does not end it before the
            # engine; it ends at the pipe's end of file. stdin is the pipe; nothing else is inherited.
            self.proc = subprocess.Popen([sys.executable, "-m", "engine.ingest.janitor", run, forkserver_dir],
                                         stdin=r, stdout=subprocess.DEVNULL, close_fds=True,
                                         start_new_session=True)
        except BaseException:
            os.close(self._w)
            raise
        finally:
            os.close(r)
        os.set_inheritable(self._w, False)

    def close(self, timeout: float = 5.0) -> None:
        """A clean close: the watcher sweeps what is left of the run (nothing, normally) and exits."""
        if self._w < 0:
            return
        try:
            os.write(self._w, b"c")
        except OSError:
            pass
        os.close(self._w)
        self._w = -1
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("ingest: the clean-up watcher (pid %d) did not exit: killed", self.proc.pid)
            self.proc.kill()
            self.proc.wait(2.0)


def _watch(run: str, forkserver_dir: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    clean = False
    while True:
        try:
            data = os.read(0, 64)
        except InterruptedError:
            continue
        if not data:
            break
        clean = clean or b"c" in data
    left = sweep_run(run)
    if not clean and forkserver_dir and os.path.basename(forkserver_dir).startswith("pymp-"):
        _remove(forkserver_dir)
    if left and not clean:
        print(f"vidar: the engine of run {run} ended without cleaning up: removed {len(left)} names",
              file=sys.stderr)


if __name__ == "__main__":
    _watch(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
