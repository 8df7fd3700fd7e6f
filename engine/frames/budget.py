"""The engine-wide frame-memory budget: every ring's slots, all streams together, within one bound.

A ring sizes itself from `ring.memory_mb` (clamped to [min_slots, max_slots]), so one stream of huge
frames takes min_slots x its frame size whatever memory_mb says (one 8192x8192 synthetic stream took
the process from 845 MB to 3.1 GB), and `max_streams` of them could take the machine. Each ring reserves
its slots here before it allocates them (when its first frame's size is known, or at `add_stream` when
the source knows its size before opening) and gives the reservation back once its slots are freed. A
reservation that does not fit fails that stream with an error naming the numbers and the keys; the
other streams never notice.

One lock, taken after a ring's (the ledger lock), never before it.
"""

from __future__ import annotations

import threading

from engine.errors import SourceError

MB = 2 ** 20


class FrameMemoryBudget:
    def __init__(self, total_bytes: float):
        self.total_bytes = float(total_bytes)
        self._lock = threading.Lock()
        self._held: dict[object, tuple[str, int]] = {}  # ring -> (stream, bytes); the ring itself is the key
        self.refused = 0  # reservations refused so far (each failed a stream)

    def reserve(self, owner: object, stream: str, nbytes: int, what: str) -> None:
        """Hold `nbytes` for `owner` (replacing what it held). Raises SourceError naming the stream, the
        numbers and the keys to change when the budget cannot take it."""
        with self._lock:
            others = sum(b for k, (_, b) in self._held.items() if k is not owner)
            if others + nbytes > self.total_bytes:
                self.refused += 1
                raise SourceError(stream, f"{what} need {nbytes / MB:.0f} MB of ring memory; ring.total_memory_mb="
                                          f"{self.total_bytes / MB:.0f} has {max(0.0, self.total_bytes - others) / MB:.0f} "
                                          "MB left for it: remove a stream, lower its resolution or ring.min_slots, or "
                                          "raise ring.total_memory_mb")
            self._held[owner] = (stream, int(nbytes))

    def release(self, owner: object) -> None:
        with self._lock:
            self._held.pop(owner, None)

    def used_bytes(self) -> int:
        with self._lock:
            return sum(b for _, b in self._held.values())

    def by_stream(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for stream, b in self._held.values():
                out[stream] = out.get(stream, 0) + b
            return out


def total_memory_bytes(total_memory_mb) -> float:
    """ring.total_memory_mb in bytes; `auto`: a quarter of the memory this process may use (the models,
    the decoders' own buffers and the view need the rest): the machine's physical memory, or its
    container's cgroup limit when that is lower."""
    if total_memory_mb != "auto":
        return float(total_memory_mb) * MB
    return usable_memory_bytes() / 4


def usable_memory_bytes() -> float:
    import os
    try:
        physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: assume 16 GiB
        physical = 16.0 * 2 ** 30
    limits = [physical]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit():  # v2 says `max` when unlimited; v1 a huge number
            limits.append(float(text))
    return min(limits)
