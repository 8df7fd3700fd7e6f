"""SlotStorage: the one interface to the memory of a ring's slots.

The ring (ring.py) owns the slots' states, the budget and the accounting; it asks its storage for
memory only: allocate slot i at h x w, copy a decoded frame in, the tensor a reader reads, free
slot i. Four implementations:
  * HostSlots: uint8 (H, W, 3) RGB host tensors in ordinary (pageable) memory. CPU-decoded frames (PyAV)
    land here. Never pinned, also on a GPU machine: no upload reads a slot (a runner copies its batch's host
    frames into its own pinned staging buffer, batch_preprocess.py, or `exact` reads them through PIL), so
    pinning bought nothing and cost cudaHostAlloc (rounded up by torch's caching host allocator: 48 720p
    streams held ~3 GB locked, outside ring.total_memory_mb's count).
  * DeviceSlots: uint8 (H * 3 // 2, W) NV12 tensors in GPU memory. NVDEC frames land here with a
    device-to-device copy on the ring's own CUDA stream: no pixel crosses the host.
  * SharedHostSlots: host slots in a shared-memory segment the core created, written by an ingest process
    (engine/ingest, issue 33); the core only reads them. RGB, or (H * 3 // 2, W) NV12 for a stream whose pool
    converts NV12 itself or reads no pixels (the stream table's choice, stream_table.py `_pixel_format`): the
    decoder then skips the colour conversion, which was half of a 240p frame's decode cost, and half the bytes
    cross.
  * DeviceSharedSlots: NV12 slots in a CUDA block the core created and exported to an ingest process (CUDA IPC,
    engine/ingest/cuda_slots.py; not run on a GPU yet), ordered by interprocess events; the core only reads them.
Only engine/frames, the ingest processes and the model runners touch pixels.

Ordering without host syncs (DeviceSlots): a write waits (on the GPU) for the decoder's event
(the frame is written) and for the slot's release event (the last reader's kernels are done with
it), then records the slot's `ready` event, which a reader's stream waits on before reading.
HostSlots needs no ordering: every reader has read a host slot on the host before it releases it, so a
release event handed to it (a mixed batch's, for its NV12 frames) is dropped, and the ingest thread never
waits on the GPU.

Not thread-safe by itself: the ring calls it under its lock, except the writer's allocation of and copy
into a slot it reserved (WRITING) and the readers' views of slots they hold (CLAIMED), which nobody else
touches. Nothing is allocated under the ring's lock: it is the pool's ledger lock, which every ingest thread
and the engine core share.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Optional

import numpy as np
import torch


class SlotStorage(ABC):
    """Memory for a fixed number of slots, each holding one frame of some h x w (sizes may differ
    while a stream changes size: a slot keeps its old size until it is freed)."""

    #: the pixel format of the frames it holds (FrameMeta.pixel_format): "rgb24" | "nv12"
    pixel_format: str = "rgb24"

    def frame_bytes(self, h: int, w: int) -> int:
        """Bytes one slot of h x w takes (budgets are computed from it)."""
        return h * w * 3

    @abstractmethod
    def frame_size(self, frame: Any) -> tuple[int, int]:
        """(h, w) of a decoded frame this storage takes. Raises ValueError naming what was given and
        what is expected (the ring turns it into the stream's SourceError)."""

    @abstractmethod
    def write(self, slot: int, frame: Any, ready: Any = None) -> None:
        """Copy `frame` into `slot` (allocated at its size). `ready`: the producer's CUDA event after
        which `frame` is valid (NVDEC), or None. Called without the ring's lock: the slot is WRITING."""

    def ready_event(self, slot: int) -> Any:
        """What a reader of `slot` waits on before reading (a CUDA event), or None: readable now."""
        return None

    def release_after(self, slot: int, event: Any) -> None:
        """The slot's last reader queued work that reads it until `event` completes: the next write
        into it waits for that first. None: nothing pending."""

    def written_event(self, slot: int) -> Any:
        """A remote writer's event after its copy into `slot` (polled on the host before the frame is committed),
        or None: the frame is complete when its descriptor arrives."""
        return None

    def admit(self, slot: int) -> None:
        """A remote writer's frame in `slot` is committed (its copy is complete)."""

    @abstractmethod
    def resize(self, n: int) -> None:
        """Have slots 0..n-1, all free (the ring's first frame fixed their number)."""

    @abstractmethod
    def allocate(self, slot: int, h: int, w: int) -> None:
        """Make `slot` hold a frame of h x w (a no-op if it already does; an older size is freed first,
        so both are never held at once)."""

    @abstractmethod
    def tensor(self, slot: int) -> torch.Tensor:
        """The slot's pixels for a reader: a view, not a copy."""

    @abstractmethod
    def free(self, slot: int) -> None:
        """Give the slot's memory back (allocated again when reused)."""

    @abstractmethod
    def shape(self, slot: int) -> Optional[tuple[int, int]]:
        """(h, w) the slot holds memory for; None when it holds none."""

    @abstractmethod
    def nbytes(self, slot: int) -> int:
        """Bytes the slot holds (0 when freed)."""

    def bytes_held(self) -> int:
        """Bytes all slots hold."""
        return sum(self.nbytes(i) for i in range(self.count()))

    def stale(self, slot: int, shape: tuple[int, int]) -> bool:
        """Whether `slot` holds memory of another geometry than the ring's current `shape` (h, w): the ring frees it
        as soon as its frame is released (it is allocated again at the current geometry when reused)."""
        held = self.shape(slot)
        return held is not None and held != shape

    def kept_bytes(self, slots: Iterable[int]) -> int:
        """Bytes that stay allocated while `slots` keep their memory, whatever else is freed: what the frame budget
        counts for frames of an older geometry until they are released. Here each slot's own bytes."""
        return sum(self.nbytes(i) for i in slots)

    def close(self) -> None:
        """The ring is closed and every slot freed: let go of any memory still referred to (a segment's mapping), so
        that it is returned while the ring object is kept (an ended stream stays listed for `ended_keep_s`). The
        slots' own memory is already freed; nothing here by default."""

    @abstractmethod
    def count(self) -> int:
        """Number of slots."""


class HostSlots(SlotStorage):
    """uint8 (h, w, 3) RGB host tensors (pageable: the module docstring says why), with a numpy view of each
    for the writer (PyAV hands out numpy arrays; np.copyto into the view is the frame's one copy)."""

    def __init__(self):
        self._tensors: list[Optional[torch.Tensor]] = []
        self._arrays: list[Optional[np.ndarray]] = []  # numpy views of _tensors (same memory)

    def resize(self, n: int) -> None:
        self._tensors = [None] * n
        self._arrays = [None] * n

    def frame_size(self, frame: Any) -> tuple[int, int]:
        if not isinstance(frame, np.ndarray) or frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            what = (f"{frame.dtype} {tuple(frame.shape)}" if hasattr(frame, "shape") else type(frame).__name__)
            raise ValueError(f"decoder produced {what}, expected an HxWx3 uint8 numpy array (rgb24)")
        return int(frame.shape[0]), int(frame.shape[1])

    def allocate(self, slot: int, h: int, w: int) -> None:
        arr = self._arrays[slot]
        if arr is None or arr.shape[0] != h or arr.shape[1] != w:
            self.free(slot)  # the old size first: never hold both
            t = host_frame(h, w)
            self._tensors[slot], self._arrays[slot] = t, t.numpy()

    def write(self, slot: int, frame: Any, ready: Any = None) -> None:
        np.copyto(self._arrays[slot], frame)  # PyAV has no `out=`: this is the frame's one copy

    def release_after(self, slot: int, event: Any) -> None:
        """Dropped: a host slot's readers have read it on the host before they release it (the event is the
        batch's, for the NV12 frames of a mixed batch); waiting on it would stall the ingest thread on the GPU."""

    def tensor(self, slot: int) -> torch.Tensor:
        return self._tensors[slot]

    def free(self, slot: int) -> None:
        self._tensors[slot] = self._arrays[slot] = None

    def shape(self, slot: int) -> Optional[tuple[int, int]]:
        arr = self._arrays[slot]
        return None if arr is None else (arr.shape[0], arr.shape[1])

    def nbytes(self, slot: int) -> int:
        arr = self._arrays[slot]
        return 0 if arr is None else arr.nbytes

    def count(self) -> int:
        return len(self._arrays)


class SharedHostSlots(SlotStorage):
    """uint8 (h, w, 3) RGB slots in a shared-memory segment the core created (engine/ingest/slots.py), written
    by an ingest process: the core side only reads them. `map(segment)` points the slots at the ring's current
    segment; a slot still holding a frame of an older segment keeps its view until it is freed (the old
    segment's mapping lives while a view of it does), then follows the current one when reused.
    Allocation is a view of the segment, never memory of its own: the segment is the memory, reserved in
    the frame budget by the ring (FrameRing.set_geometry) before it is created. A segment is mapped whole for as
    long as one view of it lives, so an older segment counts whole (`kept_bytes`) until its last frame is released,
    and `close()` drops the current one once the closed ring's slots are all freed (issue 41 item 7b)."""

    def __init__(self, pixel_format: str = "rgb24"):
        if pixel_format not in ("rgb24", "nv12"):
            raise ValueError(f"pixel format {pixel_format!r}: use rgb24 or nv12")
        self.pixel_format = pixel_format
        self._tensors: list[Optional[torch.Tensor]] = []
        self._shapes: list[Optional[tuple[int, int]]] = []  # each slot's (h, w): read per frame, no torch call
        self._segs: list[Any] = []  # each slot's segment (the one its view maps), None when freed
        self.segment: Any = None
        # each slot's (h, w, 3) view of the current segment, made once at map(): indexing a tensor per frame cost
        # the core's I/O thread a few microseconds a lend
        self._views: list[torch.Tensor] = []

    def map(self, segment: Any) -> None:
        """The ring's current segment (an engine.ingest.slots.Segment): slots allocated from now on view it."""
        if getattr(segment, "pixel_format", "rgb24") != self.pixel_format:
            raise ValueError(f"a {segment.pixel_format} segment for {self.pixel_format} slots")
        self.segment = segment
        self._views = list(torch.from_numpy(segment.array).unbind(0))

    def close(self) -> None:
        """The current segment's mapping goes with the last reference to it here (its views and the segment): the
        lease dropped its own at the stream's end, and /dev/shm gets the memory back (the name is already
        unlinked) while the ring stays listed."""
        self.segment = None
        self._views = []

    def resize(self, n: int) -> None:
        self._tensors = [None] * n
        self._shapes = [None] * n
        self._segs = [None] * n

    def frame_bytes(self, h: int, w: int) -> int:
        return h * w * 3 // 2 if self.pixel_format == "nv12" else h * w * 3

    def frame_size(self, frame: Any) -> tuple[int, int]:
        if self.pixel_format == "nv12":
            return host_nv12_size(frame)
        return HostSlots.frame_size(self, frame)

    def allocate(self, slot: int, h: int, w: int) -> None:
        seg = self.segment
        if seg is None or (seg.h, seg.w) != (h, w) or slot >= seg.count:
            raise ValueError(f"slot {slot} of {w}x{h} is not in the ring's segment "
                             f"({None if seg is None else f'{seg.count} x {seg.w}x{seg.h}'})")
        self._tensors[slot], self._shapes[slot] = self._views[slot], (h, w)  # the current segment's, always
        self._segs[slot] = seg

    def write(self, slot: int, frame: Any, ready: Any = None) -> None:
        """The core never writes these slots (its ingest process does); tests may, through a numpy view."""
        np.copyto(self._tensors[slot].numpy(), frame)

    def release_after(self, slot: int, event: Any) -> None:
        """Dropped, as HostSlots does: host slots are read on the host before release."""

    def tensor(self, slot: int) -> torch.Tensor:
        return self._tensors[slot]

    def free(self, slot: int) -> None:
        self._tensors[slot] = self._shapes[slot] = self._segs[slot] = None

    def stale(self, slot: int, shape: tuple[int, int]) -> bool:
        """A view of an older segment, whatever its size (a new segment may have the old geometry)."""
        seg = self._segs[slot]
        return seg is not None and seg is not self.segment

    def kept_bytes(self, slots: Iterable[int]) -> int:
        """Every segment one of `slots` views, whole: its mapping (and its /dev/shm pages, unlinked or not) lives
        while one view of it does, not only the slots that hold frames."""
        segs = {id(seg): seg for seg in (self._segs[i] for i in slots) if seg is not None}
        return sum(seg.array.nbytes for seg in segs.values())

    def shape(self, slot: int) -> Optional[tuple[int, int]]:
        return self._shapes[slot]

    def nbytes(self, slot: int) -> int:
        t = self._tensors[slot]
        return 0 if t is None else t.numel()

    def count(self) -> int:
        return len(self._tensors)


def host_nv12_size(frame: Any) -> tuple[int, int]:
    """(h, w) of an (H * 3 // 2, W) uint8 NV12 numpy frame (a CPU decoder's, streams/pyav.py). ValueError otherwise."""
    if isinstance(frame, np.ndarray) and frame.ndim == 2 and frame.dtype == np.uint8 and frame.shape[0] % 3 == 0 \
            and frame.shape[1] % 2 == 0:
        return int(frame.shape[0]) * 2 // 3, int(frame.shape[1])
    what = f"{frame.dtype} {tuple(frame.shape)}" if hasattr(frame, "shape") else type(frame).__name__
    raise ValueError(f"decoder produced {what}, expected an NV12 uint8 numpy array of (H * 3 // 2, W) with even H, W")


def host_frame(h: int, w: int) -> torch.Tensor:
    """One host slot's memory: pageable, exactly h * w * 3 bytes (what the ring's budget counts). A function
    of its own so that a test can watch every allocation (and that none happens under the ledger lock)."""
    return torch.empty((h, w, 3), dtype=torch.uint8)


class _Nv12Slots:
    """What NV12 slot storages share: the frame's (h, w) from an (H * 3 // 2, W) tensor, its bytes, the slot count."""

    _tensors: list

    def shape(self, slot: int) -> Optional[tuple[int, int]]:
        t = self._tensors[slot]
        return None if t is None else (int(t.shape[0]) * 2 // 3, int(t.shape[1]))

    def nbytes(self, slot: int) -> int:
        t = self._tensors[slot]
        return 0 if t is None else t.numel()

    def count(self) -> int:
        return len(self._tensors)


class DeviceSlots(_Nv12Slots, SlotStorage):
    """uint8 (H * 3 // 2, W) NV12 tensors on a CUDA device (the layout NVDEC hands out through DLPack:
    H rows of Y, then H / 2 rows of interleaved U, V), written by a device-to-device copy on this
    storage's own stream, ordered by events (module docstring), never by a host sync.

    `device` may be a CPU device in tests, with `cuda` an object that fakes torch.cuda's Stream and
    Event (tests/frames/test_device_slots.py): the ordering logic is the same code either way.
    """

    pixel_format = "nv12"

    def __init__(self, device: torch.device, *, cuda: Any = None):
        self.device = torch.device(device)
        self._cuda = cuda if cuda is not None else torch.cuda
        # A stream of torch's pool (never the legacy default stream, which would serialise against every other
        # stream on the device): copies overlap the decoders' work and the models'.
        self._stream = self._cuda.Stream(device=self.device) if cuda is None else self._cuda.Stream()
        self._tensors: list[Optional[torch.Tensor]] = []
        # per slot: event after its last write (what readers wait on). One per slot, made at its first write and
        # re-recorded, never one a frame (torch's CUDAEventPool says why concurrent cudaEventCreate is avoided):
        # a slot is written again only after its frame's readers released it, and each queued its wait (on the
        # record made before the wait) before that
        self._ready: list[Any] = []
        self._pending: list[Any] = []  # per slot: event after its last reader's work (what a write waits on)

    def frame_bytes(self, h: int, w: int) -> int:
        return h * w * 3 // 2

    def frame_size(self, frame: Any) -> tuple[int, int]:
        if not isinstance(frame, torch.Tensor) or frame.dim() != 2 or frame.dtype != torch.uint8 \
                or frame.shape[0] % 3 or frame.shape[1] % 2:
            what = (f"{frame.dtype} {tuple(frame.shape)}" if hasattr(frame, "shape") else type(frame).__name__)
            raise ValueError(f"decoder produced {what}, expected an NV12 uint8 tensor of (H * 3 // 2, W) "
                             "with even H and W")
        return int(frame.shape[0]) * 2 // 3, int(frame.shape[1])

    def resize(self, n: int) -> None:
        self._tensors = [None] * n
        self._ready = [None] * n
        self._pending = [None] * n

    def allocate(self, slot: int, h: int, w: int) -> None:
        t = self._tensors[slot]
        if t is None or tuple(t.shape) != (h * 3 // 2, w):
            self.free(slot)  # the old size first: never hold both
            # Allocated on this storage's stream: the caching allocator reuses a freed block only for work
            # on the stream it belongs to, which free() orders after the slot's last reader.
            with self._cuda.stream(self._stream):
                self._tensors[slot] = torch.empty((h * 3 // 2, w), dtype=torch.uint8, device=self.device)

    def write(self, slot: int, frame: Any, ready: Any = None) -> None:
        pending, self._pending[slot] = self._pending[slot], None
        with self._cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)    # the decoder's copy-out is done
            if pending is not None:
                self._stream.wait_event(pending)  # the slot's last reader is done with it
            self._tensors[slot].copy_(frame, non_blocking=True)
            # waited on by the readers' streams (stream.wait_event: the models, the live view), never by the host:
            # torch's default, non-blocking event (engine/models/device.host_event says why host-waited ones are not)
            event = self._ready[slot]
            if event is None:
                event = self._ready[slot] = self._cuda.Event()
            event.record(self._stream)
        # The source's tensor may be freed as soon as the caller drops it: the caching allocator must not
        # hand its memory to another tensor before this stream's copy has read it.
        if hasattr(frame, "record_stream") and frame.device.type == "cuda":
            frame.record_stream(self._stream)

    def ready_event(self, slot: int) -> Any:
        return self._ready[slot]

    def release_after(self, slot: int, event: Any) -> None:
        self._pending[slot] = event

    def tensor(self, slot: int) -> torch.Tensor:
        return self._tensors[slot]

    def free(self, slot: int) -> None:
        # The block goes back to this stream's pool (allocate()); a reader's work on another stream that
        # may still read it is ordered before anything this stream does next.
        pending, self._pending[slot] = self._pending[slot], None
        if self._tensors[slot] is not None and pending is not None:
            self._stream.wait_event(pending)
        self._tensors[slot] = None  # its ready event stays: the slot's next write re-records it



class DeviceSharedSlots(_Nv12Slots, SlotStorage):
    """NV12 slots in a CUDA block the core allocated and exported to an ingest process (engine/ingest/cuda_slots.py,
    issue 33 item 8; NOT RUN ON A GPU YET: tested on the CPU with engine/testing/fake_cuda.py). The ingest process
    writes them; the core only reads them. `map(pool)` points the slots at the ring's current pool, as
    SharedHostSlots.map does with a segment; a slot still holding a frame of an older pool keeps its view.

    Events: the pool's, created once. A reader waits on `ready_event(i)`: the pool's `admitted[i]`, recorded by
    `admit(i)` on this storage's own stream when the ingest-io thread has seen, by a host poll, that the
    producer's `written[i]` completed; never `written[i]` itself, which another process records and which may
    never complete (cuda_slots.py says why). `release_after(i, after)` records the pool's `released[i]` after
    `after` on this storage's stream: the producer's next write into slot i waits on it on its GPU stream.
    This storage's stream waits only on the core's own events (`after`), never on a foreign one."""

    pixel_format = "nv12"

    def __init__(self, *, cuda: Any = None):
        self._cuda = cuda if cuda is not None else torch.cuda
        self._stream: Any = None  # made at the first map (on the pool's device)
        self._tensors: list[Optional[torch.Tensor]] = []
        self._pools: list[Any] = []  # per slot: the pool its view is of (its events are that pool's)
        self.pool: Any = None

    def map(self, pool: Any) -> None:
        """The ring's current pool (an engine.ingest.cuda_slots.CudaSlotPool): slots allocated from now on view it."""
        if self._stream is None:
            self._stream = self._cuda.Stream(device=pool.device)  # torch's pool, never the legacy default stream
        self.pool = pool

    def close(self) -> None:
        """As SharedHostSlots.close: the closed ring holds no reference to its pool's block any more."""
        self.pool = None

    def stale(self, slot: int, shape: tuple[int, int]) -> bool:
        """A view of an older pool, whatever its size."""
        pool = self._pools[slot]
        return pool is not None and pool is not self.pool

    def kept_bytes(self, slots: Iterable[int]) -> int:
        """Every pool one of `slots` views, whole: its block lives while one view of it does."""
        pools = {id(pool): pool for pool in (self._pools[i] for i in slots) if pool is not None}
        return sum(pool.block.numel() for pool in pools.values())

    def frame_bytes(self, h: int, w: int) -> int:
        return h * w * 3 // 2

    def frame_size(self, frame: Any) -> tuple[int, int]:
        return DeviceSlots.frame_size(self, frame)

    def resize(self, n: int) -> None:
        self._tensors = [None] * n
        self._pools = [None] * n

    def allocate(self, slot: int, h: int, w: int) -> None:
        pool = self.pool
        if self._tensors[slot] is not None and self._pools[slot] is pool:
            return
        if pool is None or (pool.h, pool.w) != (h, w) or slot >= pool.count:
            raise ValueError(f"slot {slot} of {w}x{h} is not in the ring's CUDA pool "
                             f"({None if pool is None else f'{pool.count} x {pool.w}x{pool.h}'})")
        self._tensors[slot], self._pools[slot] = pool.block[slot], pool

    def write(self, slot: int, frame: Any, ready: Any = None) -> None:
        raise TypeError("DeviceSharedSlots are written by their ingest process (engine/ingest/cuda_slots.py), "
                        "never by the core")

    def written_event(self, slot: int) -> Any:
        """The producer's `written[slot]` (the ingest-io thread polls it with query(); nobody waits on it). None
        for a slot that is not lent (a forged or stale descriptor: commit() then refuses it)."""
        pool = self._pools[slot] if 0 <= slot < len(self._pools) else None
        return None if pool is None else pool.written[slot]

    def admit(self, slot: int) -> None:
        """The producer's copy into `slot` is complete (its written event queried true): record the core's own
        `admitted[slot]` on this storage's stream, which waits on nothing foreign, for the readers."""
        self._pools[slot].admitted[slot].record(self._stream)

    def ready_event(self, slot: int) -> Any:
        return self._pools[slot].admitted[slot]

    def release_after(self, slot: int, event: Any) -> None:
        pool = self._pools[slot]
        with self._cuda.stream(self._stream):
            self._stream.wait_event(event)  # the core's own event (a reader's kernels, the view's copy)
            pool.released[slot].record(self._stream)

    def tensor(self, slot: int) -> torch.Tensor:
        return self._tensors[slot]

    def free(self, slot: int) -> None:
        # no memory of its own: the view goes; the pool's block lives while the core's pool object does
        self._tensors[slot] = self._pools[slot] = None



def storage_for(pixel_format: str, device: Optional[torch.device] = None) -> SlotStorage:
    """The storage for frames of `pixel_format`: rgb24 -> HostSlots, nv12 -> DeviceSlots on `device`."""
    if pixel_format == "rgb24":
        return HostSlots()
    if pixel_format == "nv12":
        return DeviceSlots(device if device is not None else torch.device("cuda"))
    raise ValueError(f"pixel format {pixel_format!r}: use rgb24 or nv12")
