"""Defaults that fit the machine: worker instances and intra-op threads per pool, when the config
leaves them unset. Pure functions of the cores, the pools, the streams' mode and the device (no
model, no clock), so they are tested as a table; `Engine` applies them and logs the choice.

Offline streams (throughput): many one-thread instances. OpenMP's parallel regions are
barrier-synchronised, so an instance with k threads stalls whenever the decoder (or another pool)
takes one of its cores, and small models do not scale across threads anyway. Measured on 2 cores,
vit_tiny at batch 4: 2 instances x 1 thread ran 1.1-1.5x the frames/s of 1 instance x 2 threads
(benchmarks/RESULTS.md). The model is shared, so an instance costs only its activations.

Live streams (latency): one instance with the pool's cores, because a deadline is per frame and a
frame on one thread takes nearly twice as long. Measured on 2 cores, `make run`'s demo (vit_tiny,
30 fps): 1 x 2 threads published at p50 33 ms, 2 x 1 thread at p50 63 ms, both keeping up. When a
live pool cannot keep up, the degradation ladder samples the streams (ladder.py).

Past 8 threads per instance (live) or 8 instances (offline) per pool, the rule adds the other kind:
16 cores, one pool: live 2 x 8, offline 8 x 2; two pools: live 1 x 8, offline 8 x 1 each. This rule
is not measured on 16 cores (our machines have 2). On a GPU the instance count stays 1 (each instance
has its own CUDA stream; more do not make the GPU faster): untested here, no GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

MAX_INSTANCES = 8  # per pool, offline; beyond, extra cores become intra-op threads (see above)
MAX_THREADS = 8    # per instance, live; beyond, extra cores become instances


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's cpuset), not the host's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadPlan:
    """ModelRunner instances and intra-op threads per instance for one pool, and why."""

    workers: int
    threads: Optional[int]
    why: str

    @property
    def cores(self) -> int:
        return self.workers * (self.threads or 1)


def split(cores: int, *, live: bool) -> tuple[int, int]:
    """(instances, threads each) for `cores`: live, one wide instance up to MAX_THREADS, then more;
    offline, one-thread instances up to MAX_INSTANCES, then wider ones."""
    if live:
        w = -(-cores // MAX_THREADS)
        return w, max(1, cores // w)
    t = -(-cores // MAX_INSTANCES)
    return max(1, cores // t), t


def plan_classify(*, cores: int, pools: int, cuda: bool, live: bool, workers: Optional[int],
                  threads: Optional[int]) -> ThreadPlan:
    """The classify pool's plan. `pools`: pools sharing the cores; `live`: any live stream (or none
    configured yet: streams added at run time are usually cameras); given values are kept."""
    if cuda:
        return ThreadPlan(workers or 1, threads, "GPU: one instance per pool (its own CUDA stream)")
    share = max(1, cores // max(1, pools))
    where = f"{share} of {cores} core(s)" + (f", shared by {pools} pools" if pools > 1 else "")
    if workers and threads:
        return ThreadPlan(workers, threads, "as configured")
    if workers:
        return ThreadPlan(workers, max(1, share // workers), f"{where}; workers as configured")
    if threads:
        return ThreadPlan(max(1, share // threads), threads, f"{where}; threads as configured")
    w, t = split(share, live=live)
    why = "live streams: the fastest frame" if live else "offline streams: one-thread instances for throughput"
    return ThreadPlan(w, t, f"{where}; {why}")
