"""CUDA IPC frame slots for NVDEC streams decoded in ingest processes (issue 33 item 8). NOT RUN ON A GPU YET:
every line here has run on the CPU only, against engine/testing/fake_cuda.py; benchmarks/gpu_check.py
`--only ingest_gpu` is the part that would run it on a device.

The pattern is the one torch.multiprocessing and LMCache use (../shared/host/STYLE-processes.md, section 8):
  * The core allocates the memory and outlives the writers: one CUDA block per ring and geometry, sliced into
    NV12 slots (count, H * 3 // 2, W). Per ring, as slots.py does for host memory, and for the same reason: a
    stream's size may change mid-run, and a block per geometry needs no allocator for slots of mixed sizes;
    frames still held in the old block stay valid until released (the core keeps the old pool alive until
    then). A stream moving to another process (a restart) keeps its block: only the export is made again.
  * Exported once per attaching process (`CudaSlotPool.export`), never per frame: the block through torch's
    own reduce/rebuild pair (`torch.multiprocessing.reductions.reduce_tensor` / `rebuild_cuda_tensor`, what a
    torch.multiprocessing queue does with a CUDA tensor), its fields carried in a typed wire message rather
    than a pickle (wire.py lets no pickle cross); torch's rebuild caches the opened handle, which CUDA lets a
    process open once per context ("cudaIpcMemHandles ... may only be opened by one context per device per
    other process"). torch's docs: "the sending process is required to keep the original tensor": the pool
    holds it until `close()`, which the core calls only once no process and no frame uses it.
  * Two interprocess events per slot, created once with the pool (`torch.cuda.Event(interprocess=True)`),
    never per frame (pytorch/tensorpipe #321: creating and destroying CUDA IPC events risks a driver deadlock):
    `written[i]`, recorded by the ingest after its device-to-device copy into slot i; `released[i]`, recorded
    by the core after the slot's last reader's kernels. The ingest's next write into slot i waits `released[i]`
    on its own stream (a GPU wait, never a host sync).
  * The core never makes its own CUDA streams wait on an event another process records: such an event may
    never complete (a producer whose stream hangs, or dies with the copy queued) and would wedge every kernel
    behind it. The core polls `written[i].query()` on the host, in its ingest-io thread (`PendingFrames`), and
    commits the frame only once it is true. Readers then wait on `admitted[i]`, a plain event of the core's
    own (one per slot, also created once) recorded on the core's copy stream at commit: complete at once,
    and never re-recorded by anyone else, so a confused producer recording `written[i]` again cannot stall a
    reader either.
  * What CUDA does not give: a query of an event that was never recorded returns "complete". So a FrameReady
    is what says the copy was queued (the ingest records `written[i]` before it sends it); a FrameReady whose
    record never completes is held (never committed, never waited on by a core stream) and dropped, its slot
    reclaimed, when its producer dies or the ring moves on.

`cuda` below is torch.cuda's Stream/Event/stream() plus the two IPC calls (`TorchIpc`), or the fake of
engine/testing/fake_cuda.py: the same code runs either way.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from engine.ingest import wire

log = logging.getLogger("vidar.ingest")


class TorchIpc:
    """torch.cuda as the pool uses it, plus exporting and opening a block. The only code here that needs a GPU."""

    def __init__(self) -> None:
        self.Stream, self.Event, self.stream = torch.cuda.Stream, torch.cuda.Event, torch.cuda.stream

    @staticmethod
    def open_event(device: int, handle: bytes) -> Any:
        return torch.cuda.Event.from_ipc_handle(device, handle)

    @staticmethod
    def export_block(block: torch.Tensor) -> dict[str, Any]:
        """The fields torch's reduce_tensor gives for a CUDA tensor, minus the ones fixed here (classes, dtype):
        what a torch.multiprocessing queue would pickle, carried as plain values instead."""
        from torch.multiprocessing.reductions import reduce_tensor
        _, args = reduce_tensor(block)
        (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _, rc_handle, rc_offset,
         ev_handle, ev_sync) = args
        return {"shape": list(size), "stride": list(stride), "offset": offset, "device": device, "handle": handle,
                "storage_bytes": storage_bytes, "storage_offset": storage_offset, "ref_counter": rc_handle,
                "ref_counter_offset": rc_offset, "event": ev_handle or b"", "event_sync": bool(ev_sync)}

    @staticmethod
    def open_block(f: dict[str, Any]) -> torch.Tensor:
        """torch's own rebuild (it caches the opened handle: a process opens it once per context)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        return rebuild_cuda_tensor(torch.Tensor, torch.Size(f["shape"]), tuple(f["stride"]), f["offset"],
                                   torch.UntypedStorage, torch.uint8, f["device"], f["handle"], f["storage_bytes"],
                                   f["storage_offset"], False, f["ref_counter"], f["ref_counter_offset"],
                                   f["event"] or None, f["event_sync"])


