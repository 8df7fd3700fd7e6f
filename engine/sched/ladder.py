"""The degradation ladder of one pool. Pure: no I/O, no clock of its own (`observe(now, ...)`).

Rungs, best first:
  0            as configured: every frame is offered to the scheduler
  1 .. K-1     every (r+1)-th frame of each live stream (capped by the stream's `max_interval`): the
               others are dropped as `interval`, regularly, as DeepStream's `interval` does, instead
               of at random for their deadline
  K ..         the family's lower quality levels (SAM 2: smaller input sizes), at the largest interval
K = the pool's largest `max_interval` (a stream with a smaller one is sampled at most that sparsely).

Signals, per tick (the pool feeds cumulative counters of its live frames):
  drop share  = frames dropped for load (deadline, superseded, late, ring_full) / frames offered
                (ingested minus those sampled out by the interval rung)
  busy share  = worker-seconds busy / worker-seconds available
Step down when the drop share stays above `degrade_drop_share` for `degrade_after_s`; step up when,
for `restore_after_s`, the drop share stays below half of it and the busy share the workers would
have at the rung above (busy x the cost ratio of the two rungs) stays below `restore_load`. A step
restarts both timers, so the ladder moves at most one rung per window and cannot oscillate faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.config import QosConfig

TICK_S = 0.5  # signals are taken over ticks of this length


@dataclass(frozen=True)
class Rung:
    interval: int  # process every k-th frame of a live stream (1: all)
    level: int     # the family's quality level (0: as configured)


@dataclass(frozen=True)
class Step:
    direction: str  # "degraded" | "restored"
    rung: int
    interval: int
    level: int
    why: str


def rungs(max_interval: int, levels: int) -> list[Rung]:
    out = [Rung(k, 0) for k in range(1, max(1, max_interval) + 1)]
    out += [Rung(out[-1].interval, lv) for lv in range(1, max(1, levels))]
    return out


class Ladder:
    def __init__(self, qos: QosConfig, *, max_interval: int, level_costs: Optional[list[float]] = None):
        """level_costs: relative cost of each quality level (level 0 = 1.0), to predict the load a
        step up would bring (SAM 2: (size / configured size)^2, the encoder's pixels)."""
        self.qos = qos
        self.level_costs = level_costs or [1.0]
        self.rungs = rungs(max_interval, len(self.level_costs))
        self.index = 0
        self.steps = {"degraded": 0, "restored": 0}
        self._tick_start: Optional[float] = None
        self._last = (0, 0, 0.0, 0.0)  # offered, load drops, busy s, capacity s at the tick's start
        self._over_since: Optional[float] = None
        self._slack_since: Optional[float] = None
        self.drop_share = 0.0
        self.busy_share = 0.0

    @property
    def rung(self) -> Rung:
        return self.rungs[self.index]

    def resize(self, max_interval: int) -> None:
        """Streams came or went: the interval rungs follow the largest max_interval. The quality level
        is kept; the interval is clamped to the new largest."""
        new = rungs(max_interval, len(self.level_costs))
        if new == self.rungs:
            return
        cur, top = self.rung, new[-1].interval
        want = Rung(min(cur.interval, top) if cur.level == 0 else top, cur.level)
        self.rungs, self.index = new, new.index(want)

    def due(self, now: float) -> bool:
        return self._tick_start is None or now - self._tick_start >= TICK_S

    def _cost(self, r: Rung) -> float:
        return self.level_costs[r.level] / r.interval

    def observe(self, now: float, *, offered: int, load_drops: int, busy_s: float, capacity_s: float
                ) -> Optional[Step]:
        """Cumulative counters of the pool. Returns a step when the ladder moves."""
        if self._tick_start is None:
            self._tick_start, self._last = now, (offered, load_drops, busy_s, capacity_s)
            return None
        if now - self._tick_start < TICK_S:
            return None
        o0, d0, b0, c0 = self._last
        d_off, d_drop, d_busy, d_cap = offered - o0, load_drops - d0, busy_s - b0, capacity_s - c0
        self._tick_start, self._last = now, (offered, load_drops, busy_s, capacity_s)
        if d_off < 0 or d_drop < 0:  # a stream left and took its counters: no signal this tick
            return None
        self.drop_share = d_drop / d_off if d_off > 0 else 0.0
        self.busy_share = min(1.0, d_busy / d_cap) if d_cap > 0 else 0.0
        q = self.qos
        # Thinning a pool relieves its workers: with them mostly idle (busy below restore_load) its drops come from
        # elsewhere (the host's cores taken by decoding, a stream's credit in flight), and sampling the frames that
        # do arrive only throws away work already paid for (48 RTSP cameras on 2 cores, the null pool: 1 in 4, and a
        # fifth of what the same run published with the ladder off)
        over = d_off > 0 and self.drop_share > q.degrade_drop_share and self.busy_share >= q.restore_load
        self._over_since = (self._over_since if self._over_since is not None else now) if over else None
        slack = False
        if self.index > 0 and self.drop_share < q.degrade_drop_share / 2:
            above = self.rungs[self.index - 1]
            predicted = self.busy_share * self._cost(above) / self._cost(self.rung)
            slack = predicted < q.restore_load
        self._slack_since = (self._slack_since if self._slack_since is not None else now) if slack else None
        if self._over_since is not None and now - self._over_since >= q.degrade_after_s \
                and self.index + 1 < len(self.rungs):
            return self._move(+1, now, f"{self.drop_share:.0%} of live frames dropped for load "
                                       f"(> {q.degrade_drop_share:.0%} for {q.degrade_after_s:g} s)")
        if self._slack_since is not None and now - self._slack_since >= q.restore_after_s:
            return self._move(-1, now, f"load would be {self.busy_share * self._cost(self.rungs[self.index - 1]) / self._cost(self.rung):.0%} "
                                       f"at the rung above (< {q.restore_load:.0%} for {q.restore_after_s:g} s)")
        return None

    def _move(self, delta: int, now: float, why: str) -> Step:
        self.index += delta
        self._over_since = self._slack_since = None
        direction = "degraded" if delta > 0 else "restored"
        self.steps[direction] += 1
        r = self.rung
        return Step(direction, self.index, r.interval, r.level, why)
