"""Counts of a running engine's pool over a window, for gpu_check's live parts: what was ingested and
published per stream in `seconds` after `warm_s`, drops by reason, and the p50/p99 latency of the results
published inside the window (all streams together, and the worst stream's p99)."""

from __future__ import annotations

import time

import numpy as np


def window_counts(acct, ids: list[str], *, warm_s: float, seconds: float) -> dict:
    """acct: a pool's Accounting (engine.frames.accounting); ids: its streams. The percentiles are of the
    window's results only: the accounting's own keep the last 1,024 since start, warm-up included."""
    time.sleep(warm_s)
    before = {i: acct.snapshot(i) for i in ids}
    time.sleep(seconds)
    after = {i: acct.snapshot(i) for i in ids}
    # the latencies of each stream's results published in the window (its last `published` ones); taken
    # right after the snapshots, so a result or two published since may stand in for the window's first
    lat = {i: acct.recent_latencies(i, after[i].published - before[i].published) for i in ids}
    ing = sum(after[i].ingested - before[i].ingested for i in ids)
    pub = sum(after[i].published - before[i].published for i in ids)
    drops: dict = {}
    for i in ids:
        for k, v in after[i].dropped.items():
            drops[k] = drops.get(k, 0) + v - before[i].dropped.get(k, 0)
    every = [x for v in lat.values() for x in v]
    pct = np.percentile(every, [50, 99]).round(2).tolist() if every else [None, None]
    worst = max((float(np.percentile(v, 99)) for v in lat.values() if v), default=None)
    return {"goodput": round(pub / max(ing, 1), 4), "ingested": ing, "published": pub,
            "in_per_s": round(ing / seconds, 1), "dropped": drops, "p50_ms": pct[0], "p99_ms": pct[1],
            "worst_stream_p99_ms": round(worst, 2) if worst is not None else None}
