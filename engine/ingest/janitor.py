"""What an engine leaves in /dev/shm and /tmp, removed when it dies however it dies (SIGKILL included), and what
engines that died before it left, removed when it starts.

Names carry their owner: a run is `<token>p<pid>s<start>`, the engine's pid and its start time in clock ticks
since boot (/proc/<pid>/stat field 22), so `vidar-<run>-...` in /dev/shm (segments) and /tmp (the run's folder)
tell a live owner from a dead one even after its pid was reused. A pid means nothing in another pid namespace
(two containers sharing /dev/shm or /tmp), so a live engine also holds a lock (flock) on a file of each place for
its whole life, `/dev/shm/vidar-<run>.lock` and `/tmp/vidar-<run>-*/lock`: a name whose owner's lock is held is
never removed, whatever its pid says. A lock goes with its holder, however it ends.

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

import fcntl
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
_RUN = re.compile(r"^vidar-([0-9a-f]{8}p(\d+)s(\d+))[-.]")


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


def _locked(path: str) -> bool:
    """Whether someone holds the lock on `path` (a live engine: Owner)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True  # cannot tell: kept
    finally:
        os.close(fd)
    return False


def _run_alive(run: str, pid: int, ticks: int, shm_dir: str, tmp_dir: str) -> bool:
    if start_ticks(pid) == ticks:
        return True
    locks = [os.path.join(shm_dir, f"vidar-{run}.lock")]
    try:
        locks += [os.path.join(tmp_dir, n, "lock") for n in os.listdir(tmp_dir) if n.startswith(f"vidar-{run}-")]
    except OSError:
        pass
    return any(_locked(p) for p in locks)


def sweep_dead(shm_dir: str = SHM_DIR, tmp_dir: str = TMP_DIR) -> list[str]:
    """Remove what engines that are gone left (their runs' segments, lock files and folders); the names removed.
    A run is gone when its owner's pid does not run with its start time and nobody holds its locks."""
    found: dict[str, list[str]] = {}
    owners: dict[str, tuple[int, int]] = {}
    for folder in (shm_dir, tmp_dir):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            m = _RUN.match(name)
            if m is not None:
                found.setdefault(m.group(1), []).append(os.path.join(folder, name))
                owners[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    removed = []
    for run, paths in found.items():
        if _run_alive(run, *owners[run], shm_dir, tmp_dir):
            continue
        for path in paths:
            if _remove(path):
                removed.append(path)
    return removed


def sweep_run(run: str, shm_dir: str = SHM_DIR, tmp_dir: str = TMP_DIR) -> list[str]:
    removed = []
    for folder in (shm_dir, tmp_dir):
        try:
            names = [n for n in os.listdir(folder) if n.startswith((f"vidar-{run}-", f"vidar-{run}."))]
        except OSError:
            continue
        for name in names:
            if _remove(os.path.join(folder, name)):
                removed.append(os.path.join(folder, name))
    return removed


class Owner:
    """The locks a live engine holds on its run (see the module's docstring); released by close() or its end."""

    def __init__(self, run: str, run_dir: str, shm_dir: str = SHM_DIR):
        self._shm_lock = os.path.join(shm_dir, f"vidar-{run}.lock")
        self._fds: list[int] = []
        try:
            for path in (self._shm_lock, os.path.join(run_dir, "lock")):
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                self._fds.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        fds, self._fds = self._fds, []
        if fds:
            _remove(self._shm_lock)
        for fd in fds:
            os.close(fd)


def _remove(path: str) -> bool:
    """Whether `path` is gone now (another user's entry in a sticky folder stays)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
    return not os.path.lexists(path)


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
