"""The ingest process: today's IngestThread per stream, writing into slots the core lent it.

Started by the core (client.py) with multiprocessing's forkserver context, `av` and `numpy` preloaded in the
server, so a child starts in milliseconds and never forks a process that has threads. No torch for CPU
decoders: frames are numpy arrays (or a decoder's planes, convert.NV12Planes) copied into the core's
shared-memory slots. A stream the core sent with decode auto/cuda (ingest.gpu_transport shm) decodes with NVDEC
here (torch imported by its source) and its NV12 CUDA frames are copied into the same host slots (_download).
RemoteRing also takes such frames into a CUDA IPC pool the core exported (wire.CudaSlots, cuda_slots.py), which
the core does not lend yet. Both GPU paths have run on the CPU with fakes only.

Threads (vLLM's EngineCoreProc shape): the main thread receives commands (add, remove, slots, credits) and
sends heartbeats with every stream's state; one IngestThread per stream decodes and writes. The streams'
threads and the main thread send on the process's uplink (uplink.py), each send one atomic packet: no lock,
and no thread of its own (a queue would cost a wake-up per frame). The process exits when the core dies (its
parent sentinel).
"""

from __future__ import annotations

import gc
import importlib
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Optional

import numpy as np
import zmq

from engine.errors import SourceError
from engine.frames.ingest import IngestThread
from engine.frames.lifecycle import DropReason, FrameMeta
from engine.ingest import wire
from engine.ingest.slots import Segment, check_name
from streams.convert import NV12Planes

log = logging.getLogger("vidar.ingest")


