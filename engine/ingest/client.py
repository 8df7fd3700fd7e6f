"""The core side of the ingest processes: IngestHub, what the engine holds, and its one I/O thread.

The I/O thread ("ingest-io") owns every socket: each process's uplink (uplink.py: a seqpacket socketpair) for
what it sends (frames, events, states, heartbeats; in its order: a stream's eos state comes after its last
frame), and one ZeroMQ PUSH per process for commands. It sleeps in a poll on the uplinks and an os.eventfd,
which the core thread's add/remove write to, and the rings' release (`FrameRing.on_free`) when the stream's
process holds no lent slot (else the process's next FrameReady wakes the thread anyway): a freed slot is lent back
as a credit within one wake-up, and no socket is touched by another thread. Each wake-up drains descriptors in
bulk and commits them to the rings, then tops up credits, one message per process, then checks the processes.

Who owns what (vLLM v1's core client / engine core / process manager split), all run by the I/O thread:
  client.py   IngestHub: the engine's calls (other threads: add, health, counters, close), the loop, the
              poller and the uplinks' reading, routing each message to its owner
  leases.py   Leases: the streams' leases, their frames, segments, credits, placement, what a death means
  procs.py    ProcessManager: starting, commanding, checking and ending the processes
  supervisor.py  the process handle, the hang rule and the restart policy (pure)
"""

from __future__ import annotations

import logging
import os
import multiprocessing.util
import select
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from engine.config import EngineConfig, StreamConfig
from engine.frames.ring import FrameRing
from engine.ingest import slots as ingest_slots
from engine.ingest import janitor, uplink, wire
from engine.ingest.lease import RemoteIngest
from engine.ingest.leases import Leases
from engine.ingest.procs import ProcessManager
from engine.ingest.slots import Segment
from engine.ingest.supervisor import IngestProcess

log = logging.getLogger("vidar.ingest")

#: what an ingest process may send the engine about a stream; anything else is counted in bad_messages
_STREAM_UP = (wire.FrameReady, wire.Geometry, wire.StreamEvent, wire.StreamState)


