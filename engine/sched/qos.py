"""Quality of service of one pool under overload: drives its degradation ladder (ladder.py) with the
pool's own signals, samples live streams at the rung's interval, and announces every step.

The core thread calls `step(now, ...)` once per pool step and `keep(stream)` for each live frame it
pulls; the SAM 2 pool's quality level travels with each batch (`level`) to its workers.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from engine.frames.accounting import Accounting
from engine.config import QosConfig
from engine.frames.lifecycle import DropReason
from engine.sched.ladder import Ladder, Step

log = logging.getLogger("vidar.qos")

LOAD_DROPS = (DropReason.DEADLINE, DropReason.SUPERSEDED, DropReason.LATE, DropReason.RING_FULL)


class PoolQos:
    def __init__(self, pool: str, qos: QosConfig, acct: Accounting, *, levels: list[str],
                 level_costs: Optional[list[float]], emit: Callable[[str, str, str, dict], None]):
        self.pool, self.acct, self._emit = pool, acct, emit
        self.levels = levels or ["as configured"]
        self.ladder = Ladder(qos, max_interval=1, level_costs=level_costs) if qos.ladder else None
        self._max_interval: dict[str, int] = {}  # live streams only
        self._taken: dict[str, int] = {}         # live frames pulled since the interval last changed
        self._interval = 1
        self._busy_s = self._cap_s = self._busy_seen = self._out_seen = 0.0
        self._t: Optional[float] = None

    # -- streams (core thread) ----------------------------------------------------------------------
    def attach(self, stream: str, *, live: bool, max_interval: int) -> None:
        if live:
            self._max_interval[stream] = max_interval
            self._resize()

    def detach(self, stream: str) -> None:
        self._max_interval.pop(stream, None)
        self._taken.pop(stream, None)
        self._resize()

    def _resize(self) -> None:
        if self.ladder is not None:
            self.ladder.resize(max(self._max_interval.values(), default=1))
            self._sync_interval()

    @property
    def level(self) -> int:
        return self.ladder.rung.level if self.ladder else 0

    def interval(self, stream: str) -> int:
        return min(self._interval, self._max_interval.get(stream, 1))

    def keep(self, stream: str) -> bool:
        """A live frame pulled from the ring: False if the interval rung samples it out (regularly:
        frames 0, k, 2k, ... since the interval last changed)."""
        n = self._taken.get(stream, 0)
        self._taken[stream] = n + 1
        return n % self.interval(stream) == 0

    def _sync_interval(self) -> None:
        if self.ladder.rung.interval != self._interval:
            self._interval = self.ladder.rung.interval
            self._taken.clear()  # the next frame of every stream is processed

    # -- signals (core thread) -----------------------------------------------------------------------
    def step(self, now: float, *, busy_s: float, workers: int, output_busy_s: float = 0.0) -> Optional[Step]:
        """busy_s: the workers' busy seconds so far, as they measured them; output_busy_s: the output
        stage's (one thread: SAM 2's tracking stage runs there). The pool is as busy as its busier stage:
        each step adds the larger of the two, in worker-seconds. (Counting the workers busy at each step
        instead missed the batches the core slept through: the step a finished batch wakes sees its
        worker idle. A worker busy 0.3 of the time read 0.0; the ladder's restore check and the
        cluster's placement saw no load.) A slot or output thread replaced after a hang takes its total
        with it: a reading below the last adds nothing."""
        if self._t is not None:
            d_work = max(0.0, busy_s - self._busy_seen)
            d_out = max(0.0, output_busy_s - self._out_seen)
            self._busy_s += max(d_work, d_out * workers)
            self._cap_s += (now - self._t) * workers
        self._busy_seen, self._out_seen = busy_s, output_busy_s
        self._t = now
        if self.ladder is None or not self.ladder.due(now):
            return None
        ingested, dropped = self.acct.totals(self._max_interval)
        # frames late at their source (decoded past their deadline, or skipped to the live edge) never reached the
        # pool: the ingest fell behind, and thinning the pool would not bring them back (48 RTSP cameras on 2 cores,
        # budget 17 ms: the ladder went to 1 in 4 for them, and 36 of the 1,790 frames/s that got in were
        # published); neither offered nor dropped here
        late = self.acct.late_at_source_total(self._max_interval)
        offered = ingested - dropped[DropReason.INTERVAL.value] - late
        drops = sum(dropped[r.value] for r in LOAD_DROPS) - late
        step = self.ladder.observe(now, offered=offered, load_drops=drops, busy_s=self._busy_s,
                                   capacity_s=self._cap_s)
        if step is not None:
            self._sync_interval()
            self._announce(step)
        return step

    def _announce(self, step: Step) -> None:
        what = self.describe(step.interval, step.level)
        log.warning("pool %s: %s to rung %d (%s): %s", self.pool, step.direction, step.rung, what, step.why)
        fields = {"pool": self.pool, "rung": step.rung, "interval": step.interval, "level": self.levels[step.level]}
        for stream in list(self.acct.streams()):
            self._emit(stream, step.direction, f"pool {self.pool}: {what} ({step.why})", fields)

    def describe(self, interval: int, level: int) -> str:
        parts = ["every frame" if interval == 1 else f"1 frame in {interval} of each live stream"]
        if level:
            parts.append(self.levels[level])
        return ", ".join(parts)

    def busy(self) -> tuple[float, float]:
        """(worker-seconds busy, worker-seconds available) since the pool started: the busy share of an
        interval is the ratio of two readings' differences (the cluster's placement reads it)."""
        return self._busy_s, self._cap_s

    def state(self) -> dict:
        """For metrics and the status line."""
        if self.ladder is None:
            return {"rung": 0, "interval": 1, "level": 0, "degraded": 0, "restored": 0}
        r = self.ladder.rung
        return {"rung": self.ladder.index, "interval": r.interval, "level": r.level, **self.ladder.steps}
