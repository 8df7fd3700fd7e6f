"""SlotStorage: the one interface to the memory of a ring's slots.

The ring (ring.py) owns the slots' states, the budget and the accounting; it asks its storage for
memory only: allocate slot i at h x w, the array the writer copies into, the tensor a reader
reads, free slot i. HostSlots is today's storage: uint8 HxWx3 host tensors, pinned when CUDA is
available (pinning raises without a driver) so the upload is a DMA. GPU device slots (NV12,
written by NVDEC) will be a second implementation (issue 23). Only engine/frames and the model
runners touch pixels.

Not thread-safe by itself: the ring calls it under its lock, except the writer's copy into a slot
it reserved (WRITING) and the readers' views of slots they hold (CLAIMED), which nobody else touches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import numpy as np
import torch


class SlotStorage(ABC):
    """Memory for a fixed number of slots, each holding one frame of some h x w (sizes may differ
    while a stream changes size: a slot keeps its old size until it is freed)."""

    @abstractmethod
    def resize(self, n: int) -> None:
        """Have slots 0..n-1, all free (the ring's first frame fixed their number)."""

    @abstractmethod
    def allocate(self, slot: int, h: int, w: int) -> None:
        """Make `slot` hold a frame of h x w (a no-op if it already does; an older size is freed first,
        so both are never held at once)."""

    @abstractmethod
    def writable(self, slot: int) -> np.ndarray:
        """The (h, w, 3) uint8 array the writer copies a decoded frame into."""

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

    @abstractmethod
    def count(self) -> int:
        """Number of slots."""


class HostSlots(SlotStorage):
    """uint8 (h, w, 3) RGB host tensors, pinned when CUDA is available, with a numpy view of each for
    the writer (PyAV hands out numpy arrays; np.copyto into the view is the frame's one copy)."""

    def __init__(self, pin: Optional[bool] = None):
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._tensors: list[Optional[torch.Tensor]] = []
        self._arrays: list[Optional[np.ndarray]] = []  # numpy views of _tensors (same memory)

    def resize(self, n: int) -> None:
        self._tensors = [None] * n
        self._arrays = [None] * n

    def allocate(self, slot: int, h: int, w: int) -> None:
        arr = self._arrays[slot]
        if arr is None or arr.shape[0] != h or arr.shape[1] != w:
            self.free(slot)  # the old size first: never hold both
            t = torch.empty((h, w, 3), dtype=torch.uint8, pin_memory=self._pin)
            self._tensors[slot], self._arrays[slot] = t, t.numpy()

    def writable(self, slot: int) -> np.ndarray:
        return self._arrays[slot]

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
