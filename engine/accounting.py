"""Per-stream frame accounting: ingested == published + dropped + failed + in_flight.

One lock guards every counter of a pool, so the equation holds at every moment a
snapshot is taken (metrics, status line, tests). Latencies are kept in bounded windows.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

LATENCY_WINDOW = 1024  # recent latencies per stream for p50/p99; bounded on purpose


@dataclass
class StreamCounts:
    ingested: int = 0
    published: int = 0
    dropped: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))

    @property
    def in_flight(self) -> int:
        return self.ingested - self.published - sum(self.dropped.values()) - sum(self.failed.values())


@dataclass(frozen=True)
class Snapshot:
    stream: str
    ingested: int
    published: int
    dropped: dict
    failed: dict
    in_flight: int
    p50_ms: float
    p99_ms: float

    def balanced(self) -> bool:
        return self.ingested == self.published + sum(self.dropped.values()) + sum(self.failed.values()) + self.in_flight


class Accounting:
    """Thread-safe counters of one pool, keyed by stream."""

    def __init__(self, pool: str):
        self.pool = pool
        self._lock = threading.Lock()
        self._streams: dict[str, StreamCounts] = {}

    def _get(self, stream: str) -> StreamCounts:
        c = self._streams.get(stream)
        if c is None:
            c = self._streams[stream] = StreamCounts()
        return c

    def ingest(self, stream: str, n: int = 1) -> None:
        with self._lock:
            self._get(stream).ingested += n

    def publish(self, stream: str, latency_ms: float) -> None:
        with self._lock:
            c = self._get(stream)
            c.published += 1
            c.latencies_ms.append(latency_ms)

    def drop(self, stream: str, reason: str, n: int = 1) -> None:
        with self._lock:
            self._get(stream).dropped[str(getattr(reason, "value", reason))] += n

    def fail(self, stream: str, reason: str, n: int = 1) -> None:
        with self._lock:
            self._get(stream).failed[str(getattr(reason, "value", reason))] += n

    def streams(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def in_flight(self, stream: str) -> int:
        with self._lock:
            return self._get(stream).in_flight

    def snapshot(self, stream: str) -> Snapshot:
        with self._lock:
            c = self._get(stream)
            lat = np.asarray(c.latencies_ms, dtype=np.float64)
            p50, p99 = (np.percentile(lat, [50, 99]).tolist() if lat.size else (float("nan"),) * 2)
            return Snapshot(stream, c.ingested, c.published, dict(c.dropped), dict(c.failed),
                            c.in_flight, p50, p99)
