"""Earliest-deadline-first batch scheduler. Pure: no I/O, no model, no clock of its own.

The pool calls `schedule(now)` whenever its worker is free and feeds measured run times
back with `update`. Rules, in order:
1. A frame that cannot finish by its deadline even in a batch of one is dropped now,
   before any compute is spent (reason `deadline`).
2. Frames are ordered fairly: the streams in rounds, least recently served first. Plain EDF across
   streams phase-locks under overload: the same streams' frames always age out just before
   their turn, and those streams starve (measured: 2 of 4 streams got 4 % of their frames).
   An offline stream (no deadlines) gives its frames in arrival order, every one of them.
   A live stream gives only its NEWEST frame (freshest first): when a live stream's newest frame
   goes into a batch, its older pending frames are dropped (reason `superseded`), so a stream
   is never processed out of order (SAM 2's memory needs order) and, under overload, what is
   published is the newest frame rather than the oldest one that can still make it (which put
   published latency next to the budget). Without overload nothing is superseded: with the
   pool keeping up, a stream has one frame pending when a worker frees (a second one arrives
   only after `max_wait_s`-bounded batching ended or while every worker was busy).
3. The batch size is the largest b <= max_batch whose predicted run time still meets the
   earliest deadline among the first b frames of that order.
   Exception, the probe: when every waiting frame would be dropped and nothing has run for
   `probe_interval_s`, the newest frame runs anyway, alone. Without it, one slow spell that
   pushes the estimate past the budget would drop every frame for ever (nothing new is ever
   measured). A probe that finishes late is dropped as `late`, so it is never published late.
4. The batch is dispatched when it is full, when it cannot grow without missing a deadline,
   when waiting for one more frame would miss the earliest deadline, or when its oldest
   frame has waited `max_wait_s` (bounded batching delay). Otherwise `wake_at` says when to ask again.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.sched.latency import LatencyModel


@dataclass(order=True)
class _Entry:
    deadline: float
    order: int
    enqueued: float = field(compare=False)
    item: Any = field(compare=False)
    key: Any = field(compare=False, default=None)  # the stream: fairness is across keys


@dataclass
class Plan:
    batch: list = field(default_factory=list)     # items to run now, EDF order
    dropped: list = field(default_factory=list)   # items dropped for their deadline
    superseded: list = field(default_factory=list)  # live items older than their stream's newest dispatched
    wake_at: Optional[float] = None               # ask again at this time if nothing new arrives


class EdfScheduler:
    """Items need a `deadline` attribute or are passed with one to `add`."""

    def __init__(self, *, max_batch: int, latency: LatencyModel, max_wait_s: float = 0.004,
                 probe_interval_s: float = 1.0):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.latency = latency
        self.max_wait_s = max_wait_s
        self.probe_interval_s = probe_interval_s
        self._pending: list[_Entry] = []
        self._order = itertools.count()
        self._last_dispatch: Optional[float] = None
        self.probes = 0
        self._served: dict = {}  # key -> dispatch tick when last served (round-robin across streams)
        self._newest: dict = {}  # live key -> arrival order of its newest dispatched item
        self._tick = itertools.count()

    def add(self, item: Any, *, deadline: float, now: float, key: Any = None) -> None:
        self._pending.append(_Entry(deadline, next(self._order), now, item, key))

    def forget(self, key: Any) -> None:
        """A stream went away: drop its fairness state (keeps the table bounded)."""
        self._served.pop(key, None)
        self._newest.pop(key, None)

    def _fair_order(self, entries: list[_Entry]) -> list[_Entry]:
        groups: dict[Any, list[_Entry]] = {}
        for e in sorted(entries):
            groups.setdefault(e.key, []).append(e)
        for k, g in groups.items():
            if math.isfinite(g[-1].deadline):  # live: its newest frame only (the rest wait to be superseded)
                groups[k] = [max(g, key=lambda e: e.order)]
        keys = sorted(groups, key=lambda k: (self._served.get(k, -1), groups[k][0].deadline, groups[k][0].order))
        out = []
        for r in range(max(len(g) for g in groups.values())):
            out.extend(groups[k][r] for k in keys if r < len(groups[k]))
        return out

    def pending(self) -> int:
        return len(self._pending)

    def remove(self, predicate) -> list:
        """Take out every pending item for which predicate(item) is true (stream removed)."""
        keep, out = [], []
        for e in self._pending:
            (out if predicate(e.item) else keep).append(e)
        self._pending = keep
        return [e.item for e in out]

    def count(self, predicate) -> int:
        return sum(1 for e in self._pending if predicate(e.item))

    def count_by_key(self) -> Counter:
        """Pending items per key (stream): the scheduler's part of a pool's in-flight count."""
        return Counter(e.key for e in self._pending)

    def update(self, batch_size: int, seconds: float) -> None:
        self.latency.observe(batch_size, seconds)

    def _probe_due(self, now: float) -> bool:
        if self._last_dispatch is None:
            self._last_dispatch = now  # the clock starts at the first frame seen
            return False
        return now - self._last_dispatch >= self.probe_interval_s

    def schedule(self, now: float) -> Plan:
        plan = Plan()
        est1 = self.latency.estimate(1)
        keep = []
        for e in self._pending:
            (plan.dropped if now + est1 > e.deadline else keep).append(e)
        if not keep and plan.dropped and self._probe_due(now):
            probe = max(plan.dropped, key=lambda e: (e.deadline, e.order))
            plan.dropped.remove(probe)
            plan.dropped = [e.item for e in plan.dropped]
            plan.batch, self._pending = [probe.item], []
            if math.isfinite(probe.deadline):
                self._newest[probe.key] = probe.order
            self._last_dispatch, self.probes = now, self.probes + 1
            return plan
        plan.dropped = [e.item for e in plan.dropped]
        if not keep:
            self._pending = []
            return plan
        self._pending = keep
        keep = self._fair_order(keep)
        n = min(self.max_batch, len(keep))
        b, tightest = 1, keep[0].deadline
        while b < n and now + self.latency.estimate(b + 1) <= min(tightest, keep[b].deadline):
            tightest = min(tightest, keep[b].deadline)
            b += 1
        earliest = min(e.deadline for e in keep)
        oldest = min(e.enqueued for e in keep)
        full = b == self.max_batch
        capped = b < n  # more frames are waiting but a bigger batch would miss a deadline
        grow = min(b + 1, self.max_batch)
        t_latest = earliest - self.latency.estimate(grow)  # last moment to wait for one more
        t_wait = oldest + self.max_wait_s
        if full or capped or now >= t_wait or (math.isfinite(t_latest) and now >= t_latest):
            chosen = sorted(keep[:b], key=lambda e: e.order)  # arrival order: a stream's frames in sequence
            plan.batch = [e.item for e in chosen]
            for e in chosen:
                self._served[e.key] = next(self._tick)
                if math.isfinite(e.deadline):
                    self._newest[e.key] = e.order
            rest, taken = [], {id(e) for e in chosen}
            for e in self._pending:
                if id(e) in taken:
                    continue
                older = e.key in self._newest and e.order < self._newest[e.key]
                (plan.superseded if older else rest).append(e)
            plan.superseded = [e.item for e in plan.superseded]
            self._pending = rest
            self._last_dispatch = now
            if self._pending:
                plan.wake_at = now
        else:
            plan.wake_at = min(t_wait, t_latest)
        return plan
