"""`synthetic://...&fps=auto`: the rate of a synthetic stream chosen from the pools' measured speed.

The CPU demo fed a 30 fps stream to ViT-Ti at ~28 ms a frame on two cores (the model alone measures ~14 ms;
rendering, the live view and publishing share the same cores): it degraded at once, and a newcomer's first
minute showed drops. With `fps=auto` the engine picks, when the stream is added, the largest usual rate
(`RATES`, at most 30) within HEADROOM of what every pool the stream feeds measured at warm-up, shared among
the streams that pool already has, and logs the choice with its numbers. A rate is only chosen, never
changed later: the degradation demo (configs/demo-overload.yaml) keeps a fixed 30 fps.
"""

from __future__ import annotations

import math
from typing import Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from streams.synthetic import AUTO_FPS

#: the rates chosen from (frames per second): what cameras and the demo run at
RATES = (1, 2, 5, 10, 12, 15, 20, 24, 25, 30)
#: the share of a pool's measured frames/s a stream may take: the model's forward alone was timed at warm-up,
#: while preprocessing, the pattern's rendering, the live view's JPEG encoding and the publisher run beside it
#: on the same cores (measured on the 2-core machine: ViT-Ti 14 ms a frame alone, 28-36 ms in the demo; at half
#: the warm-up's rate, 30 fps, a frame that took longer than its 33 ms interval was superseded now and then)
HEADROOM = 0.35


def pool_frames_per_s(pool, streams: int) -> Optional[float]:
    """What a pool's warm-up says one more live stream can get a second: the pool's workers x its batch / that
    batch's estimate, shared with the `streams` it has, and at most its workers / batch 1's estimate (a live
    stream offers one frame per batch: freshest first)."""
    b = pool.scheduler.max_batch
    one, full = pool.scheduler.latency.estimate(1), pool.scheduler.latency.estimate(b)
    if not one or not full or not (math.isfinite(one) and math.isfinite(full)):
        return None
    workers = len(pool.slots.models)
    return min(workers / one, workers * b / full / (streams + 1))


def choose_rate(capacities: dict[str, float]) -> tuple[int, str]:
    """The rate for a new stream: `capacities` is pool -> the frames/s its warm-up says the stream can get
    (pool_frames_per_s). Returns (fps, why)."""
    if not capacities:
        return RATES[-1], f"no pool measured its speed: {RATES[-1]} fps"
    slowest = min(capacities, key=capacities.get)
    fps = max([r for r in RATES if r <= HEADROOM * capacities[slowest]], default=RATES[0])
    why = (f"pool {slowest} measured {capacities[slowest]:.0f} frames/s for this stream at warm-up; {HEADROOM:.0%} "
           f"of it, the rest left for this machine's other work (decoding, the live view, publishing): {fps} fps")
    return fps, why


def resolve(url: str, pools: dict, pool_names: list[str], streams_per_pool: dict[str, int]) -> tuple[str, Optional[str]]:
    """The URL with `fps=auto` replaced by the chosen rate, and why (None when the URL has no fps=auto)."""
    u = urlsplit(url)
    if u.scheme != "synthetic":
        return url, None
    query = parse_qsl(u.query, keep_blank_values=True)
    if (("fps", AUTO_FPS)) not in query:
        return url, None
    capacities = {}
    for name in pool_names:
        fps = pool_frames_per_s(pools[name], streams_per_pool.get(name, 0))
        if fps is not None:
            capacities[name] = fps
    fps, why = choose_rate(capacities)
    query = [(k, str(fps) if (k, v) == ("fps", AUTO_FPS) else v) for k, v in query]
    return urlunsplit(u._replace(query=urlencode(query, safe="x"))), why