class IngestHub:
    def __init__(self, cfg: EngineConfig, *, emit: Callable[[str, str, str], None], cores: int):
        self.cfg = cfg
        left = janitor.sweep_dead()
        if left:
            log.warning("ingest: removed %d segment(s) and folder(s) that engines which died left behind: %s",
                        len(left), ", ".join(left[:5]) + (" ..." if len(left) > 5 else ""))
        self._run = janitor.new_run()  # names the run's segments and folder, and their owner (janitor.py)
        # before anything of the run exists: whatever ends the engine, its watcher then removes what it made
        self._watcher = janitor.Watcher(self._run, multiprocessing.util.get_temp_dir())
        try:
            # a short ipc path (107 bytes at most): the system temp folder, not a long TMPDIR or stream ids
            self._dir = tempfile.mkdtemp(prefix=f"vidar-{self._run}-",
                                         dir=janitor.TMP_DIR if os.path.isdir(janitor.TMP_DIR) else None)
            self._owner = janitor.Owner(self._run, self._dir)  # held for the engine's life: the run is live
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except BaseException:
            self._watcher.close()  # it sweeps what was made
            raise
        self._readers: dict[int, uplink.Reader] = {}  # fd -> each process's uplink (and tests' injected ones)
        self._buf = bytearray(uplink.MAX_MESSAGE)     # the I/O thread's one receive buffer
        self._poller = select.poll()                  # the I/O thread's only
        self._inbox: deque = deque()            # ("add" | "remove" | "credit", stream) from other threads
        self.procs = ProcessManager(cfg, self._run, self._dir, cores=cores, on_start=lambda p: self._add_reader(p.up))
        self.leases = Leases(cfg, self._run, self.procs, emit=emit, submit=self._submit)
        self.bad_messages = 0        # messages that did not decode or are not ours
        self._closing = False
        self.dead: Optional[str] = None
        self._thread = threading.Thread(target=self._loop, name="ingest-io", daemon=True)
        self._thread.start()

    # -- other threads ------------------------------------------------------------------------------------
    def add(self, scfg: StreamConfig, ring: FrameRing, source: Any, fanout: tuple[FrameRing, ...] = ()) -> RemoteIngest:
        """Core thread: a stream to decode in a process (started by RemoteIngest.start); `fanout`: the rings of the
        other pools it feeds (leases.Leases.add)."""
        return self.leases.add(scfg, ring, source, fanout)

    def _submit(self, item: tuple[str, Any], wake: bool = True) -> None:
        self._inbox.append(item)
        if not wake:
            return
        try:
            os.eventfd_write(self._efd, 1)
        except OSError:  # closed: the hub is shutting down
            pass

    def open_uplink(self) -> socket.socket:
        """A sending end the I/O thread reads as if an ingest process sent on it: tests inject forged and stale
        messages this way. The reader is registered by the I/O thread, the poller's one user."""
        core, theirs = uplink.pair()
        self._submit(("reader", uplink.Reader(core)))
        return theirs

    def health(self) -> Optional[str]:
        """Why ingest cannot go on (its I/O thread died), or None; the core checks it every step."""
        if self.dead or (not self._thread.is_alive() and not self._closing):
            return self.dead or "ingest I/O thread ended"
        return None

    def describe(self) -> list[dict]:
        return self.procs.describe()

    def counters(self) -> dict[str, int]:
        ls = self.leases
        return {"stale_descriptors": ls.stale_descriptors, "bad_messages": self.bad_messages + ls.bad_messages,
                "bad_commands": sum(p.bad_commands for p in list(self.procs.procs.values())),
                "restarts": ls.restarts, "processes": len(self.procs.procs), "cuda_unadmitted": ls.pending.dropped,
                "cuda_contexts": self.procs.cuda_contexts()}

    def pids(self) -> dict[int, int]:
        return self.procs.pids()

    # -- the I/O thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        self._poller.register(self._efd, select.POLLIN)
        next_check = 0.0
        pending = self.leases.pending
        try:
            while not self._closing:
                credit: set[str] = set()
                for reader in self._poll(1 if pending.held else 50):  # a GPU copy being polled: ~1 ms, not 50
                    self._read(reader, credit)
                if pending.held:
                    pending.poll()
                if pending.failed:  # a stream's GPU copy event raised on query: that stream stops, not this thread
                    self.leases.copies_failed(pending.take_failed())
                if self.leases.to_wake is not None:  # every ring shares the core's wake: once for the batch
                    self.leases.to_wake.notify(self.leases.to_wake_frames)
                    self.leases.to_wake, self.leases.to_wake_frames = None, 0
                self._apply_inbox(credit)
                self.leases.top_up(credit)
                now = time.monotonic()
                if now >= next_check:
                    self.leases.retry(now)
                    for proc in self.procs.check(now, self._drain):
                        self._died(proc)
                    next_check = now + 0.05
        except BaseException as err:  # the engine cannot ingest any more: it dies loudly (health)
            log.exception("ingest I/O thread crashed")
            self.dead = f"ingest I/O thread crashed: {type(err).__name__}: {err}"

    def _poll(self, timeout_ms: int) -> list[uplink.Reader]:
        """The uplinks with something to read after waiting up to `timeout_ms` (the eventfd is read here)."""
        out = []
        for fd, _ in self._poller.poll(timeout_ms):
            if fd == self._efd:
                try:
                    os.eventfd_read(self._efd)
                except BlockingIOError:
                    pass
            elif (reader := self._readers.get(fd)) is not None:
                out.append(reader)
        return out

    def _add_reader(self, reader: uplink.Reader) -> None:
        self._readers[reader.fd] = reader
        self._poller.register(reader.fd, select.POLLIN)

    def _drop_reader(self, reader: uplink.Reader) -> None:
        if self._readers.get(reader.fd) is reader:
            del self._readers[reader.fd]
            self._poller.unregister(reader.fd)
        reader.close()

    def _read(self, reader: uplink.Reader, touched: set[str], limit: int = 4096) -> bool:
        """Handle up to `limit` of one uplink's waiting messages (bounded: commands, supervision and the other
        processes are not starved by a flood), adding the streams that got a frame to `touched`. True when it
        stopped because none was left (or at its end of file: the reader is dropped then)."""
        buf = self._buf
        for _ in range(limit):
            n = reader.read(buf)
            if n is None:
                return True
            if n == 0:
                self._drop_reader(reader)
                return True
            if n < 0:  # an empty packet
                self.bad_messages += 1
                continue
            if n > len(buf):
                self.bad_messages += 1
                log.warning("ingest: dropped a message of %d bytes (the longest read is %d)", n, len(buf))
                continue
            try:
                msg = wire.decode(memoryview(buf)[:n])
            except wire.WireError as err:
                self.bad_messages += 1
                log.warning("ingest: dropped a message that is not ours: %s", err)
                continue
            self._handle(msg, touched)
        return False

    def _handle(self, msg: Any, touched: set[str]) -> None:
        if isinstance(msg, (wire.Ready, wire.Heartbeat)):
            proc = self.procs.procs.get(msg.proc)
            if proc is None or proc.gen != msg.gen:
                return
            proc.last_beat = time.monotonic()
            if isinstance(msg, wire.Heartbeat):
                proc.bad_commands = msg.bad_commands
                if msg.cuda != proc.cuda:
                    proc.cuda = msg.cuda
                    self._say_cuda(f"{proc.label} made a CUDA context (a stream decoding with NVDEC opened there)")
            else:
                proc.ready, proc.pid = True, msg.pid
                for s in proc.streams:
                    if (lease := self.leases.leases.get(s)) is not None:
                        lease.remote.process = proc.label
                self.procs.flush(proc)
        elif isinstance(msg, _STREAM_UP):
            self.leases.handle(msg, touched)
        else:  # a command type sent up (a bug or a forgery): never ours to act on
            self.bad_messages += 1

    def _say_cuda(self, what: str) -> None:
        """How many ingest processes hold a CUDA context of their own, said when it changes: each costs GPU memory
        (~300-500 MB expected, not measured yet) for the process's life, whatever its streams do since."""
        log.info("ingest: %s: %d ingest process(es) now hold a CUDA context of their own (~300-500 MB of GPU memory "
                 "each, expected)", what, self.procs.cuda_contexts())

    def _apply_inbox(self, credit: set[str]) -> None:
        while self._inbox:
            what, stream = self._inbox.popleft()
            if what == "reader":  # open_uplink: `stream` is the Reader here
                self._add_reader(stream)
            elif what != "stop":
                self.leases.apply(what, stream, credit)

    def _read_all(self, proc: IngestProcess) -> set[str]:
        """Everything waiting in a process's uplink, handled now, up to its end of file if it is gone (not to the
        first batch without a frame: a run of states, say); bounded all the same. The streams that got frames."""
        touched: set[str] = set()
        for _ in range(64):
            if self._read(proc.up, touched):
                break
        return touched

    def _drain(self, proc: IngestProcess) -> None:
        """What already waits in a live process's uplink, handled before it is judged hung."""
        self.leases.top_up(self._read_all(proc))

    def _died(self, proc: IngestProcess) -> None:
        reason = proc.exit_reason()
        # what it sent before dying is committed first (its frames are published): a socketpair keeps what was
        # sent after the sender is gone
        touched = self._read_all(proc)
        self._drop_reader(proc.up)
        self.procs.reap(proc)
        if proc.cuda:
            self._say_cuda(f"{proc.label} ended")
        self.leases.credit_after_death(proc, touched)
        self.leases.died(proc, reason, self._closing)

    # -- shutdown -----------------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Every process told to exit, joined (killed past `timeout`), every segment unlinked, sockets closed."""
        if self._closing:
            return
        self._closing = True
        self._submit(("stop", ""))
        t_end = time.monotonic() + timeout
        # the I/O thread owns the processes' sockets: it is waited for (a process start in progress can take
        # seconds), so that nothing below runs beside it
        self._thread.join(max(2.0, timeout))
        if self._thread.is_alive():
            log.warning("ingest: the I/O thread did not stop within %.1f s: closing beside it", max(2.0, timeout))
        try:
            self.procs.tell_exit()
            if not self._thread.is_alive():  # this thread is the poller's only user now
                self._read_until_exited(max(t_end, time.monotonic() + 1.0))
            self.procs.close(max(t_end, time.monotonic() + 1.0))
            self.leases.close()
            for name in _segments_of(self._run):  # one whose creation failed half-way, or a lease never ended
                Segment.remove(name)
            for reader in list(self._readers.values()) + [r for what, r in list(self._inbox) if what == "reader"]:
                reader.close()  # and a test's uplink the I/O thread never registered
            self._readers.clear()
            efd, self._efd = self._efd, -1  # a late _submit writes to -1: an OSError it ignores, never a reused fd
            os.close(efd)
        finally:  # whatever failed above, the run's names go and the watcher ends
            self._owner.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            self._watcher.close()

    def _read_until_exited(self, t_end: float) -> None:
        """Read and let go of what the processes still send until they have exited (or `t_end`): the I/O thread has
        stopped, and a process whose uplink's buffer filled would have its stream threads, and its main thread's
        heartbeat, blocked in a send, unable to stop: killed at the timeout. Nothing read now is committed (the
        engine's rings are closed by now; a frame never committed was never ingested)."""
        while time.monotonic() < t_end and self.procs.any_alive():
            for reader in self._poll(20):
                while (n := reader.read(self._buf)) is not None:
                    if n == 0:
                        self._drop_reader(reader)
                        break


def _segments_of(run: str) -> list[str]:
    try:
        return [n for n in os.listdir(ingest_slots.SHM_DIR) if n.startswith(f"vidar-{run}-")]
    except OSError:
        return []
