"""Online latency model of one worker, per batch size.

Per batch size it keeps an exponentially weighted mean and mean absolute deviation of
measured run times; the estimate is mean + k * deviation, a cheap stand-in for a high
quantile that follows drift (thermal, contention) within a few batches. Unmeasured sizes
are interpolated from measured ones, conservatively (never below a smaller size's estimate).
"""

from __future__ import annotations

import bisect


class LatencyModel:
    def __init__(self, *, alpha: float = 0.2, k: float = 2.0, prior_s: float = 0.0):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha, self.k, self.prior_s = alpha, k, prior_s
        self._mean: dict[int, float] = {}
        self._dev: dict[int, float] = {}
        self._sizes: list[int] = []

    def observe(self, batch_size: int, seconds: float) -> None:
        b = int(batch_size)
        if b not in self._mean:
            self._mean[b], self._dev[b] = seconds, seconds * 0.1
            bisect.insort(self._sizes, b)
            return
        m = self._mean[b]
        self._dev[b] += self.alpha * (abs(seconds - m) - self._dev[b])
        self._mean[b] = m + self.alpha * (seconds - m)

    def _at(self, b: int) -> float:
        return self._mean[b] + self.k * self._dev[b]

    def estimate(self, batch_size: int) -> float:
        """Predicted seconds to run a batch of this size."""
        b = int(batch_size)
        if not self._sizes:
            return self.prior_s
        if b in self._mean:
            return self._at(b)
        i = bisect.bisect_left(self._sizes, b)
        if i == 0:  # smaller than anything measured: the smallest measured is an upper bound
            return self._at(self._sizes[0])
        if i == len(self._sizes):  # larger: scale the largest measured linearly
            top = self._sizes[-1]
            return self._at(top) * b / top
        lo, hi = self._sizes[i - 1], self._sizes[i]
        f = (b - lo) / (hi - lo)
        return self._at(lo) + f * (self._at(hi) - self._at(lo))

    def measured(self) -> dict[int, float]:
        return {b: self._at(b) for b in self._sizes}

    def mean(self, batch_size: int) -> float:
        """The mean run time measured at this batch size (0.0 if never run): a cost, where `estimate` is
        a high quantile for deadlines (mean + k deviations: a first measurement alone reads 20 % above)."""
        return self._mean.get(int(batch_size), 0.0)
