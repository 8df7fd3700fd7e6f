"""Core-owned shared-memory segments for a ring's slots: one segment per ring and geometry.

Why one segment per ring (the issue said one per process): a stream's frame size can change mid-run, and
a ring's slots follow it. With a segment per ring a size change is a new segment of the new size with the
next generation in its name (Frigate #22716 reused a same-name segment at its old size), while frames still
held in the old one stay valid until released; a per-process segment would need an allocator for slots
of mixed sizes inside it. Streams are few per process, so the number of segments stays small.

Created with os.open + mmap, not multiprocessing.shared_memory: the children only attach, and nothing
registers the segment with multiprocessing's resource tracker, which on 3.11 unlinks every segment a
process attached when that process exits (CPython #82300) -- a child dying would unlink the core's slots.
Filled with os.posix_fallocate first, so a full /dev/shm is an error here (ENOSPC), not a SIGBUS in a
writer later (Frigate #949); then prefaulted, since the first touch of a fresh page costs 13-30x a copy.
Only the core unlinks (`unlink`), when the ring moves to a new geometry or its stream goes.
"""

from __future__ import annotations

import mmap
import os
from typing import Optional

import numpy as np

SHM_DIR = "/dev/shm"


def segment_name(run: str, stream: str, n: int) -> str:
    """The name of a stream's n-th segment in a run (the core's naming; `check_name` holds a process to it)."""
    return f"vidar-{run}-{stream}-{n}"


def check_name(name: str, run: str, stream: str) -> None:
    """Raises ValueError unless `name` is one the core makes for `stream` in `run` (segment_name): an ingest
    process opens read-write only what its engine created for that stream, never a path ("../x") or another
    run's or stream's segment. Defence in depth: commands come only from the engine (docs/security.md)."""
    prefix = f"vidar-{run}-{stream}-"
    if not (name.startswith(prefix) and name[len(prefix):].isdigit() and name.isascii() and "/" not in name):
        raise ValueError(f"segment name {name!r} is not one of this run's for stream {stream!r} "
                         f"({prefix}<n>): refused")


class ShmSpaceError(OSError):
    """/dev/shm cannot hold the slots (ENOSPC at creation, or too small at start)."""


def shm_free_bytes(path: str = SHM_DIR) -> int:
    """Free bytes in /dev/shm. A function of its own so that a test can make /dev/shm small."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def shm_shortfall(needed_bytes: float) -> Optional[str]:
    """Why /dev/shm cannot hold `needed_bytes` of ring slots (ring.total_memory_mb), or None."""
    try:
        free = shm_free_bytes()
    except OSError as err:
        return f"ingest processes need {SHM_DIR} for frame slots, and it cannot be read ({err})"
    if free >= needed_bytes:
        return None
    mb = 2 ** 20
    return (f"ingest processes put frame slots in {SHM_DIR}: ring.total_memory_mb needs {needed_bytes / mb:.0f} MB "
            f"there but it has {free / mb:.0f} MB free (containers default to 64 MB): run the container with "
            f"--shm-size={int(needed_bytes / mb) + 64}m (Docker), lower ring.total_memory_mb, or set "
            "ingest.processes: 0 (decoders as threads in the engine process)")


PIXEL_FORMATS = ("rgb24", "nv12")


def slot_shape(pixel_format: str, h: int, w: int) -> tuple[int, ...]:
    """One slot's array shape for frames of h x w: (h, w, 3) RGB, or (h * 3 // 2, w) NV12 (the Y plane, then the
    interleaved UV plane: the layout NVDEC's frames and engine/models/colour.py use)."""
    if pixel_format == "rgb24":
        return (h, w, 3)
    if pixel_format == "nv12":
        return (h * 3 // 2, w)
    raise ValueError(f"pixel format {pixel_format!r}: allowed: {', '.join(PIXEL_FORMATS)}")


class Segment:
    """n slots of one pixel format (slot_shape) in one file under /dev/shm; the creator's or an attacher's view."""

    def __init__(self, name: str, count: int, h: int, w: int, *, create: bool, pixel_format: str = "rgb24"):
        self.name, self.count, self.h, self.w = name, count, h, w
        self.pixel_format = pixel_format
        shape = slot_shape(pixel_format, h, w)
        self.frame_bytes = int(np.prod(shape))
        size = max(1, count * self.frame_bytes)
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as err:
                    raise ShmSpaceError(err.errno, f"{SHM_DIR} has no room for {size / 2 ** 20:.0f} MB of frame slots "
                                                   f"({name}): raise the container's --shm-size or lower "
                                                   "ring.total_memory_mb") from None
            elif os.fstat(fd).st_size < size:  # a stale segment of another size: never read past its end
                raise ShmSpaceError(0, f"segment {name} is smaller than {count} slots of {w}x{h}")
            self._mmap = mmap.mmap(fd, size)  # dups fd (Python keeps a descriptor per mapping): EMFILE possible
        except BaseException:
            if create:  # never a half-made segment left in /dev/shm (its creator failed: nobody else knows it)
                Segment.remove(name)
            raise
        finally:
            os.close(fd)
        self.array = np.ndarray((count, *shape), np.uint8, buffer=self._mmap)
        if create:
            self.array.fill(0)  # prefault: every page is touched now, not in a writer's first copy

    def unlink(self) -> None:
        """Remove the name (the core only). Mappings stay valid until their views are gone."""
        Segment.remove(self.name)

    @staticmethod
    def remove(name: str) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
