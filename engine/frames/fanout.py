"""One stream feeding several pools: a group of rings, one per pool, written together.

Why not one ring with several readers: a single-consumer ring keeps the slot lifecycle to
three states and lets each pool drop or push back on its own; the price is one extra memcpy
per frame per additional pool (~0.3 ms for 720p here; a device-to-device copy for NVDEC frames).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional

from engine.frames.lifecycle import DropReason, FrameMeta
from engine.frames.ring import FrameRing


class RingGroup:
    def __init__(self, rings: list[FrameRing]):
        self.rings = rings
        self.stream = rings[0].stream

    def write(self, meta: FrameMeta, frame: Any, stop: Optional[threading.Event] = None, ready: Any = None) -> bool:
        """Write the frame into every ring (FrameRing.write: RGB numpy array or NV12 GPU tensor + ready)."""
        ok = True
        for i, ring in enumerate(self.rings):
            m = meta if i == len(self.rings) - 1 else dataclasses.replace(meta, extra=dict(meta.extra))
            ok &= ring.write(m, frame, stop, ready)
        return ok

    def drop_at_source(self, n: int, reason: DropReason) -> None:
        for ring in self.rings:  # every pool's ledger counts the stream's frames
            ring.drop_at_source(n, reason)

    def close(self) -> None:
        for ring in self.rings:
            ring.close()

    @property
    def overwrites(self) -> int:
        return sum(r.overwrites for r in self.rings)
