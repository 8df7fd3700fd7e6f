"""Per-stream frame accounting of one pool, with an in-flight count that can disagree.

Every frame a pool ingests ends in exactly one terminal state: published, dropped(reason) or
failed(reason). The terminal counters are counted where the frame ends. `in_flight` is NOT
derived from them: it is counted from the frames the pipeline's holders really hold (the rings'
ready slots, the scheduler, the batches on the workers, the output stage, the publisher's
queues), each of which registers a counting function here. So

    ingested == published + dropped + failed + in_flight

is a check that fails when a frame leaks (a holder loses it without a terminal state) or is
counted twice, not an identity.

One re-entrant lock per pool (`lock`, the pool's ledger lock) guards the counters AND every
holder's containers: a frame moves from one holder to the next, or to its terminal state, inside
one critical section, so the check holds at every moment a snapshot is taken, not just at rest.
The rings' condition variables are built on this lock for the same reason. Critical sections
are a few dict and deque operations; pixels are never copied under it.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

LATENCY_WINDOW = 1024  # recent latencies per stream for p50/p99; bounded on purpose

Holder = Callable[[], Counter]  # frames held, by stream; called with the pool's lock held


@dataclass
class StreamCounts:
    ingested: int = 0
    published: int = 0
    dropped: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    late_at_source: int = 0  # of dropped[deadline]: dropped at the source (Accounting.late_at_source)

    def terminal(self) -> int:
        return self.published + sum(self.dropped.values()) + sum(self.failed.values())


@dataclass(frozen=True)
class Snapshot:
    stream: str
    ingested: int
    published: int
    dropped: dict
    failed: dict
    in_flight: int   # frames the holders hold (counted, not derived)
    held: dict       # the same, per holder
    p50_ms: float
    p99_ms: float

    def balanced(self) -> bool:
        return self.ingested == self.published + sum(self.dropped.values()) + sum(self.failed.values()) + self.in_flight


def _key(reason) -> str:
    """A DropReason/FailReason or its string: the counters' key."""
    return str(getattr(reason, "value", reason))