def expandable_segments() -> bool:
    """Whether torch's allocator shares blocks as expandable segments (PYTORCH_CUDA_ALLOC_CONF, read by torch at its
    first CUDA allocation): an attach in another process then needs pidfd_getfd on the core
    (c10/cuda/CUDACachingAllocator.cpp ExpandableSegment::fromShared)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    opts = dict(o.split(":", 1) for o in conf.replace(" ", "").split(",") if ":" in o)
    return opts.get("expandable_segments", "").lower() in ("true", "1")


class CudaSlotPool:
    """The core's side of one ring's CUDA slots of one geometry: the block, its per-slot events, the export.
    It is what `FrameRing.set_geometry` maps (engine/frames/storage.DeviceSharedSlots)."""

    def __init__(self, name: str, count: int, h: int, w: int, *, device: Any = 0, cuda: Any = None):
        if h % 2 or w % 2:
            raise ValueError(f"{name}: NV12 slots need an even size, not {w}x{h}")
        if expandable_segments():
            raise ValueError(f"{name}: CUDA IPC slots cannot be shared with PYTORCH_CUDA_ALLOC_CONF="
                             f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}: with expandable_segments torch shares a "
                             "block through pidfd_getfd, which ptrace rules and Docker's seccomp deny to an ingest "
                             "process; unset expandable_segments for vidar")
        self.name, self.count, self.h, self.w = name, count, h, w
        self.cuda = cuda if cuda is not None else TorchIpc()
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.device = dev
        # one allocation for all slots; the core keeps it until close() (torch: the sender keeps the tensor)
        self.block = torch.empty((count, h * 3 // 2, w), dtype=torch.uint8, device=dev)
        # created here, once: never per frame (tensorpipe #321)
        self.written = [self.cuda.Event(interprocess=True) for _ in range(count)]
        self.released = [self.cuda.Event(interprocess=True) for _ in range(count)]
        self.admitted = [self.cuda.Event() for _ in range(count)]  # the core's own: what its readers wait on
        self.frame_bytes = h * w * 3 // 2

    @property
    def array(self) -> torch.Tensor:  # what SharedHostSlots calls a segment's array: the slots' views
        return self.block

    def export(self, stream: str, gen: int) -> wire.CudaSlots:
        """The attach message for one process (once per process and pool: each export is opened once)."""
        f = self.cuda.export_block(self.block)
        gpu = self.device.index or 0
        return wire.CudaSlots(stream, gen, self.name, self.count, self.h, self.w, gpu, f["handle"],
                              f["storage_bytes"], f["storage_offset"], f["offset"], f["ref_counter"],
                              f["ref_counter_offset"], f["event"], f["event_sync"],
                              [e.ipc_handle() for e in self.written], [e.ipc_handle() for e in self.released])

    def unlink(self) -> None:
        """What slots.Segment.unlink is for host memory: nothing to do for a CUDA block, which lives as long as a
        view of it (a held frame) or an open handle in a process does; torch's IPC ref counter keeps the block
        from reuse until every process that opened it has let it go."""


@dataclass
class AttachedSlots:
    """An ingest process's side of a pool: the opened block and events (opened once, at attach)."""
    msg: wire.CudaSlots
    block: torch.Tensor
    written: list[Any]
    released: list[Any]

    @classmethod
    def open(cls, msg: wire.CudaSlots, cuda: Any = None) -> "AttachedSlots":
        cuda = cuda if cuda is not None else TorchIpc()
        shape = [msg.count, msg.h * 3 // 2, msg.w]
        stride = [shape[1] * shape[2], shape[2], 1]
        block = cuda.open_block({"shape": shape, "stride": stride, "offset": msg.tensor_offset, "device": msg.gpu,
                                 "handle": msg.handle, "storage_bytes": msg.storage_bytes,
                                 "storage_offset": msg.storage_offset, "ref_counter": msg.ref_counter,
                                 "ref_counter_offset": msg.ref_counter_offset, "event": msg.event,
                                 "event_sync": msg.event_sync})
        if len(msg.written) != msg.count or len(msg.released) != msg.count:
            raise ValueError(f"stream {msg.stream}: {msg.count} slots but {len(msg.written)} written and "
                             f"{len(msg.released)} released events")
        return cls(msg, block, [cuda.open_event(msg.gpu, h) for h in msg.written],
                   [cuda.open_event(msg.gpu, h) for h in msg.released])

    @property
    def h(self) -> int:
        return self.msg.h

    @property
    def w(self) -> int:
        return self.msg.w

    def write(self, slot: int, frame: torch.Tensor, ready: Any, stream: Any, cuda: Any) -> None:
        """Queue the frame's copy into `slot` on `stream` (the ingest's copy stream): after the decoder's `ready`
        and the core's `released[slot]` (GPU waits: the host never blocks), then record `written[slot]`.
        The caller sends FrameReady after this returns (the record is queued by then)."""
        with cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            # A never-recorded event is complete for CUDA: the slot's first write does not wait
            stream.wait_event(self.released[slot])
            self.block[slot].copy_(frame, non_blocking=True)
            self.written[slot].record(stream)
        # the decoder may free its tensor once we drop it: not before this stream's copy has read it
        if hasattr(frame, "record_stream") and frame.device.type == "cuda":
            frame.record_stream(stream)


@dataclass
class _Held:
    stream: str
    gen: int
    slot: int
    event: Any
    commit: Callable[[], bool]


@dataclass
class PendingFrames:
    """The core's host poll of `written[i]` (in the ingest-io thread): descriptors whose copy the GPU has not
    finished yet wait here, never on a core stream. `poll()` commits the finished ones in arrival order per
    stream (a frame is never admitted ahead of an older one of its stream still copying)."""
    held: list[_Held] = field(default_factory=list)
    dropped: int = 0   # held descriptors dropped unadmitted (their producer died or their lease moved on)
    #: streams whose written event raised on query, with why: their descriptors are dropped here, and the owner
    #: (the ingest hub) stops each such stream with `take_failed` (never the I/O thread, never the engine)
    failed: dict[str, str] = field(default_factory=dict)

    def add(self, stream: str, gen: int, slot: int, event: Any, commit: Callable[[], bool]) -> bool:
        """Commit now if nothing of its stream waits and its copy is done; else hold it. True if committed.
        `event` None: the slot is not lent (a stale or forged descriptor): commit() checks and refuses it."""
        if event is None:
            return bool(commit())
        if stream in self.failed:  # its copies cannot be checked any more: never admitted, counted
            self.dropped += 1
            return False
        if not any(h.stream == stream for h in self.held):
            done = self._done(stream, event)
            if done is None:
                self.dropped += 1
                return False
            if done:
                return bool(commit())
        self.held.append(_Held(stream, gen, slot, event, commit))
        return False

    def poll(self) -> int:
        """Commit every held frame whose copy completed (a host query each, no wait). Returns how many."""
        n, keep, blocked = 0, [], set()
        for h in self.held:
            done = None if h.stream in self.failed else (h.stream not in blocked and self._done(h.stream, h.event))
            if done is None:
                self.dropped += 1  # its stream's copies cannot be checked: dropped unadmitted (take_failed)
            elif done:
                h.commit()
                n += 1
            else:
                blocked.add(h.stream)
                keep.append(h)
        self.held = keep
        return n

    def _done(self, stream: str, event: Any) -> Optional[bool]:
        """The event's host query; None when it raised: torch raises for every CUDA error but "not ready"
        (c10/cuda/CUDAEvent.h), and an interprocess event last recorded by a process that died is undefined
        (CUDA's cudaIpcOpenEventHandle docs). Raising here would end the ingest I/O thread, and so the engine,
        for one stream's event."""
        try:
            return bool(event.query())
        except Exception as err:  # noqa: BLE001 -- any error of one stream's event fails that stream only
            why = f"{type(err).__name__}: {err}"[:300]
            if stream not in self.failed:
                log.error("stream %s: querying its GPU copy's event raised (%s): its frames in flight are dropped "
                          "and the stream is stopped", stream, why)
            self.failed.setdefault(stream, why)
            return None

    def take_failed(self) -> dict[str, str]:
        """The streams whose event raised since the last call (stream -> why), for their owner to stop."""
        out, self.failed = self.failed, {}
        return out

    def forget(self, stream: str, below_gen: Optional[int] = None) -> int:
        """Drop the stream's held descriptors (all, or those of a generation below `below_gen`): their producer
        died or the slots were taken back. The slots are reclaimed by the ring (FrameRing.reclaim). Counted."""
        gone = [h for h in self.held if h.stream == stream and (below_gen is None or h.gen < below_gen)]
        if gone:
            self.held = [h for h in self.held if h not in gone]
            self.dropped += len(gone)
            log.warning("stream %s: %d frame(s) whose GPU copy never completed dropped unadmitted", stream, len(gone))
        return len(gone)
