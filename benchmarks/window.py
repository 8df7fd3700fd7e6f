"""Counts of a running engine's pool over a window, for gpu_check's live parts: what was ingested and
published per stream in `seconds` after `warm_s`, drops by reason, and the worst stream's p50/p99."""

from __future__ import annotations

import time


def window_counts(acct, ids: list[str], *, warm_s: float, seconds: float) -> dict:
    """acct: a pool's Accounting (engine.frames.accounting); ids: its streams."""
    time.sleep(warm_s)
    before = {i: acct.snapshot(i) for i in ids}
    time.sleep(seconds)
    after = {i: acct.snapshot(i) for i in ids}
    ing = sum(after[i].ingested - before[i].ingested for i in ids)
    pub = sum(after[i].published - before[i].published for i in ids)
    drops: dict = {}
    for i in ids:
        for k, v in after[i].dropped.items():
            drops[k] = drops.get(k, 0) + v - before[i].dropped.get(k, 0)
    return {"goodput": round(pub / max(ing, 1), 4), "ingested": ing, "published": pub,
            "in_per_s": round(ing / seconds, 1), "dropped": drops,
            "p50_ms": max(after[i].p50_ms for i in ids), "p99_ms": max(after[i].p99_ms for i in ids)}