class _Sender:
    """The process's end of its uplink (uplink.py), shared by its threads: a send is one atomic packet, so no
    lock (under a lock, a sender waiting to retake the GIL after its send held up every other sender). Blocks
    while the socket's buffer is full (the core is not reading). The core gone (its end closed: EPIPE), the
    first thread to see it calls `on_gone`, which does not return (main(): the process cleans up and exits, as
    the parent watch would a moment later; a stream thread must not end its stream first, which would hide its
    segment from that clean-up)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self.on_gone: Any = None

    def __call__(self, msg: Any) -> None:
        try:
            self._sock.send(wire.encode(msg), socket.MSG_NOSIGNAL)
        except (BrokenPipeError, ConnectionResetError):
            if self.on_gone is not None:
                self.on_gone()
            raise


class RemoteRing:
    """The IngestThread's sink in a process: write() copies a frame into a lent slot of the core's segment and
    sends FrameReady. Live without a credit: the frame is dropped here, before any copy, and counted
    (ring_full, reported in every FrameReady and StreamState). Offline: waits for a credit, so back-pressure
    reaches the decoder. A new frame size asks the core for new slots (Geometry) and drops its credits."""

    #: a CPU decoder's NV12 frames come as convert.NV12Planes, written by write() straight into the slot
    takes_planes = True

    def __init__(self, stream: str, *, live: bool, gen: int, send: _Sender, max_frame_pixels: int, run: str = "",
                 pixel_format: str = "rgb24"):
        self.stream, self.live, self._send, self._max_pixels, self._run = stream, live, send, max_frame_pixels, run
        self.pixel_format = pixel_format  # of the host frames and slots (AddStream.pixel_format, slots.slot_shape)
        self._cond = threading.Condition()
        self._gen = gen
        self._credits: deque[int] = deque()
        self._segment: Optional[Segment] = None
        self._asked: Optional[tuple[int, int]] = None  # the geometry last asked for
        self._closed = False
        self.cuda_ops: Any = None     # tests: a fake of torch.cuda (engine/testing/fake_cuda.py); None: torch.cuda
        self._cuda: Any = None
        self._copy_stream: Any = None
        self.dropped = 0     # dropped at the source (no credit), this lease
        self.expired = 0     # dropped at the source past their deadline (IngestThread), this lease
        self.overwrites = 0  # what RingGroup/IngestThread callers read

    # -- commands (the process's main thread) ----------------------------------------------------------------
    def attach(self, msg: Any) -> None:
        """The core's slots for the stream's frames: a shared-memory segment (wire.Slots), or a CUDA IPC pool
        (wire.CudaSlots, NVDEC frames; cuda_slots.py, not run on a GPU yet), opened once here."""
        if isinstance(msg, wire.CudaSlots):
            from engine.ingest import cuda_slots  # torch only in a process that has an NVDEC stream
            if self._cuda is None:
                self._cuda = cuda_slots.TorchIpc() if self.cuda_ops is None else self.cuda_ops
                self._copy_stream = self._cuda.Stream()  # the process's copies, off the decoder's stream
            seg: Any = cuda_slots.AttachedSlots.open(msg, self._cuda)
            if self._segment is not None:
                # copies into the pool being replaced may still be queued on the copy stream (one waits on the
                # core's released[slot]: a model batch); dropping its mapping first lets them write memory the core
                # may free and reuse: torch's IPC deleter syncs the current stream only, not this one
                self._copy_stream.synchronize()
        else:
            check_name(msg.name, self._run, self.stream)  # ValueError: the caller refuses the Slots
            seg = Segment(msg.name, msg.count, msg.h, msg.w, create=False, pixel_format=self.pixel_format)
        with self._cond:
            self._segment, self._gen = seg, msg.gen
            self._credits.clear()  # the core took every lent slot back with this geometry
            self._cond.notify_all()

    def attach_failed(self, gen: int) -> None:
        """The slots of `gen` could not be opened here: the next frame asks for slots again, under that gen."""
        with self._cond:
            self._segment, self._gen, self._asked = None, gen, None
            self._credits.clear()

    def credit(self, msg: wire.Credit) -> None:
        with self._cond:
            if msg.gen == self._gen:  # credits of an older lease or geometry are the core's again
                self._credits.extend(msg.slots)
                self._cond.notify_all()

    def has_slot(self, h: int, w: int) -> bool:
        """Whether write() would take a live frame of h x w now (Source.wants): False only while slots of that size
        are attached and every one is lent out. Read without the lock: only this stream's thread takes a credit,
        and a credit arriving just after is what write() would have missed a moment later too."""
        seg = self._segment
        return seg is None or (seg.h, seg.w) != (h, w) or bool(self._credits) or self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drop_at_source(self, n: int, reason: DropReason) -> None:
        """The stream's IngestThread dropped n frames before writing them (past their deadline): reported with
        the next FrameReady or StreamState, counted in the core's ledger then."""
        if reason is DropReason.DEADLINE:
            self.expired += n
        else:
            self.dropped += n

    # -- the stream's IngestThread -------------------------------------------------------------------------
    def write(self, meta: FrameMeta, frame: Any, stop: Optional[threading.Event] = None, ready: Any = None) -> bool:
        h, w = self._frame_size(frame, ready)
        if h * w > self._max_pixels:
            raise SourceError(self.stream, f"frame {w}x{h} exceeds ring.max_frame_pixels={self._max_pixels}; "
                                           "raise it if this stream is really that large")
        while True:
            ask = None
            with self._cond:
                if self._closed:
                    return False
                seg = self._segment
                if seg is None or (seg.h, seg.w) != (h, w):
                    if self._asked != (h, w):
                        self._asked = (h, w)
                        self._segment = seg = None
                        self._credits.clear()
                        ask = wire.Geometry(self.stream, self._gen, h, w)
                elif self._credits:
                    slot, gen = self._credits.popleft(), self._gen
                    break
                if ask is None:
                    if self.live:
                        self.dropped += 1  # shed here, before the copy: counted ring_full in the core's ledger
                        return True
                    self._cond.wait(0.1)
                    if stop is not None and stop.is_set():
                        return False
            if ask is not None:  # sent without the condition held: a send that blocks holds up only this stream
                self._send(ask)
        if isinstance(seg, Segment):
            if isinstance(frame, NV12Planes):  # a CPU decoder's planes, straight into the slot in one pass
                frame.write_into(seg.array[slot])
            elif ready is not None or not isinstance(frame, np.ndarray):  # NVDEC's NV12 (GPU), into host slots
                try:
                    _download(frame, ready, seg.array[slot])
                except ValueError as err:  # the stream fails with the reason (its IngestThread), never half written
                    with self._cond:
                        self._credits.appendleft(slot)
                    raise SourceError(self.stream, str(err)) from None
            else:
                np.copyto(seg.array[slot], frame)  # the frame's one copy, into the core's memory
        else:  # NVDEC: queued on the GPU after `ready` and the core's released[slot]; written[slot] recorded
            seg.write(slot, frame, ready, self._copy_stream, self._cuda)
        d = math.inf if not math.isfinite(meta.deadline) else meta.deadline
        self._send(wire.FrameReady(self.stream, slot, gen, meta.seq, meta.pts, meta.t_capture, meta.t_capture_mono,
                                   d, meta.decode_s, h, w, tuple(meta.colour), self.dropped, time.monotonic(),
                                   self.expired))
        return True


    def _frame_size(self, frame: Any, ready: Any) -> tuple[int, int]:
        """(h, w) of an RGB numpy frame (PyAV), or of an NV12 CUDA tensor (NVDEC, with its `ready` event)."""
        torch = sys.modules.get("torch")  # never imported for this: a frame cannot be a tensor without it
        if torch is not None and isinstance(frame, torch.Tensor):
            if frame.dim() == 2 and frame.dtype == torch.uint8 and frame.shape[0] % 3 == 0 and frame.shape[1] % 2 == 0:
                return int(frame.shape[0]) * 2 // 3, int(frame.shape[1])
            expected = "an NV12 uint8 tensor of (H * 3 // 2, W) with even H and W"
        elif ready is None and self.pixel_format == "rgb24" and isinstance(frame, np.ndarray) and frame.ndim == 3 \
                and frame.shape[2] == 3 and frame.dtype == np.uint8:
            return int(frame.shape[0]), int(frame.shape[1])
        elif ready is None and self.pixel_format == "nv12" and isinstance(frame, (np.ndarray, NV12Planes)) \
                and frame.ndim == 2 and frame.dtype == np.uint8 and frame.shape[0] % 3 == 0 and frame.shape[1] % 2 == 0:
            return int(frame.shape[0]) * 2 // 3, int(frame.shape[1])
        else:
            expected = ("an (H * 3 // 2, W) uint8 NV12 numpy array" if self.pixel_format == "nv12" else
                        "an HxWx3 uint8 numpy array (rgb24)") + " or an NV12 uint8 CUDA tensor"
        what = f"{frame.dtype} {tuple(frame.shape)}" if hasattr(frame, "shape") else type(frame).__name__
        raise SourceError(self.stream, f"decoder produced {what}, expected {expected}")


