"""A stream decoded in an ingest process: what the core's stream table reads (RemoteIngest), and its lease.

A lease is the I/O thread's record of one stream (leases.py owns them): which process holds it, its generation
(`gen`: one counter for the whole hub, bumped at each assignment to a process and each new geometry; a
descriptor of another generation is stale: dropped and counted, never committed), its segment (slots.py), and
the next seq (a restarted process continues it).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from engine.config import StreamConfig
from engine.frames.ring import FrameRing
from engine.ingest.slots import Segment
from engine.ingest.supervisor import IngestProcess


class RemoteIngest:
    """What the StreamTable reads from an IngestThread, for a stream decoded in an ingest process."""

    def __init__(self, submit: Callable[[tuple[str, str]], None], source: Any, ring: FrameRing, live: bool,
                 fanout: tuple[FrameRing, ...] = ()):
        self._submit, self.source, self.ring, self.live = submit, source, ring, live
        self._rings = (ring, *fanout)
        self.stream = source.stream_id
        self.state = "starting"
        self.failed = False
        self.end_reason = ""
        self.total_frames: Optional[int] = None
        self.reconnects = 0
        self.seq = 0
        self.process = "starting"   # "ingest-2 (pid 1234)": where it decodes (list, the view)
        self.lag_s: Optional[float] = None  # behind its camera, as its process last said (StreamState.lag_s)
        self.attempts: deque = deque(maxlen=64)
        self.backoff: deque = deque(maxlen=64)
        self._ended = threading.Event()

    def start(self) -> None:
        self._submit(("add", self.stream))

    def stop(self) -> None:
        """Idempotent. Its rings close now (as IngestThread.stop closes its sink); its process is told to stop it."""
        for ring in self._rings:
            ring.close()
        if not self._ended.is_set():
            self._submit(("remove", self.stream))

    def join(self, timeout: Optional[float] = None) -> bool:
        return self._ended.wait(timeout)

    def ended(self) -> None:
        """The I/O thread is done with the stream (its lease ended, or the hub closed)."""
        self._ended.set()

    @property
    def alive(self) -> bool:
        return not self._ended.is_set()


@dataclass(eq=False)
class Lease:
    cfg: StreamConfig
    ring: FrameRing          # the first pool's: its slots are the segment's, lent to the process
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
    unplaced_since: Optional[float] = None  # no process could be started for it: retried
    unplaced_tries: int = 0
    reconnects_before: int = 0  # the stream's reconnects counted before its current process (and its deaths)
    segment_retry: Optional[tuple[int, int, float, float]] = None  # (h, w, since, next try): no fd for a segment
    retry_at: float = 0.0
    fanout: tuple[FrameRing, ...] = ()  # the other pools' rings: each committed frame is copied into them here
    #: where its process decodes it (wire.AddStream.decode): "cpu", or the stream's "auto" / "cuda" when it may decode
    #: with NVDEC (ingest.gpu_transport shm: NV12 copied into host slots)
    decode: str = "cpu"

    @property
    def stream(self) -> str:
        return self.cfg.id

    @property
    def rings(self) -> tuple[FrameRing, ...]:
        return (self.ring, *self.fanout)
