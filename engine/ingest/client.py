"""The core side of the ingest processes: one I/O thread, the streams' leases, RemoteIngest per stream.

The I/O thread ("ingest-io") owns every socket: each process's uplink (uplink.py: a seqpacket socketpair) for
what it sends (frames, events, states, heartbeats; in its order: a stream's eos state comes after its last
frame), and one ZeroMQ PUSH per process for commands. It sleeps in a poll on the uplinks and an os.eventfd,
which the core thread's add/remove write to, and the rings' release
(`FrameRing.on_free`) when the stream's process holds no lent slot (else the process's next FrameReady wakes
the thread anyway): a freed slot is lent back as a credit within one wake-up, and no socket is touched by
another thread. Each wake-up drains descriptors in bulk and commits them to the rings (the ring's critical
section that write() had), then tops up credits, one message per process, then checks the processes (supervisor.py):
their exits are polled here every 50 ms (Process.is_alive, a waitpid) rather than registered in the
poller, which would need rebuilding at every restart for a gain of at most 50 ms of the 5 s promised.

A stream's lease: which process holds it, its generation (`gen`: bumped at each assignment to a process
and each new geometry; a descriptor of another generation is stale: dropped and counted, never
committed), its segment (slots.py), and the next seq (a restarted process continues it). A process
death: its streams' lent slots are reclaimed (frames it delivered stay READY and are published), each
stream is announced `reconnecting` naming the signal, and placed again at once (RestartPolicy decides
restart, quarantine or fail).
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import multiprocessing
import os
import secrets
import select
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import zmq

from engine.config import EngineConfig, StreamConfig
from engine.errors import SourceError
from engine.frames.lifecycle import DropReason, FrameMeta
from engine.frames.ring import FrameRing
from engine.ingest import wire
from engine.ingest.cuda_slots import PendingFrames
from engine.ingest import slots as ingest_slots
from engine.ingest import uplink
from engine.ingest.slots import Segment, ShmSpaceError
from engine.ingest.supervisor import IngestProcess, RestartPolicy, exit_reason

log = logging.getLogger("vidar.ingest")

#: Modules an ingest process imports at start. Tests only (a source that crashes on purpose is registered
#: this way, tests/support/crashing_source.py); the product never sets it.
TEST_IMPORTS: list[str] = []

_PRELOAD = ["av", "numpy", "zmq", "msgspec", "engine.ingest.process"]
#: what an ingest process may send the engine (the up socket); anything else is counted in bad_messages
_UP = (wire.Ready, wire.Heartbeat, wire.FrameReady, wire.Geometry, wire.StreamEvent, wire.StreamState)


def resolve_processes(processes: int | str, streams: int, streams_per_process: int, cores: int) -> tuple[int, str]:
    """(the most general ingest processes, the rule said in the start log)."""
    if processes != "auto":
        return int(processes), f"ingest.processes={processes}"
    cap = max(2, cores)  # a process's streams share its GIL: see IngestConfig.processes
    return cap, (f"ingest.processes=auto: up to max(2, usable cores) = {cap} processes, a new one started when "
                 f"every running one holds ingest.streams_per_process={streams_per_process} streams "
                 f"({streams} configured now -> {min(cap, max(1, math.ceil(streams / streams_per_process)))})")


class RemoteIngest:
    """What the StreamTable reads from an IngestThread, for a stream decoded in an ingest process."""

    def __init__(self, hub: "IngestHub", source: Any, ring: FrameRing, live: bool):
        self._hub, self.source, self.ring, self.live = hub, source, ring, live
        self.stream = source.stream_id
        self.state = "starting"
        self.failed = False
        self.end_reason = ""
        self.total_frames: Optional[int] = None
        self.reconnects = 0
        self.seq = 0
        self.process = "starting"   # "ingest-2 (pid 1234)": where it decodes (list, the view)
        self.attempts: deque = deque(maxlen=64)
        self.backoff: deque = deque(maxlen=64)
        self._ended = threading.Event()

    def start(self) -> None:
        self._hub._submit(("add", self.stream))

    def stop(self) -> None:
        """Idempotent. The ring closes now (as IngestThread.stop does); its process is told to stop the stream."""
        self.ring.close()
        if not self._ended.is_set():
            self._hub._submit(("remove", self.stream))

    def join(self, timeout: Optional[float] = None) -> bool:
        return self._ended.wait(timeout)

    @property
    def alive(self) -> bool:
        return not self._ended.is_set()


@dataclass(eq=False)
class _Lease:
    cfg: StreamConfig
    ring: FrameRing
    remote: RemoteIngest
    size: Optional[tuple[int, int]] = None   # (h, w) known before opening (synthetic sources)
    proc: Optional[IngestProcess] = None
    gen: int = 0
    assign_gen: int = 0
    segment: Optional[Segment] = None
    segments_made: int = 0
    dropped_seen: int = 0
    expired_seen: int = 0
    next_seq: int = 0
    removing: bool = False
    unplaced_since: Optional[float] = None  # no process could be started for it (out of descriptors): retried
    segment_retry: Optional[tuple[int, int, float, float]] = None  # (h, w, since, next try): no fd for a segment
    retry_at: float = 0.0

    @property
    def stream(self) -> str:
        return self.cfg.id


class IngestHub:
    def __init__(self, cfg: EngineConfig, *, emit: Callable[[str, str, str], None], cores: int):
        self.cfg, self._emit = cfg, emit
        ic = cfg.ingest
        self.max_procs, rule = resolve_processes(ic.processes, len(cfg.streams), ic.streams_per_process, cores)
        self._auto = ic.processes == "auto"
        log.info("ingest: decoders run in processes: %s", rule)
        self._run = secrets.token_hex(4)
        # a short ipc path (107 bytes at most): the system temp folder, not a long TMPDIR or stream ids
        self._dir = tempfile.mkdtemp(prefix=f"vidar-{self._run}-", dir="/tmp" if os.path.isdir("/tmp") else None)
        self._mp = multiprocessing.get_context("forkserver")
        self._mp.set_forkserver_preload(_PRELOAD)
        self._ctx = zmq.Context()
        # The engine binds nothing here: each ingest process binds its command endpoint and the engine connects. A
        # listener in the engine would accept on every connection, and libzmq's ipc listener aborts the process
        # when accept() fails with EMFILE (src/ipc_listener.cpp:297: a descriptor flood on the control port killed
        # the engine); a connecter that cannot get a descriptor just retries (ipc_connecter.cpp). The uplinks are
        # socketpairs made before each start: no listener either.
        self._readers: dict[int, uplink.Reader] = {}  # fd -> each process's uplink (and tests' injected ones)
        self._buf = bytearray(uplink.MAX_MESSAGE)     # the I/O thread's one receive buffer
        self._poller = select.poll()                  # the I/O thread's only
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._inbox: deque = deque()            # ("add" | "remove" | "credit", stream) from other threads
        self._leases: dict[str, _Lease] = {}    # the I/O thread's, but for add (before it is submitted)
        self._procs: dict[int, IngestProcess] = {}
        self._gens: dict[int, int] = {}
        # Lease generations come from one counter for the whole hub, never per lease: a stream removed and added
        # again under the same id starts above every generation its old lease used, so a leftover of the old
        # one still in a socket can never pass for the new one's.
        self._lease_gens = itertools.count(1)
        self.policy = RestartPolicy(ic.max_restarts, ic.restart_window_s)
        self._pending = PendingFrames()  # CUDA IPC frames whose copy is not done yet (none for host slots)
        self.stale_descriptors = 0   # FrameReady of a dead or superseded generation: dropped, never committed
        self.bad_messages = 0        # messages that did not decode or named nothing we know
        self.restarts = 0            # ingest processes that died and whose streams were placed again
        self._to_wake: Optional[FrameRing] = None  # a ring committed to since the core was last woken
        self._closing = False
        self.dead: Optional[str] = None
        self._thread = threading.Thread(target=self._loop, name="ingest-io", daemon=True)
        self._thread.start()

    # -- other threads ------------------------------------------------------------------------------------
    def add(self, scfg: StreamConfig, ring: FrameRing, source: Any) -> RemoteIngest:
        """Core thread: a stream to decode in a process (started by RemoteIngest.start)."""
        remote = RemoteIngest(self, source, ring, scfg.mode == "live")
        size = getattr(source, "frame_size", None)
        lease = _Lease(scfg, ring, remote, size=(size[1], size[0]) if size else None)
        # a generation of its own from the start (next() on the shared counter is atomic under the GIL): until it
        # is placed, a message of an older lease of the same id (a process still ending it) is stale, not its
        lease.gen = lease.assign_gen = next(self._lease_gens)
        # a freed slot is lent back at the I/O thread's next wake-up; it wakes for it only when the process holds
        # no lent slot of the stream (else its next FrameReady wakes it: one wake-up a frame fewer)
        ring.on_free = lambda held, s=scfg.id: self._submit(("credit", s), wake=not held)
        self._leases[scfg.id] = lease
        return remote

    def _submit(self, item: tuple[str, str], wake: bool = True) -> None:
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
        return [{"process": p.label, "streams": sorted(p.streams), "dedicated": p.dedicated}
                for p in list(self._procs.values())]

    def counters(self) -> dict[str, int]:
        return {"stale_descriptors": self.stale_descriptors, "bad_messages": self.bad_messages,
                "restarts": self.restarts, "processes": len(self._procs),
                "cuda_unadmitted": self._pending.dropped}

    def pids(self) -> dict[int, int]:
        return {p.idx: p.handle.pid for p in list(self._procs.values())}

    # -- the I/O thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        self._poller.register(self._efd, select.POLLIN)
        next_check = 0.0
        try:
            while not self._closing:
                credit: set[str] = set()
                for reader in self._poll(1 if self._pending.held else 50):  # a GPU copy being polled: ~1 ms, not 50
                    self._read(reader, credit)
                if self._pending.held:
                    self._pending.poll()
                if self._to_wake is not None:  # every ring shares the core's wake: once for the batch
                    self._to_wake.notify()
                    self._to_wake = None
                credit |= self._apply_inbox()
                self._top_up(credit)
                now = time.monotonic()
                if now >= next_check:
                    self._supervise(now)
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
            proc = self._procs.get(msg.proc)
            if proc is None or proc.gen != msg.gen:
                return
            proc.last_beat = time.monotonic()
            if isinstance(msg, wire.Ready):
                proc.ready, proc.pid = True, msg.pid
                for s in proc.streams:
                    if (lease := self._leases.get(s)) is not None:
                        lease.remote.process = proc.label
                self._flush(proc)
            return
        if not isinstance(msg, _UP):  # a command type sent up (a bug or a forgery): never ours to act on
            self.bad_messages += 1
            return
        lease = self._leases.get(msg.stream)
        if lease is None or msg.gen < lease.assign_gen:  # a stream gone, or a dead process's leftovers
            if isinstance(msg, wire.FrameReady):
                self.stale_descriptors += 1
            return
        if isinstance(msg, (wire.FrameReady, wire.StreamState)):
            d = msg.dropped - lease.dropped_seen
            if d > 0:
                lease.ring.drop_at_source(d)
                lease.dropped_seen = msg.dropped
            e = msg.expired - lease.expired_seen
            if e > 0:
                lease.ring.drop_at_source(e, DropReason.DEADLINE)
                lease.expired_seen = msg.expired
        if isinstance(msg, wire.FrameReady):
            self._commit(lease, msg)
            touched.add(lease.stream)
        elif isinstance(msg, wire.Geometry):
            self._geometry(lease, msg.h, msg.w, msg.gen)
        elif isinstance(msg, wire.StreamEvent):
            self._event(lease, msg.kind, msg.reason)
        elif isinstance(msg, wire.StreamState):
            self._state(lease, msg)

    def _commit(self, lease: _Lease, msg: wire.FrameReady) -> None:
        if msg.gen != lease.gen:  # lent under an older geometry or assignment: the slot is not its any more
            self.stale_descriptors += 1
            return
        meta = FrameMeta(msg.stream, msg.seq, msg.pts, msg.t_capture, decode_s=msg.decode_s, deadline=msg.deadline,
                         height=msg.h, width=msg.w, t_capture_mono=msg.t_capture_mono, colour=tuple(msg.colour),
                         t_written=msg.t_written)
        written = lease.ring.written_event(msg.slot)
        if written is None:  # shared host memory: the pixels are there when the descriptor is
            self._admit(lease, msg, meta)
        else:  # a CUDA IPC slot (cuda_slots.py): committed once a host poll sees the GPU copy done, never waited on
            self._pending.add(msg.stream, msg.gen, msg.slot, written, lambda: self._admit(lease, msg, meta))

    def _admit(self, lease: _Lease, msg: wire.FrameReady, meta: FrameMeta) -> bool:
        # the core is woken once per drained batch, not per frame (its Condition.notify was 15 us of GIL a frame)
        if lease.ring.commit(msg.slot, meta, notify=False):
            self._to_wake = lease.ring
            if lease.remote.state == "starting":  # its first frame: running now, not at the next heartbeat
                lease.remote.state = "running"
            lease.next_seq = max(lease.next_seq, msg.seq + 1)
            lease.remote.seq = lease.next_seq
            return True
        if not lease.ring.closed:
            self.bad_messages += 1
            log.warning("stream %s: a descriptor named slot %d, which is not lent at %dx%d: dropped", msg.stream,
                        msg.slot, msg.w, msg.h)
        return False

    def _event(self, lease: _Lease, kind: str, reason: str) -> None:
        r = lease.remote
        if r.failed:
            return
        if kind in ("started", "connected"):
            r.state = "running"
        elif kind == "reconnecting":
            r.state = "reconnecting"
        self._emit(lease.stream, kind, reason)

    def _state(self, lease: _Lease, msg: wire.StreamState) -> None:
        r = lease.remote
        r.total_frames, r.reconnects = msg.total_frames, max(r.reconnects, msg.reconnects)
        r.source.decode_errors = msg.decode_errors
        if msg.decode_device:
            r.source.decode_device = msg.decode_device
        lease.next_seq = max(lease.next_seq, msg.seq)
        r.seq = lease.next_seq
        if not r.failed:
            r.state, r.failed, r.end_reason = msg.state, msg.failed, msg.end_reason
        if msg.final:
            self._end(lease)

    def _geometry(self, lease: _Lease, h: int, w: int, gen: int) -> None:
        seg = lease.segment
        if seg is not None and (seg.h, seg.w) == (h, w) and gen < lease.gen:
            return  # it asked before the Slots it is being sent arrived (a first frame racing them): they will
        if lease.proc is not None:
            self._send(lease.proc, self._new_segment(lease, h, w))

    def _new_segment(self, lease: _Lease, h: int, w: int) -> list:
        """A segment for the stream's frames of h x w, its slots and credits (or the stream fails)."""
        n = lease.ring.slots_needed(h, w)
        lease.segments_made += 1
        name = f"vidar-{self._run}-{lease.stream}-{lease.segments_made}"
        try:
            seg = Segment(name, n, h, w, create=True)
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE) and not isinstance(err, ShmSpaceError):
                self._short_of_descriptors(lease, h, w, err)  # a flood of connections, say: retried
            else:
                self._fail(lease, f"no shared memory for its frames: {err}")
            return []
        lease.segment_retry = None
        try:
            lease.ring.set_geometry(h, w, seg)
        except SourceError as err:
            seg.unlink()
            self._fail(lease, err.reason)
            return []
        old, lease.segment = lease.segment, seg
        if old is not None:
            old.unlink()  # its frames still held stay mapped until released
        lease.gen = next(self._lease_gens)
        slots = lease.ring.lend(self.cfg.ingest.live_credit)
        return [wire.Slots(lease.stream, lease.gen, name, n, h, w), wire.Credit(lease.stream, lease.gen, slots)]

    def _short_of_descriptors(self, lease: _Lease, h: int, w: int, err: OSError) -> None:
        """A segment needs a descriptor for a moment, and the engine has none left: retried every second (the
        stream's frames meanwhile are shed at the source, counted); past ingest.start_timeout_s it fails."""
        now, limit = time.monotonic(), self.cfg.ingest.start_timeout_s
        since = lease.segment_retry[2] if lease.segment_retry else now
        if now - since > limit:
            lease.segment_retry = None
            self._fail(lease, f"no shared memory for its frames: {err} (for {limit:g} s, ingest.start_timeout_s)")
            return
        if lease.segment_retry is None:
            log.warning("stream %s: no descriptor left to make its frame slots (%s): retrying every second for up "
                        "to ingest.start_timeout_s=%g s", lease.stream, err, limit)
        lease.segment_retry = (h, w, since, now + 1.0)

    def _top_up(self, streams: set[str]) -> None:
        """Lend the streams' free slots: one Credits message per process (one send, not one per stream)."""
        out: dict[int, tuple[IngestProcess, list[wire.Credit]]] = {}
        for stream in streams:
            lease = self._leases.get(stream)
            if lease is None or lease.proc is None or lease.segment is None:
                continue
            slots = lease.ring.lend(self.cfg.ingest.live_credit)
            if slots:
                out.setdefault(lease.proc.idx, (lease.proc, []))[1].append(wire.Credit(stream, lease.gen, slots))
        for proc, credits in out.values():
            self._send(proc, [credits[0] if len(credits) == 1 else wire.Credits(credits)])

    def _fail(self, lease: _Lease, reason: str) -> None:
        r = lease.remote
        r.failed, r.state, r.end_reason = True, "failed", f"error: {reason}"
        log.error("stream %s: %s", lease.stream, reason)
        self._emit(lease.stream, "error", reason)
        lease.ring.close()
        if lease.proc is not None and lease.proc.handle.is_alive():
            lease.removing = True
            self._send(lease.proc, [wire.RemoveStream(lease.stream)])
        else:
            self._end(lease)

    def _end(self, lease: _Lease) -> None:
        """The stream is over in its process (its last frame committed before): slots back, segment unlinked."""
        lease.ring.on_free = None
        self._pending.forget(lease.stream)
        lease.ring.reclaim()
        lease.ring.close()
        if lease.segment is not None:
            lease.segment.unlink()
        proc, lease.proc = lease.proc, None
        if proc is not None:
            proc.streams.discard(lease.stream)
            if proc.dedicated and not proc.streams:
                self._send(proc, [wire.Exit()])
        if self._leases.get(lease.stream) is lease:  # never a newer lease of the same id (re-added after a reap)
            del self._leases[lease.stream]
            self.policy.forget(lease.stream)
        if lease.remote.state not in ("failed", "ended"):
            lease.remote.state = "ended"
        lease.remote._ended.set()

    def _apply_inbox(self) -> set[str]:
        credit: set[str] = set()
        while self._inbox:
            what, stream = self._inbox.popleft()
            if what == "reader":  # open_uplink: `stream` is the Reader here
                self._add_reader(stream)
                continue
            lease = self._leases.get(stream)
            if lease is None:
                continue
            if what == "credit":
                credit.add(stream)
            elif what == "add":
                self._place(lease)
            elif what == "remove" and not lease.removing:
                lease.removing = True
                if lease.proc is not None and lease.proc.handle.is_alive():
                    self._send(lease.proc, [wire.RemoveStream(stream)])
                else:
                    self._end(lease)
        return credit

    # -- placement and processes --------------------------------------------------------------------------
    def _place(self, lease: _Lease) -> None:
        try:
            proc = self._pick(lease.stream)
        except (zmq.ZMQError, OSError) as err:  # EMFILE (a descriptor flood), EAGAIN (no process left)
            self._unplaced(lease, err)
            return
        lease.unplaced_since = None
        lease.proc = proc
        proc.streams.add(lease.stream)
        lease.remote.process = proc.label
        lease.gen = next(self._lease_gens)
        lease.assign_gen = lease.gen
        lease.dropped_seen = lease.expired_seen = 0
        lease.ring.reclaim()
        ic, src = self.cfg, self.cfg.source
        cmds: list = [wire.AddStream(lease.stream, lease.gen, lease.cfg.model_dump(mode="json"),
                                     src.model_dump(mode="json"), ic.ring.max_frame_pixels,
                                     ic.budget.latency_ms / 1e3, lease.next_seq)]
        seg = lease.segment
        if seg is not None:  # a restart: the same slots, lent again under the new generation
            cmds += [wire.Slots(lease.stream, lease.gen, seg.name, seg.count, seg.h, seg.w),
                     wire.Credit(lease.stream, lease.gen, lease.ring.lend(self.cfg.ingest.live_credit))]
        elif lease.size is not None:
            cmds += self._new_segment(lease, *lease.size)
        if lease.remote.failed:  # its segment could not be made (_new_segment failed it): nothing was sent, so no
            self._end(lease)     # final state will come from the process; it ends here
        else:
            self._send(proc, cmds)

    def _unplaced(self, lease: _Lease, err: BaseException) -> None:
        """No process could be started for the stream: retried every second (the I/O thread goes on, and so do
        the other streams); past ingest.start_timeout_s it fails with the reason."""
        now, limit = time.monotonic(), self.cfg.ingest.start_timeout_s
        why = f"no ingest process could be started for it: {type(err).__name__}: {err}"
        if lease.unplaced_since is None:
            lease.unplaced_since = now
            log.warning("stream %s: %s; retrying every second for up to ingest.start_timeout_s=%g s",
                        lease.stream, why, limit)
        if now - lease.unplaced_since > limit:
            self._fail(lease, why)
        else:
            lease.retry_at = now + 1.0

    def _pick(self, stream: str) -> IngestProcess:
        if stream in self.policy.isolated:
            return self._start(dedicated=True)
        general = [p for p in self._procs.values() if not p.dedicated]
        least = min(general, key=lambda p: len(p.streams), default=None)
        spp = self.cfg.ingest.streams_per_process
        if least is not None and (len(general) >= self.max_procs or (self._auto and len(least.streams) < spp)):
            return least
        try:
            return self._start(dedicated=False)
        except (zmq.ZMQError, OSError) as err:
            if least is None:
                raise
            log.warning("ingest: cannot start another process (%s): stream %s goes to %s", err, stream, least.label)
            return least

    def _start(self, dedicated: bool) -> IngestProcess:
        """A new ingest process (raises zmq.ZMQError or OSError when the engine is out of descriptors or
        processes; the caller retries the placement)."""
        idx = next(i for i in range(len(self._procs) + 1) if i not in self._procs)
        gen = self._gens[idx] = self._gens.get(idx, -1) + 1
        cmd_addr = f"ipc://{self._dir}/c{idx}-{gen}"
        core_end, theirs = uplink.pair()
        if not self._procs and not self._gens.get(idx):  # once: what a process may queue before it blocks
            log.info("ingest: each process's uplink buffers %d KiB (asked %d; net.core.wmem_max caps it)",
                     theirs.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 1024, uplink.SNDBUF // 1024)
        cmd, handle = None, None
        try:
            cmd = self._ctx.socket(zmq.PUSH)
            cmd.setsockopt(zmq.SNDHWM, 100_000)
            cmd.setsockopt(zmq.LINGER, 0)
            cmd.setsockopt(zmq.RECONNECT_IVL, 10)  # a new process's endpoint appears within ms of its start
            cmd.connect(cmd_addr)
            ic = self.cfg.ingest
            # forkserver passes `theirs` with the arguments (SCM_RIGHTS): the process's own descriptor
            handle = self._mp.Process(target=_child_main, name=f"ingest-{idx}", daemon=True,
                                      args=(idx, gen, theirs, cmd_addr, ic.heartbeat_s, ic.nice, list(TEST_IMPORTS)))
            handle.start()
        except BaseException:
            core_end.close()
            if cmd is not None:
                cmd.close(0)
            if handle is not None and handle.pid is not None:  # started, but not ours to supervise: ended here
                handle.kill()
                handle.join(2.0)
            raise
        finally:
            theirs.close()  # the process has its own copy: its death is then the uplink's end of file here
        proc = IngestProcess(idx, gen, handle, cmd, uplink.Reader(core_end), dedicated=dedicated)
        proc.up.owner = proc
        self._add_reader(proc.up)
        self._procs[idx] = proc
        log.info("ingest: started %s%s", proc.label, " for one stream (quarantine)" if dedicated else "")
        return proc

    def _send(self, proc: IngestProcess, msgs: list) -> None:
        """In order; what cannot go now (not Ready yet, its connection still being made, or it stopped reading)
        waits in `pending`, retried every loop (a process that stopped reading is killed by the hang check)."""
        proc.pending.extend(msgs)
        if proc.ready:
            self._flush(proc)

    def _flush(self, proc: IngestProcess) -> None:
        while proc.pending:
            try:
                proc.cmd.send(wire.encode(proc.pending[0]), zmq.NOBLOCK)
            except zmq.Again:
                return
            proc.pending.pop(0)

    def _supervise(self, now: float) -> None:
        ic = self.cfg.ingest
        # list() first: the core thread inserts into _leases (add), and a comprehension over the live view could
        # see it change size mid-iteration
        leases = list(self._leases.values())
        for lease in [x for x in leases if x.unplaced_since is not None and x.proc is None]:
            if lease.removing or lease.ring.closed:
                self._end(lease)
            elif now >= lease.retry_at:
                self._place(lease)
        for lease in [x for x in leases if x.segment_retry is not None]:
            h, w, _, at = lease.segment_retry
            if lease.proc is None or lease.removing or lease.ring.closed:
                lease.segment_retry = None
            elif now >= at:
                self._send(lease.proc, self._new_segment(lease, h, w))
        for proc in list(self._procs.values()):
            if proc.ready and proc.pending:
                self._flush(proc)
            if not proc.handle.is_alive():
                self._died(proc)
                continue
            why = proc.hung(now, ic.hang_after_s, ic.start_timeout_s)
            if why and not proc.kill_reason:
                proc.kill_reason = why
                log.error("ingest: %s %s: killing it", proc.label, why)
                proc.handle.kill()

    def _died(self, proc: IngestProcess) -> None:
        reason = proc.kill_reason or exit_reason(proc.handle.exitcode)
        # what it sent before dying is committed first (its frames are published): all of it, up to its uplink's
        # end of file (a socketpair keeps what was sent after the sender is gone), not to the first batch without a
        # frame (a run of states, say); bounded all the same
        touched: set[str] = set()
        for _ in range(64):
            if self._read(proc.up, touched):
                break
        self._drop_reader(proc.up)
        self._procs.pop(proc.idx, None)
        # never a credit for the dead process: its slots are reclaimed below
        self._top_up({s for s in touched if (lease := self._leases.get(s)) is not None and lease.proc is not proc})
        proc.cmd.close(0)
        proc.handle.join(0)
        if not proc.streams:
            if not (self._closing or proc.dedicated):
                log.warning("ingest: %s ended (%s) holding no stream", proc.label, reason)
            return
        self.restarts += 1
        log.error("ingest: %s died (%s) holding %d stream(s): %s; restarting them", proc.label, reason,
                  len(proc.streams), sorted(proc.streams))
        again = []
        for stream in sorted(proc.streams):
            lease = self._leases.get(stream)
            if lease is None:
                continue
            lease.proc = None
            self._pending.forget(stream)  # CUDA copies it queued and never finished: never admitted, counted
            lease.ring.reclaim()  # its lent slots; the frames it delivered stay READY and are published
            # removed, failed (a state it sent before dying), or stopped (its ring closed before the removal reached
            # the inbox): nothing to restart; it ends here rather than waiting for a final state that cannot come
            if lease.removing or lease.remote.failed or lease.ring.closed:
                self._end(lease)
                continue
            why = f"ingest process {proc.label} died ({reason})"
            decision = self.policy.died(stream)
            if decision == "fail":
                ic = self.cfg.ingest
                self._fail(lease, f"{why}; it died more than ingest.max_restarts={ic.max_restarts} times within "
                                  f"ingest.restart_window_s={ic.restart_window_s:g} s, also in a process of its own")
                continue
            lease.remote.state = "reconnecting"
            lease.remote.reconnects += 1
            tail = "; moved to a process of its own (it died too often)" if decision == "isolate" else "; restarting"
            self._emit(stream, "reconnecting", why + tail)
            again.append(lease)
        for lease in again:
            self._place(lease)

    # -- shutdown -----------------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Every process told to exit, joined (killed past `timeout`), every segment unlinked, sockets closed."""
        if self._closing:
            return
        self._closing = True
        self._submit(("stop", ""))
        self._thread.join(2.0)
        t_end = time.monotonic() + timeout
        for proc in list(self._procs.values()):
            if proc.ready:
                self._send(proc, [wire.Exit()])
        if not self._thread.is_alive():  # this thread is the poller's only user now
            self._read_until_exited(t_end)
        for proc in list(self._procs.values()):
            proc.handle.join(max(0.1, t_end - time.monotonic()))
            if proc.handle.is_alive():
                log.warning("ingest: %s did not exit in time: killed", proc.label)
                proc.handle.kill()
                proc.handle.join(2.0)
            proc.cmd.close(0)
        self._procs.clear()
        for lease in list(self._leases.values()):
            if lease.segment is not None:
                lease.segment.unlink()
            lease.ring.on_free = None
            lease.remote._ended.set()
        for name in _segments_of(self._run):  # one whose creation failed half-way, or a lease never ended
            Segment.remove(name)
        for reader in list(self._readers.values()) + [r for what, r in list(self._inbox) if what == "reader"]:
            reader.close()  # and a test's uplink the I/O thread never registered
        self._readers.clear()
        self._ctx.term()
        efd, self._efd = self._efd, -1  # a late _submit writes to -1: an OSError it ignores, never a reused fd
        os.close(efd)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _read_until_exited(self, t_end: float) -> None:
        """Read and let go of what the processes still send until they have exited (or `t_end`): the I/O thread has
        stopped, and a process whose uplink's buffer filled would have its stream threads, and its main thread's
        heartbeat, blocked in a send, unable to stop: killed at the timeout. Nothing read now is committed (the
        engine's rings are closed by now; a frame never committed was never ingested)."""
        procs = list(self._procs.values())
        while time.monotonic() < t_end and any(p.handle.is_alive() for p in procs):
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


def _child_main(*args) -> None:
    from engine.ingest.process import main
    main(*args)