class Accounting:
    """Thread-safe counters of one pool, keyed by stream, and the registry of frame holders."""

    def __init__(self, pool: str):
        self.pool = pool
        self.lock = threading.RLock()
        self._streams: dict[str, StreamCounts] = {}
        self._holders: dict[str, tuple[Holder, str | None]] = {}  # name -> (count, the one stream it holds or None)

    # -- holders -------------------------------------------------------------------------
    def add_holder(self, name: str, count: Holder, stream: str | None = None) -> None:
        """`stream`: the holder only ever holds that stream's frames (a ring): a snapshot of another stream does
        not ask it. Why: snapshot(s) is taken for every stream by a metrics scrape, the status line and a cluster
        heartbeat, and asking all N rings for each of N streams held the ledger lock and the GIL ~40 ms at 48
        streams (bench_host's samples), stalling the pipeline."""
        with self.lock:
            self._holders[name] = (count, stream)

    def remove_holder(self, name: str) -> None:
        with self.lock:
            self._holders.pop(name, None)

    def _held_for(self, stream: str) -> dict[str, Counter]:
        """What every holder that may hold `stream`'s frames holds (lock held)."""
        return {name: count() for name, (count, only) in self._holders.items() if only is None or only == stream}

    def _held(self) -> dict[str, Counter]:
        return {name: count() for name, (count, _) in self._holders.items()}

    def held(self, stream: str, *, exclude: tuple[str, ...] = ()) -> int:
        """Frames of `stream` held anywhere in this pool (but in the holders named in `exclude`)."""
        with self.lock:
            return sum(n[stream] for name, n in self._held_for(stream).items() if name not in exclude)

    def held_by_stream(self, *, exclude_prefix: str) -> Counter:
        """Frames held, by stream, in every holder whose name does not start with `exclude_prefix`:
        one pass over the holders for all streams (the core's per-step credit check)."""
        with self.lock:
            total: Counter = Counter()
            for name, (count, _) in self._holders.items():
                if not name.startswith(exclude_prefix):
                    total.update(count())
            return total

    # -- terminal counters ----------------------------------------------------------------
    def _get(self, stream: str) -> StreamCounts:
        c = self._streams.get(stream)
        if c is None:
            c = self._streams[stream] = StreamCounts()
        return c

    def ingest(self, stream: str, n: int = 1) -> None:
        with self.lock:
            self._get(stream).ingested += n

    def publish(self, stream: str, latency_ms: float) -> None:
        with self.lock:
            c = self._get(stream)
            c.published += 1
            c.latencies_ms.append(latency_ms)

    def drop(self, stream: str, reason: str, n: int = 1) -> None:
        with self.lock:
            self._get(stream).dropped[_key(reason)] += n

    def dropped_for(self, stream: str, reason: str) -> int:
        """How many of the stream's frames were dropped with `reason` so far (0 for a stream never seen)."""
        with self.lock:
            c = self._streams.get(stream)
            return c.dropped.get(_key(reason), 0) if c is not None else 0

    def fail(self, stream: str, reason: str, n: int = 1) -> None:
        with self.lock:
            self._get(stream).failed[_key(reason)] += n

    def forget(self, stream: str) -> None:
        """A removed stream's entry goes (bounded memory and metric series under churn)."""
        with self.lock:
            self._streams.pop(stream, None)

    # -- reading ----------------------------------------------------------------------------
    def streams(self) -> list[str]:
        with self.lock:
            return list(self._streams)

    def late_at_source(self, stream: str, n: int) -> None:
        """n of the stream's `deadline` drops happened at its source (past their deadline when decoded, or
        skipped undecoded to reach the live edge): the ingest fell behind, not the pool. Counted apart so the
        degradation ladder does not thin a pool for them (sched/qos.py); the drops themselves are counted by drop()."""
        with self.lock:
            self._get(stream).late_at_source += n

    def late_at_source_total(self, streams) -> int:
        with self.lock:
            return sum(c.late_at_source for s in streams if (c := self._streams.get(s)) is not None)

    def totals(self, streams) -> tuple[int, Counter]:
        """Ingested and dropped-by-reason summed over these streams: terminal counters only, no holder
        is asked (the degradation ladder reads this twice a second)."""
        ingested, dropped = 0, Counter()
        with self.lock:
            for stream in streams:
                c = self._streams.get(stream)
                if c is not None:
                    ingested += c.ingested
                    dropped.update(c.dropped)
        return ingested, dropped

    def recent_latencies(self, stream: str, n: int) -> list[float]:
        """The latencies (ms) of the stream's last `n` published results (at most the window's)."""
        with self.lock:
            c = self._streams.get(stream)
            if c is None or n <= 0:
                return []
            lat = c.latencies_ms
            return [lat[i] for i in range(max(0, len(lat) - n), len(lat))]

    def snapshot(self, stream: str) -> Snapshot:
        with self.lock:
            c = self._streams.get(stream) or StreamCounts()
            held = {name: n[stream] for name, n in self._held_for(stream).items() if n[stream]}
            lat = np.asarray(c.latencies_ms, dtype=np.float64)
            snap = Snapshot(stream, c.ingested, c.published, dict(c.dropped), dict(c.failed),
                            sum(held.values()), held, float("nan"), float("nan"))
        if lat.size:  # percentiles outside the lock
            p50, p99 = np.percentile(lat, [50, 99]).tolist()
            snap = Snapshot(**{**snap.__dict__, "p50_ms": p50, "p99_ms": p99})
        return snap

    def audit(self) -> dict[str, tuple[int, int]]:
        """Streams whose counters and holders disagree: {stream: (ingested - terminal, held)}."""
        with self.lock:
            held: Counter = Counter()
            for n in self._held().values():
                held.update(n)
            out = {}
            for stream in set(self._streams) | set(held):
                c = self._streams.get(stream) or StreamCounts()
                if c.ingested - c.terminal() != held[stream]:
                    out[stream] = (c.ingested - c.terminal(), held[stream])
            return out
