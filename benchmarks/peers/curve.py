"""The no-collapse check of the host benchmarks (bench_peers.py, bench_host.py): frames/s by stream count."""

from __future__ import annotations

COLLAPSE_TOLERANCE = 0.03  # a count "falls" below the best smaller one by more than this (run-to-run noise here)


def falls_at(points: list[tuple[int, float]]) -> list[int]:
    """The stream counts (ascending `points` of (count, frames/s)) whose frames/s is below the best of the smaller
    counts by more than COLLAPSE_TOLERANCE: where adding cameras cost frames."""
    best, falls = 0.0, []
    for n, v in points:
        if v < best * (1 - COLLAPSE_TOLERANCE):
            falls.append(n)
        best = max(best, v)
    return falls
