"""FrameRef: how a frame travels from its ring onwards.

The scheduler, the pools, the workers and the output stage pass frames around as references
(stream, slot, seq + metadata), never as pixels: only the model runners read pixels, through
`ref.pixels()`, and only until the frame is released. A reference knows where it came from
through `FrameStore`, a two-method protocol, so nothing downstream of the ring imports the ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from engine.frames.lifecycle import FrameMeta


class FrameStore(Protocol):
    """Where a FrameRef's pixels live (a ring). Kept to what a reference needs, so the model
    interface depends on this and not on the ring's state machine."""

    def pixels(self, slot: int, seq: int) -> torch.Tensor:
        """The slot's pixels (a view, not a copy). Raises FrameReleasedError if the slot no longer
        holds frame `seq` (it was released, and maybe reused)."""

    def release(self, slot: int, seen: bool, after: Any = None) -> None:
        """Free the slot. seen: a worker built its input from it (the live view may copy it first);
        False for a frame dropped unseen. after: a CUDA event after which nothing reads the slot."""

    def ready_event(self, slot: int) -> Any:
        """What a reader waits on before reading the slot (a CUDA event), or None: readable now."""


class FrameReleasedError(RuntimeError):
    """A FrameRef's pixels were read after its slot was released: a bug in the reader (the slot
    may already hold another frame, so reading on would return the wrong pixels)."""


@dataclass(slots=True, eq=False)  # eq=False: two refs are the same frame only if they are the same object
class FrameRef:
    """A frame in a store's slot. The holder of a ref holds the frame (and its slot) until release."""

    stream: str             # the frame's stream (== meta.stream); scheduling keys and repr read it
    slot: int               # the store's slot that holds the pixels until release
    seq: int                # the frame's number in its stream: the store checks the slot still holds it
    meta: FrameMeta         # what the source stamped (times, deadline, size); travels to the message
    _store: FrameStore = field(repr=False)  # where the pixels are; private: only pixels()/release() use it
    # Monotonic time the pool's scheduler took it from the ring (batch_wait is measured from it);
    # nan until then.
    t_queued: float = math.nan
    released: bool = False  # set once; release() is idempotent (a watchdog may release a hung batch's frames)

    def pixels(self) -> torch.Tensor:
        """The pixels, a view of the slot, not a copy, valid until release: (H, W, 3) uint8 RGB in host
        memory, or (H * 3 // 2, W) uint8 NV12 in GPU memory (meta.pixel_format says which). On a GPU, a
        reader's stream waits on `ready_event()` before its kernels read them."""
        if self.released:
            raise FrameReleasedError(f"{self!r}: pixels read after release")
        return self._store.pixels(self.slot, self.seq)

    def ready_event(self) -> Any:
        """The CUDA event a reader's stream waits on before reading pixels(), or None (host slots)."""
        if self.released:
            raise FrameReleasedError(f"{self!r}: ready_event read after release")
        return self._store.ready_event(self.slot)

    def release(self, seen: bool = False, after: Any = None) -> None:
        """Give the slot back. seen=True once the model input is built from it (offered to the live
        view first); the default is a drop. after: the CUDA event recorded after the reader's kernels
        that read the slot (the slot is rewritten only after it: no host sync); None when nothing is
        pending. Idempotent: a watchdog may release the slots of a hung batch that later releases them too."""
        if not self.released:
            self.released = True
            self._store.release(self.slot, seen, after)

    def __repr__(self) -> str:  # numbers, never pixels (and no shape: that would read the slot)
        return f"FrameRef({self.stream}#{self.seq}, slot={self.slot}{', released' if self.released else ''})"


class LooseFrames:
    """A FrameStore over tensors that are in no ring: model tests and benchmarks feed runners with it.
    Slot i is tensors[i]; release only marks it."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self._tensors = list(tensors)
        self._released = [False] * len(self._tensors)

    def pixels(self, slot: int, seq: int) -> torch.Tensor:
        if self._released[slot]:
            raise FrameReleasedError(f"loose frame {slot}: pixels read after release")
        return self._tensors[slot]

    def release(self, slot: int, seen: bool, after: Any = None) -> None:
        self._released[slot] = True

    def ready_event(self, slot: int) -> Any:
        return None

    def refs(self, stream: str = "loose", pixel_format: str = "rgb24",
             colour: tuple[str, str] = ("bt601", "limited")) -> list[FrameRef]:
        """One FrameRef per tensor (seq = its index), with metadata of its size: (H, W, 3) RGB tensors, or
        (H * 3 // 2, W) NV12 ones with pixel_format="nv12" and their colour."""
        def meta(i: int, t: torch.Tensor) -> FrameMeta:
            h = int(t.shape[0]) * 2 // 3 if pixel_format == "nv12" else int(t.shape[0])
            return FrameMeta(stream, i, 0.0, 0.0, height=h, width=int(t.shape[1]), pixel_format=pixel_format,
                             colour=colour)
        return [FrameRef(stream, i, i, meta(i, t), self) for i, t in enumerate(self._tensors)]