def _cuda_context() -> bool:
    """Whether this process holds a CUDA context (an NVDEC stream opened here, its fallback to the CPU or not)."""
    nvdec = sys.modules.get("streams.nvdec")
    return nvdec is not None and nvdec.cuda_ops.initialized()


def _download(frame: Any, ready: Any, dst: np.ndarray) -> None:
    """NVDEC's NV12 frame (a CUDA tensor, valid once `ready` fired) into a host slot (ingest.gpu_transport shm).
    The host waits for the decoder's copy-out first: the copy below runs on this thread's current stream, which
    is not the decoder's. Into pageable memory (the slot is /dev/shm) the driver stages the copy and returns when
    it is done, so the FrameReady sent next never points at a slot still being written. Not run on a GPU yet."""
    import torch  # only a process that decodes on the GPU gets here (torch is imported by its NVDEC source)

    if tuple(frame.shape) != dst.shape:  # NVDEC's NV12 into slots of another layout (the core chose RGB)
        raise ValueError(f"an NV12 frame {tuple(frame.shape)} from the GPU does not fit a slot of {dst.shape}")
    if ready is not None:
        ready.synchronize()
    torch.from_numpy(dst).copy_(frame)


class _Stream(IngestThread):
    """IngestThread unchanged, plus a final StreamState once it has ended (after its last FrameReady)."""

    def __init__(self, *args, on_end, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_end = on_end

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            self._on_end(self)


def _state(s: IngestThread, gen: int, final: bool = False) -> wire.StreamState:
    src = s.source
    return wire.StreamState(s.stream, gen, s.state, s.failed, wire.clip(s.end_reason), s.total_frames, s.reconnects,
                            src.decode_errors, s.seq, s.ring.dropped, src.decode_device, wire.clip(src.decode_reason),
                            final, s.ring.expired, s.lag_s)


class _Child:
    def __init__(self, proc: int, send: _Sender, run: str = ""):
        self.proc, self._send, self.run = proc, send, run
        self.streams: dict[str, tuple[_Stream, int]] = {}  # stream -> (thread, lease gen)
        self._lock = threading.Lock()
        self.bad_commands = 0  # commands that did not decode or could not be applied (main thread only)

    def add(self, msg: wire.AddStream) -> None:
        from engine.config import SourceConfig, StreamConfig
        import streams.sources as sources  # looked up at call time: a test's hook may wrap open_source
        scfg = StreamConfig.model_validate(msg.config)  # revalidated on arrival: the wire is not trusted blindly
        src = SourceConfig.model_validate(msg.source)
        live = scfg.mode == "live"
        emit = lambda stream, kind, reason: self._send(wire.StreamEvent(stream, kind, wire.clip(reason), msg.gen))  # noqa: E731
        try:
            source = sources.open_source(scfg.id, scfg.url, open_timeout_s=src.open_timeout_s,
                                         read_timeout_s=src.stall_timeout_s / 2, max_frame_pixels=msg.max_frame_pixels,
                                         decode=msg.decode)
        except SourceError as err:  # checked by the core already: a file gone since, say
            self.refuse(msg, err.reason)
            return
        try:
            if msg.pixel_format not in source.host_formats:  # the core chose it from this source's kind
                raise ValueError(f"pixel format {msg.pixel_format!r}: this source hands out {source.host_formats}")
            source.pixel_format = msg.pixel_format
            ring = RemoteRing(scfg.id, live=live, gen=msg.gen, send=self._send, max_frame_pixels=msg.max_frame_pixels,
                              run=self.run, pixel_format=msg.pixel_format)
            t = _Stream(source, ring, live=live, loop=scfg.loop, budget_s=msg.budget_s, emit=emit,
                        reconnect_initial_s=src.reconnect_initial_s, reconnect_max_s=src.reconnect_max_s,
                        backoff_reset_after_s=src.backoff_reset_after_s, on_end=self._ended)
            t.seq = msg.start_seq  # seq continues across a restart of the process
            with self._lock:
                self.streams[scfg.id] = (t, msg.gen)
            t.start()
        except BaseException:  # the caller fails the stream; its opened decoder is not left behind
            source.close()
            raise

    def refuse(self, msg: wire.AddStream, reason: str) -> None:
        """The stream cannot run here: its error event, then its final state (failed)."""
        with self._lock:
            if self.streams.get(msg.stream, (None, None))[1] == msg.gen:  # its own entry, never an older one's
                del self.streams[msg.stream]
        self._send(wire.StreamEvent(msg.stream, "error", wire.clip(reason), msg.gen))
        self._send(wire.StreamState(msg.stream, msg.gen, "failed", True, wire.clip(f"error: {reason}"), None, 0, 0,
                                    msg.start_seq, 0, final=True))

    def _ended(self, t: _Stream) -> None:
        with self._lock:
            entry = self.streams.get(t.stream)
            if entry is not None and entry[0] is t:  # a newer add of the same id keeps its entry
                del self.streams[t.stream]
            gen = t.ring._gen
        if t.state != "failed":
            t.state = "ended"
        self._send(_state(t, gen, final=True))

    def ring(self, stream: str) -> Optional[RemoteRing]:
        with self._lock:
            entry = self.streams.get(stream)
        return entry[0].ring if entry else None

    def bad_command(self, err: BaseException) -> None:
        """A command that did not decode or could not be applied: counted (sent with every heartbeat), logged
        for the first few and then every 1,000th."""
        self.bad_commands += 1
        if self.bad_commands <= 3 or self.bad_commands % 1000 == 0:
            log.warning("ignored a command (%d so far): %s: %s", self.bad_commands, type(err).__name__, err)

    def heartbeat(self, gen: int) -> None:
        self._send(wire.Heartbeat(self.proc, gen, time.monotonic(), self.bad_commands, _cuda_context()))
        with self._lock:
            entries = list(self.streams.values())
        for t, g in entries:
            self._send(_state(t, g))

    def stop_all(self, timeout: float) -> None:
        with self._lock:
            entries = list(self.streams.values())
        for t, _ in entries:
            t.stop()
        t_end = time.monotonic() + timeout
        for t, _ in entries:
            t.join(max(0.0, t_end - time.monotonic()))


def _commands(child: _Child, cmd: zmq.Socket, proc: int) -> bool:
    """Apply every command waiting (a wake-up each would cost a poll and a GIL retake per message). True: exit.
    A command that does not decode, or whose handling raises, is counted (Heartbeat.bad_commands) and skipped:
    never the end of the process and of its other streams."""
    for _ in range(1024):  # bounded: the heartbeat goes out between batches
        try:
            msg = wire.decode(cmd.recv(zmq.NOBLOCK))
        except zmq.Again:
            return False
        except wire.WireError as err:
            child.bad_command(err)
            continue
        try:
            if _command(child, msg, proc):
                return True
        except Exception as err:  # noqa: BLE001 -- one command's failure is counted, the process goes on
            child.bad_command(err)
    return False


def _command(child: _Child, msg: Any, proc: int) -> bool:
    """One command applied. True: exit."""
    if isinstance(msg, wire.Exit):
        return True
    if isinstance(msg, wire.AddStream):
        try:
            child.add(msg)
        except Exception as err:  # noqa: BLE001 -- one stream's bad add (a config that no longer
            # validates, a thread that cannot start) fails that stream, never the process and its others
            child.refuse(msg, f"cannot start in ingest-{proc}: {type(err).__name__}: {err}")
    elif isinstance(msg, wire.RemoveStream):
        entry = child.streams.get(msg.stream)
        if entry is not None:
            entry[0].stop()
    elif isinstance(msg, (wire.Credit, wire.Credits)):
        for c in msg.credits if isinstance(msg, wire.Credits) else [msg]:
            if (ring := child.ring(c.stream)) is not None:
                ring.credit(c)
    elif isinstance(msg, (wire.Slots, wire.CudaSlots)):
        ring = child.ring(msg.stream)
        if ring is None:
            return False
        try:
            ring.attach(msg)
        except (OSError, RuntimeError, ValueError) as err:  # the segment went (its stream was removed
            # meanwhile: the core knows), a name that is not ours, or a CUDA IPC open failed (RuntimeError)
            log.warning("stream %s: cannot attach its slots: %s", msg.stream, err)
            ring.attach_failed(msg.gen)
    else:  # an up message sent down
        child.bad_command(wire.WireError(f"{type(msg).__name__} is not a command"))
    return False




def main(proc: int, gen: int, up: socket.socket, cmd_addr: str, heartbeat_s: float, nice: int,
         imports: list[str], run: str) -> None:
    """The process's entry point (multiprocessing target). `up`: its end of the uplink (uplink.pair); `run`: the
    engine's run, which names every segment it may be told to attach (slots.check_name)."""
    # Ctrl-C in a terminal signals the whole process group, and systemd's stop the whole cgroup: an ingest process
    # that died of it mid-drain was taken for a crash and restarted. The core owns the shutdown: it tells each
    # process to exit (wire.Exit), and a process whose core is gone exits by itself (the parent watch below).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if nice:  # the core first: it holds frames already paid for (see IngestConfig.nice)
        os.nice(nice)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s ingest-{proc} %(levelname)s %(name)s: %(message)s")
    for name in imports:  # test hooks only (procs.TEST_IMPORTS): the product passes none
        importlib.import_module(name)
    ctx = zmq.Context()
    # this process binds and the engine connects (never the other way: see client.IngestHub)
    cmd = ctx.socket(zmq.PULL)
    cmd.bind(cmd_addr)
    send = _Sender(up)
    child = _Child(proc, send, run)
    def core_gone() -> None:  # the engine's slots are its watcher's to remove (janitor.py), never a child's
        os._exit(0)
    send.on_gone = core_gone  # a send that finds the core's end closed (EPIPE): the core died
    parent = multiprocessing.parent_process()
    if parent is not None:  # the core died: no one reads our frames; exit now (the streams are the core's)
        def watch() -> None:
            wait([parent.sentinel])
            core_gone()
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    gc.collect(1)
    gc.freeze()  # what start-up built (av, numpy, zmq) is left out of later collections: engine/util/gc_pause.py
    send(wire.Ready(proc, gen, os.getpid()))
    last_beat = 0.0
    try:
        while True:
            now = time.monotonic()
            if now - last_beat >= heartbeat_s:
                child.heartbeat(gen)
                last_beat = now
            if not cmd.poll(max(1, int((last_beat + heartbeat_s - time.monotonic()) * 1000))):
                continue
            if _commands(child, cmd, proc):
                break
    except BaseException:
        # Not the engine's Exit: a death, never an end. Its streams' final states would read as ends of stream
        # in the engine, which would then neither restart nor report them; exiting now, none is sent, and the
        # engine sees a process gone (exit code 70), restarts its streams and says why.
        log.exception("ingest-%d: main loop failed: exiting without ending its streams", proc)
        os._exit(70)
    child.stop_all(timeout=5.0)
    cmd.close(0)
    ctx.term()
    up.close()  # what was sent is in the core's end already: it reads it up to the end of file
