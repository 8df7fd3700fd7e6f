"""Per-stream frame rings: a fixed number of slots, sized from a memory budget.

All slots are reserved in the engine's frame budget when the first frame's size is known; each slot's
memory is allocated by the writer when it first writes into it (or after a size change), outside the
ledger lock, which every ingest thread and the engine core share. The decoder thread copies each
decoded frame into a free slot (PyAV allocates its own output array and has no `out=`, so this
is the one copy a frame gets; an NVDEC frame is copied device to device); the worker reads the
slot in place (`FrameRef.pixels()`) and releases it once its input batch is built (on the GPU:
once the kernels it queued have read it, by event). The slots' memory is the ring's `SlotStorage`
(storage.py): pageable host RGB for CPU-decoded frames, NV12 in GPU memory for NVDEC frames, chosen
by the first frame; the ring keeps the slots' states, the budget and the accounting.

The live view's `tap` is offered each frame a worker has seen, when it releases it: before the
slot is freed (the tap copies the pixels) and outside the ledger lock (a copy must never hold up
the pool). Frames released unseen (drops) are not offered.

live mode: when no slot is free, the oldest frame not yet taken by the scheduler is
overwritten and counted as dropped(ring_full). offline mode: the writer waits (back-pressure).

The ring's condition variable is built on its pool's ledger lock (`Accounting.lock`): a frame
becomes READY and is counted as ingested in one critical section, and the engine core takes
READY frames into the scheduler in another, so the pool's in-flight count (the ring holds its
READY frames) is exact at every moment. The slot's allocation and the pixel copy happen outside the
lock, into a slot the writer has reserved (WRITING), which no reader looks at.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from enum import Enum
from typing import Any, Callable, Optional

import torch

from engine.frames.accounting import Accounting
from engine.errors import SourceError
from engine.frames.lifecycle import DropReason, FrameMeta
from engine.frames.budget import FrameMemoryBudget
from engine.frames.ref import FrameRef, FrameReleasedError
from engine.frames.storage import DeviceSlots, HostSlots, SlotStorage

log = logging.getLogger("vidar.ring")


class SlotState(Enum):
    FREE = 0
    WRITING = 1   # reserved by the writer while it copies pixels in (not a frame yet)
    READY = 2     # holds a frame the scheduler has not taken (the ring holds it)
    CLAIMED = 3   # taken by the scheduler or a worker (they hold the frame; the slot until released)


_DROPPED = -1


#: A live stream fed by a remote writer (an ingest process) runs on a credit of one frame instead of its
#: `ingest.live_credit` while its writer is behind and the copies it makes are wasted: in a window of LEAN_WINDOW_S,
#: more than LEAN_ENTER of the frames it committed were superseded (two waited for the scheduler at once, the older
#: copy spent for nothing) AND more than LEAN_BURSTY were committed in bursts (less than half their capture interval
#: after the one before: the writer fell behind its source and catches up). Then its next frames are shed
#: at the source before the copy, until a window in which fewer than LEAN_EXIT of its frames were shed (it keeps up
#: again). Why both: when the model is what is slow, frames arrive on time, the scheduler supersedes the older of
#: two for freshness, and a credit of one would publish the older one instead (measured: p50 85 -> 117 ms at 30 fps,
#: benchmarks/RESULTS.md), so that stream keeps its credit; when the writer is behind (48 x 720p60 on 2 cores), a
#: third of its copies were superseded, and shedding them published 17-27 % more at lower latency. Why not a credit
#: of 1 always: the second credit hides the credit's round trip (core -> process), which at 250 fps shed a tenth of
#: the frames of streams the engine kept up with. What it cannot see: a network source's capture stamp is when its
#: packet came out of the demuxer in that same process, so a process behind a camera reads and stamps late alike and
#: never looks bursty; such a stream keeps its full credit, as every stream did before this rule.
LEAN_WINDOW_S = 1.0
LEAN_ENTER = 0.10
LEAN_BURSTY = 0.25
LEAN_EXIT = 0.25


def slots_for(frame_bytes: int, memory_bytes: float, min_slots: int, max_slots: int) -> int:
    """Slots that fit the budget, clamped to [min_slots, max_slots]."""
    return int(min(max_slots, max(min_slots, memory_bytes // max(frame_bytes, 1))))


class FrameRing:
    """Bounded ring of frames for one stream, single producer, single consumer pool. It is the
    FrameStore (ref.py) of the FrameRefs it hands out."""

    def __init__(self, stream: str, *, live: bool, accounting: Accounting, memory_bytes: float,
                 min_slots: int, max_slots: int, max_frame_pixels: int,
                 notify: Callable[..., None] = lambda n=1: None, max_interval: int = 1,
                 budget: Optional[FrameMemoryBudget] = None, storage: Optional[SlotStorage] = None):
        self.stream = stream
        self._budget = budget  # the engine-wide frame memory (engine/frame_budget.py); None: unbounded
        self.live = live
        self.max_interval = max_interval  # the degradation ladder samples at most 1 frame in this many
        self._acct = accounting
        self._memory_bytes = memory_bytes
        self._min_slots, self._max_slots = min_slots, max_slots
        self._max_pixels = max_frame_pixels
        self._notify = notify
        self._storage = storage if storage is not None else HostSlots()  # the slots' memory
        # No storage given: the first frame decides (an NVDEC frame, a torch tensor: DeviceSlots on its device).
        self._storage_chosen = storage is not None
        self._cond = threading.Condition(accounting.lock)
        self._state: list[SlotState] = []
        self._meta: list[Optional[FrameMeta]] = []
        self._ready_order: list[int] = []  # READY slots, oldest first
        self._closed = False
        self._shape: tuple[int, int] = (0, 0)
        self._limit = 0
        self.overwrites = 0
        self.reallocations = 0
        self.at_source = 0   # frames dropped before any copy: no credit, every slot held, or past their deadline
        self.lean = False    # live credit cut to one frame: its writer is behind and its copies wasted (LEAN_ENTER)
        self.lean_spells = 0  # how many times it was
        self.clock: Callable[[], float] = time.monotonic  # the lean windows' clock (tests inject one)
        self._committed = self._shed = 0  # remote writer: frames committed, frames shed for want of credit
        self._bursty = 0  # remote writer: frames committed sooner after the one before than half their capture gap
        self._last_commit: tuple[float, float] = (0.0, math.inf)  # (commit time, capture time) of the last one
        self._window: Optional[tuple[float, int, int, int, int]] = None  # (start, committed, shed, bursty, superseded)
        # The live view's tap (engine/view/hub.py): offered each frame a worker has built its input
        # from, before its slot is freed. None when the view is off. For a GPU slot it is also given the
        # slot's `ready` and release (`after`) events, and returns the event after which its own queued reads
        # of the slot are done (covering `after`), or None when it queued none.
        self.tap: Optional[Callable[..., Any]] = None
        # A remote writer's client (engine/ingest/client.py): told, outside the lock, that a slot was freed, so
        # it lends it back as a credit, and whether the writer still holds a lent slot (then its next descriptor
        # wakes the client anyway). None for an in-process writer (it finds free slots itself).
        self.on_free: Optional[Callable[[bool], None]] = None
        # The pool's rings that hold READY frames (Pool.attach sets it; a dict as an ordered set), guarded by the
        # ledger lock, which is this ring's lock: the core's step pulls from those rings only, not from every
        # ring of the pool (at 48 streams a scan of every ring was ~1/3 of the core's work per frame).
        self.ready_set: Optional[dict["FrameRing", None]] = None
        # Told (outside the lock, any thread) when the ring closes: the stream table looks at a stream's end only
        # once one of its rings has closed, not at every stream on every step.
        self.on_close: Optional[Callable[[], None]] = None

    # -- producer side -------------------------------------------------------------------
    def reserve_for(self, h: int, w: int) -> None:
        """Reserve the slots for frames of h x w in the engine's frame budget now (a source that knows its
        size before opening: the add is refused rather than the stream failed later). Raises SourceError."""
        with self._cond:
            n = slots_for(self._storage.frame_bytes(h, w), self._memory_bytes, self._min_slots, self._max_slots)
            self._reserve_bytes(h, w, n)

    def _reserve_bytes(self, h: int, w: int, n: int, held_old: int = 0) -> None:
        """Reserve n slots of h x w, plus `held_old` bytes of slots still holding frames of an older size."""
        if self._budget is not None:
            what = f"{n} ring slots of {w}x{h} frames" + (" (and the older frames still held)" if held_old else "")
            self._budget.reserve(self, self.stream, n * self._storage.frame_bytes(h, w) + held_old, what)

    def _held_old_bytes(self) -> int:
        """Lock held: bytes that slots of an older geometry keep (storage.kept_bytes: an older segment whole)."""
        st = self._storage
        return st.kept_bytes(i for i in range(st.count()) if st.stale(i, self._shape))

    def _give_back(self) -> None:
        """Lock held: a closed ring whose slots are all freed returns its reservation, and its storage lets go of
        what it still maps (a segment: the ring stays listed for ended_keep_s, its memory does not). Not while a
        slot is WRITING: its writer allocates it outside the lock (it may hold memory the shapes do not show yet),
        and frees it and calls this once it sees the ring closed."""
        if self._closed and SlotState.WRITING not in self._state \
                and all(self._storage.shape(i) is None for i in range(self._storage.count())):
            if self._budget is not None:
                self._budget.release(self)
            self._storage.close()

    def _allocate(self, h: int, w: int) -> None:
        n = slots_for(self._storage.frame_bytes(h, w), self._memory_bytes, self._min_slots, self._max_slots)
        self._reserve_bytes(h, w, n)  # before anything is allocated: a refusal leaves the ring as it was
        self._storage.resize(n)
        self._state = [SlotState.FREE] * n
        self._meta = [None] * n
        self._shape, self._limit = (h, w), n
        # No slot is allocated here (the ledger lock is held): the writer allocates each as it first reserves
        # it (write). The budget holds all n from now on, so the ring's memory is bounded from its first frame.

    def _resize(self, h: int, w: int) -> None:
        """The stream's frame size changed: slots follow it one by one as they are reused, and the
        number of usable slots is recomputed from the budget, so memory stays within it. Slots past
        the new limit are freed as soon as they are released."""
        limit = min(len(self._state), slots_for(self._storage.frame_bytes(h, w), self._memory_bytes, self._min_slots,
                                                self._max_slots))
        # Free slots are let go now (re-allocated at the new size when reused); slots holding a frame keep
        # their old memory until released, so the reservation covers it too until then (release() shrinks it).
        # (Counting only the new size let one huge frame followed by small ones keep ~600 MB outside the budget.)
        # What they keep is the storage's to say: their own arrays, or for a shared segment the whole segment,
        # mapped while one view of it lives (counting the held slots only let /dev/shm pass the budget).
        held_old = self._storage.kept_bytes(i for i, state in enumerate(self._state) if state is not SlotState.FREE)
        self._reserve_bytes(h, w, limit, held_old)  # may not fit the engine's budget: refused before any change
        self.reallocations += 1
        self._shape = (h, w)
        self._limit = limit
        for i, state in enumerate(self._state):
            if state is SlotState.FREE:
                self._storage.free(i)

    def allocated_bytes(self) -> int:
        with self._cond:
            return self._storage.bytes_held()

    def _free_slot(self) -> Optional[int]:
        for i in range(self._limit):
            if self._state[i] is SlotState.FREE:
                return i
        return None

    def write(self, meta: FrameMeta, frame: Any, stop: Optional[threading.Event] = None, ready: Any = None,
              wait: bool = True) -> bool:
        """Copy one frame into a slot: an (H, W, 3) uint8 RGB numpy array (CPU decode), or an (H * 3 // 2, W)
        uint8 NV12 tensor on a GPU (NVDEC) with `ready`, the CUDA event after which it is valid. Returns
        False if the ring was closed (the frame was then never ingested). Counts the frame as ingested.
        Live: never blocks. Offline: waits for a free slot; with `wait=False` (the ingest I/O thread, which
        must never wait: its caller lent only what there was room for) a frame that finds none is dropped
        (ring_full) and logged, never waited for."""
        if not self._storage_chosen:  # once: the ring's lock is the pool's ledger lock, hot on every frame
            with self._cond:
                self._choose_storage(frame)
        try:
            h, w = self._storage.frame_size(frame)
        except ValueError as err:
            raise SourceError(self.stream, f"{err} (this ring holds {self._storage.pixel_format})") from None
        if h * w > self._max_pixels:
            raise SourceError(self.stream, f"frame {w}x{h} exceeds ring.max_frame_pixels={self._max_pixels}; "
                                           "raise it if this stream is really that large")
        with self._cond:
            i = self._reserve(h, w, stop, wait)
            if i is None:  # closed, or stopped while waiting for a slot: not ingested
                return False
            if i == _DROPPED:  # live, every slot claimed: ingested and dropped(ring_full), counted
                return True
        # Outside the lock (the slot is WRITING: nobody else touches it): an allocation (first use, or a new
        # size; a no-op otherwise) under the pool's ledger lock would stall every ingest thread and the core.
        try:
            self._storage.allocate(i, h, w)
        except BaseException:  # out of memory: the slot goes back, the stream fails with the error
            with self._cond:
                self._state[i] = SlotState.FREE
                self._storage.free(i)
                self._give_back()
                self._cond.notify_all()
            raise
        self._storage.write(i, frame, ready)
        with self._cond:
            if self._closed:  # closed while copying: the frame never entered the pipeline
                self._state[i] = SlotState.FREE
                self._storage.free(i)
                self._give_back()
                self._cond.notify_all()
                return False
            self._acct.ingest(self.stream)
            meta.height, meta.width = h, w
            meta.pixel_format = self._storage.pixel_format
            meta.t_decoded = time.monotonic()
            self._meta[i] = meta
            self._state[i] = SlotState.READY
            self._ready_order.append(i)
            if self.ready_set is not None:
                self.ready_set[self] = None
        self._notify()
        return True

    def _choose_storage(self, frame: Any) -> None:
        """Lock held. Before the first allocation, a ring given no storage takes the one its first frame
        needs: a torch tensor (NVDEC's NV12, on a GPU) -> DeviceSlots; a numpy array -> HostSlots (kept).
        Frames of the other kind later fail in frame_size (a stream does not change decoders mid-run)."""
        if self._storage_chosen:
            return
        self._storage_chosen = True
        if isinstance(frame, torch.Tensor):
            self._storage = DeviceSlots(frame.device)

    def _reserve(self, h: int, w: int, stop: Optional[threading.Event], wait: bool = True) -> Optional[int]:
        """A slot marked WRITING for the next frame (lock held). None: closed or stopped. _DROPPED: live
        and every slot is claimed (or offline with wait=False and none free); the new frame was counted as
        ingested and dropped(ring_full)."""
        if not self._state:
            self._allocate(h, w)
        elif (h, w) != self._shape:
            self._resize(h, w)
        i = self._free_slot()
        if i is None and not wait and not self.live and not self._closed:
            log.error("stream %s: no free slot in pool %s's ring for a frame its writer must not wait for: dropped "
                      "(ring_full)", self.stream, self._acct.pool)
            self._acct.ingest(self.stream)
            self._acct.drop(self.stream, DropReason.RING_FULL)
            self.overwrites += 1
            return _DROPPED
        while i is None and not self._closed:
            if self.live:
                usable = [j for j in self._ready_order if j < self._limit]
                if not usable:  # every slot is held by the scheduler/workers: the new frame is the one dropped
                    self._acct.ingest(self.stream)
                    self._acct.drop(self.stream, DropReason.RING_FULL)
                    self.overwrites += 1
                    self.at_source += 1  # never copied, as a remote writer's frame without credit
                    return _DROPPED
                i = usable[0]  # drop-oldest: the frame the scheduler has not taken yet
                self._ready_order.remove(i)
                self._acct.drop(self._meta[i].stream, DropReason.RING_FULL)
                self._meta[i] = None
                self.overwrites += 1
                break
            self._cond.wait(0.1)
            if stop is not None and stop.is_set():
                return None
            i = self._free_slot()
        if self._closed:
            return None
        self._state[i] = SlotState.WRITING
        return i

    def close(self) -> None:
        """No more frames will come (end of stream or stop). Wakes a waiting writer. Free slots give
        their memory back now, the others as they are released."""
        with self._cond:
            self._closed = True
            for i, state in enumerate(self._state):
                if state is SlotState.FREE:
                    self._storage.free(i)
            self._give_back()
            self._cond.notify_all()
        if self.on_close is not None:
            self.on_close()
        self._notify()

    # -- consumer side -------------------------------------------------------------------
    def take_ready(self, limit: Optional[int] = None) -> list[FrameRef]:
        """Claim READY frames, oldest first (at most `limit`). The caller holds them from now on: call
        with the pool's ledger lock held and put them in their next holder before releasing it."""
        with self._cond:
            take = self._ready_order if limit is None else self._ready_order[:max(0, limit)]
            out = []
            for i in take:
                self._state[i] = SlotState.CLAIMED
                meta = self._meta[i]
                out.append(FrameRef(meta.stream, i, meta.seq, meta, self))
            del self._ready_order[:len(out)]
            return out

    def ready(self) -> int:
        """Frames the ring holds (READY): its part of the pool's in-flight count."""
        with self._cond:
            return len(self._ready_order)

    # -- FrameStore (ref.py): what the FrameRefs it handed out call --------------------------------
    def pixels(self, slot: int, seq: int) -> torch.Tensor:
        """The slot's pixels, a view. No lock: the caller holds the frame, so only its own release
        changes the slot; the check catches a read after that release (e.g. by the watchdog)."""
        meta = self._meta[slot]
        if self._state[slot] is not SlotState.CLAIMED or meta is None or meta.seq != seq:
            raise FrameReleasedError(f"ring {self.stream}: slot {slot} no longer holds frame #{seq} "
                                     "(its pixels were read after its release)")
        return self._storage.tensor(slot)

    def ready_event(self, slot: int) -> Any:
        """What a reader waits on before reading the slot (a CUDA event on the GPU), or None."""
        return self._storage.ready_event(slot)

    def release(self, slot: int, seen: bool = False, after: Any = None) -> None:
        """Free a claimed slot. seen: a worker built its input from it: offered to the tap first.
        after: the CUDA event after which the reader's queued work no longer reads the slot (the next
        write into it waits for it on the GPU); None: nothing pending."""
        if seen:
            after = self._offer(slot, after)
        with self._cond:
            if after is not None:
                self._storage.release_after(slot, after)
            self._state[slot] = SlotState.FREE
            self._meta[slot] = None
            stale = self._storage.stale(slot, self._shape)  # an older size or segment
            if slot >= self._limit or self._closed:  # past the limit after a size change, or no more frames
                self._storage.free(slot)
                self._give_back()
            elif stale:  # reallocated (a view of the current segment) when reused
                self._storage.free(slot)
            if stale and not self._closed:
                self._reserve_bytes(*self._shape, self._limit, self._held_old_bytes())  # shrinks: always fits
            self._cond.notify_all()
            on_free = self.on_free
            # the remote writer still holds a lent slot: its next descriptor wakes the lender anyway
            held = on_free is not None and SlotState.WRITING in self._state[:self._limit]
        if on_free is not None:
            on_free(held)

    # -- remote writer (engine/ingest): slots change owner by message, never under a lock the writer shares --
    def slots_needed(self, h: int, w: int) -> int:
        """How many slots of h x w this ring would use (a new segment's size)."""
        n = slots_for(self._storage.frame_bytes(h, w), self._memory_bytes, self._min_slots, self._max_slots)
        return min(n, len(self._state)) if self._state else n

    def set_geometry(self, h: int, w: int, segment: Any) -> int:
        """The remote writer's frames are h x w now, in `segment` (created by the caller for slots_needed(h, w)
        slots): reserved in the frame budget (SourceError if it does not fit: nothing changed), every lent
        slot taken back (its writer drops its credits with the new geometry). Returns the usable slots; 0 for a
        closed ring (its stream is going: a Geometry sent before the removal reached its process), which maps and
        reserves nothing (the caller's segment goes with its lease).

        The budget rule while frames of the older segment are still held (issue 41 item 7b): the reservation is
        the new segment plus every older segment a held frame still views, whole (a segment stays mapped, and its
        /dev/shm pages allocated, while one view of it lives), shrunk as the last frame of each is released. A new
        segment that does not fit beside them is refused like any other (SourceError: the lease fails the stream)
        rather than /dev/shm passing ring.total_memory_mb. Simpler than sizing the new segment to what is left:
        a geometry change is rare, and the old frames go within one batch."""
        if h * w > self._max_pixels:
            raise SourceError(self.stream, f"frame {w}x{h} exceeds ring.max_frame_pixels={self._max_pixels}; "
                                           "raise it if this stream is really that large")
        with self._cond:
            self._reclaim()
            if self._closed:
                return 0
            if not self._state:
                self._allocate(h, w)
            else:  # a new size, or a new segment of the same size: held frames keep the old one until released
                self._resize(h, w)
            self._storage.map(segment)
            return self._limit

    @property
    def pixel_format(self) -> str:
        """What its slots hold: "rgb24" or "nv12" (its storage's; FrameMeta.pixel_format of its frames)."""
        return self._storage.pixel_format

    @property
    def pool(self) -> str:
        return self._acct.pool

    def free_slots(self, h: int = 0, w: int = 0) -> int:
        """FREE slots that frames of h x w could use (below the limit this ring will have at that size, which it
        takes at its next write: an ingest process's frames copied into it, room for them)."""
        with self._cond:
            limit = self._limit
            if h and w and (h, w) != self._shape:
                limit = slots_for(self._storage.frame_bytes(h, w), self._memory_bytes, self._min_slots, self._max_slots)
                if self._state:
                    limit = min(limit, len(self._state))
            if not self._state:
                return limit if h and w else self._max_slots
            return self._state[:limit].count(SlotState.FREE)

    def lent(self) -> int:
        """Slots lent to the remote writer now (WRITING)."""
        with self._cond:
            return self._state.count(SlotState.WRITING)

    def lend(self, credit: Optional[int] = None, most: Optional[int] = None) -> list[int]:
        """FREE slots below the limit -> WRITING, lent to the remote writer. Live: at most `credit` frames in the
        ring at once, READY or lent (None: no cap); beyond it the writer sheds its next frame at the source,
        before the copy (counted), where a copy would only be superseded. Live, when none is free and the
        writer holds none: the oldest READY frame is dropped and its slot lent, which keeps freshest-first as
        write()'s overwrite does, but only while another READY frame stays for the scheduler: the frame just
        committed is never dropped before the core could take it (the writer sheds its next frame at the source
        instead, counted ring_full). The frame dropped is counted `superseded`, not ring_full (issue 41 item 7a):
        a newer frame of its stream waits for the scheduler, which would have dropped the older one as superseded
        itself, and the lean rule (LEAN_ENTER) counts exactly such wasted copies. Offline: only free slots (the
        writer waits for them), at most `most` (an offline stream's frames are also copied into other pools'
        rings: no more lent than they have room for)."""
        with self._cond:
            spells = self.lean_spells
            out = self._lend(credit, most)
            first_lean = spells == 0 and self.lean_spells == 1
        if first_lean:  # once a stream (it may go in and out of it every few seconds), outside the ledger lock
            log.info("stream %s: its frames arrive late and in bursts, and the scheduler superseded more than %d%% of "
                     "them in %g s: a credit of one frame while it is behind (its next frames are shed before their "
                     "copy, counted ring_full)", self.stream, round(LEAN_ENTER * 100), LEAN_WINDOW_S)
        return out

    def _lend(self, credit: Optional[int], most: Optional[int] = None) -> list[int]:
        if self._closed or not self._state:
            return []
        # list.count and list.index, not a loop over the slots: the core's I/O thread lends on every frame
        states = self._state[:self._limit]
        room = len(states) if most is None else min(len(states), most)  # most: room elsewhere (lend's docstring)
        if self.live and credit is not None:
            credit = 1 if self._lean_now() else credit
            room = credit - states.count(SlotState.READY) - states.count(SlotState.WRITING)
            if room <= 0:
                return []
        out: list[int] = []
        i = -1
        while len(out) < room:
            try:
                i = states.index(SlotState.FREE, i + 1)
            except ValueError:
                break
            out.append(i)
        if not out and self.live and SlotState.WRITING not in states:
            usable = [j for j in self._ready_order if j < self._limit]  # oldest first
            if len(usable) >= 2:  # never the last one (the newest, just committed): it stays for the scheduler
                i = usable[0]
                self._ready_order.remove(i)
                self._acct.drop(self._meta[i].stream, DropReason.SUPERSEDED)  # usable[-1] is newer (docstring)
                self._meta[i] = None
                self.overwrites += 1
                out = [i]
        stale = any(self._storage.stale(i, self._shape) for i in out)  # a dropped frame of an older segment
        for i in out:
            self._storage.allocate(i, *self._shape)  # a view of the segment: no memory is allocated
            self._state[i] = SlotState.WRITING
        if stale:  # its view of the older segment went: that segment's bytes, once no view is left (release())
            self._reserve_bytes(*self._shape, self._limit, self._held_old_bytes())  # shrinks: always fits
        return out

    def _lean_now(self) -> bool:
        """Whether the stream's credit is one frame now (see LEAN_ENTER); decided once a window. Lock held."""
        now = self.clock()
        sup = self._acct.dropped_for(self.stream, DropReason.SUPERSEDED)
        if self._window is None:
            self._window = (now, self._committed, self._shed, self._bursty, sup)
        start, committed, shed, bursty, superseded = self._window
        if now - start >= LEAN_WINDOW_S:
            committed, shed = self._committed - committed, self._shed - shed
            bursty, superseded = self._bursty - bursty, sup - superseded
            if not self.lean and superseded > LEAN_ENTER * committed > 0 and bursty > LEAN_BURSTY * committed:
                self.lean = True
                self.lean_spells += 1
            elif self.lean and shed < LEAN_EXIT * (shed + committed):
                self.lean = False
            self._window = (now, self._committed, self._shed, self._bursty, sup)
        return self.lean

    def commit(self, slot: int, meta: FrameMeta, notify: bool = True) -> bool:
        """A lent slot now holds frame `meta` (meta.height x meta.width): WRITING -> READY, counted ingested,
        the core woken (write()'s last critical section; `notify=False`: the caller commits a batch of frames
        and calls `notify()` once after it). False, and nothing counted, when the slot is not lent at that size
        (a bug or a forged descriptor) or the ring closed meanwhile (the slot is freed)."""
        with self._cond:
            if not 0 <= slot < len(self._state) or self._state[slot] is not SlotState.WRITING \
                    or self._storage.shape(slot) != (meta.height, meta.width):
                return False
            if self._closed:
                self._state[slot] = SlotState.FREE
                self._storage.free(slot)
                self._give_back()
                self._cond.notify_all()
                return False
            self._storage.admit(slot)  # a CUDA IPC slot: the core's own ready event for its readers
            self._acct.ingest(self.stream)
            self._committed += 1
            meta.pixel_format = self._storage.pixel_format
            meta.t_decoded = now = time.monotonic()
            # judged at the commit, not on the writer's own stamp (t_written): at 48 x 720p60 the bursts are the
            # engine reading a lagging writer's frames (by its stamps the writer looked on time, and the rule caught
            # a fraction of the waste: published/admitted 0.85-0.88 against 1.00), so an engine stall (a full GC
            # collection, a ledger snapshot of every stream) counts too and may cut a stream's credit for a second
            last_commit, last_capture = self._last_commit
            if now - last_commit < (meta.t_capture_mono - last_capture) / 2:  # late, catching up (LEAN_BURSTY)
                self._bursty += 1
            self._last_commit = (now, meta.t_capture_mono)
            self._meta[slot] = meta
            self._state[slot] = SlotState.READY
            self._ready_order.append(slot)
            if self.ready_set is not None:
                self.ready_set[self] = None
        if notify:
            self._notify()
        return True

    def notify(self, frames: int = 1) -> None:
        """Tell the consumer (the engine core) that `frames` frames were committed with notify=False."""
        self._notify(frames)

    def written_event(self, slot: int) -> Any:
        """The remote writer's event for a lent slot's copy (CUDA IPC slots), which the caller polls with query()
        before commit(); None when the frame is complete once its descriptor arrives (shared host memory)."""
        return self._storage.written_event(slot)

    def reclaim(self) -> int:
        """Every lent slot (WRITING) -> FREE: its writer died or its credits were renewed. Returns how many."""
        with self._cond:
            return self._reclaim()

    def _reclaim(self) -> int:
        n = 0
        for i, state in enumerate(self._state):
            if state is SlotState.WRITING:
                self._state[i] = SlotState.FREE
                if self._closed or i >= self._limit:
                    self._storage.free(i)
                n += 1
        if n:
            self._give_back()
            self._cond.notify_all()
        return n

    def drop_at_source(self, n: int, reason: DropReason = DropReason.RING_FULL) -> None:
        """n frames dropped at the source before any copy: by a remote writer without credit (live: ring_full),
        or by the ingest because they were past their deadline already (deadline, as the scheduler would
        have dropped them). Ingested and dropped, so the ledger covers them. Not once the ring is closed
        (its stream is going)."""
        with self._cond:
            if n > 0 and not self._closed:
                self._acct.ingest(self.stream, n)
                self._acct.drop(self.stream, reason, n)
                if reason is DropReason.DEADLINE:
                    self._acct.late_at_source(self.stream, n)
                self.at_source += n
                if reason is DropReason.RING_FULL:
                    self.overwrites += n
                    self._shed += n

    def _offer(self, slot: int, after: Any) -> Any:
        """Offer a seen frame to the live view's tap (a no-op unless someone watches its stream). Not under
        the ledger lock (the tap copies pixels); the slot is still claimed, so nobody writes it meanwhile.
        Returns the slot's release event: `after`, or for a GPU slot the tap's event when it queued reads of
        the slot (on its own stream, after `after`: so the next write waits for both, on the GPU).
        A tap error is the view's problem: logged, never the frame's."""
        tap, meta = self.tap, self._meta[slot]
        if tap is None or meta is None:
            return after
        try:
            ready = self._storage.ready_event(slot)
            if ready is None:
                tap(meta, self._storage.tensor(slot))
                return after
            # GPU slots: the copy into the slot may still be queued; the tap queues its own copy behind it on
            # the GPU (engine/view/hub.py), never waiting here on the worker's thread
            mine = tap(meta, self._storage.tensor(slot), ready=ready, after=after)
            return after if mine is None else mine
        except Exception:
            log.exception("view tap failed on %s#%d (the frame goes on)", self.stream, meta.seq)
            return after

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def capacity(self) -> int:
        return len(self._state)

    def held(self) -> int:
        """Slots not free (READY, CLAIMED or being written)."""
        with self._cond:
            return sum(s is not SlotState.FREE for s in self._state)
