"""Defaults that fit the machine: worker instances and intra-op threads per pool, when the config
leaves them unset. Pure functions of the cores, the pools and the device (no model, no clock), so
they are tested as a table; `Engine` applies them, logs the choice, and `Pool.warmup` checks the
one thing that needs a measurement (does a frame on one thread still fit the latency budget).

Why many one-thread instances on a CPU: OpenMP's parallel regions are barrier-synchronised, so an
instance with k threads stalls whenever the decoder (or another pool) takes one of its cores, and
small models do not scale across threads anyway. Measured on 2 cores, vit_tiny at batch 4 on 720p:
2 instances x 1 thread ran 1.2-1.5x the frames/s of 1 instance x 2 threads (benchmarks/RESULTS.md).
The model is shared, so an instance costs only its activations.

On 16 cores the rule gives 8 instances x 2 threads (one pool) or 8 x 1 per pool (two pools): past
8 instances per pool the batches a scheduler can form get too small to feed them, so further cores
go to threads. This rule is not measured on 16 cores (our machines have 2): say so when you tune.
On a GPU the instance count stays 1 (each instance has its own CUDA stream; more do not make the
GPU faster) and threads only matter for preprocessing: untested here, no GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

MAX_INSTANCES = 8  # per pool; beyond, extra cores become intra-op threads (see above)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's cpuset), not the host's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadPlan:
    """Worker instances and intra-op threads per instance for one pool, and why."""

    workers: int
    threads: Optional[int]
    why: str
    auto: bool = False  # chosen here, not configured: warm-up may widen it (Pool.warmup)

    @property
    def cores(self) -> int:
        return self.workers * (self.threads or 1)


def split(cores: int, threads_per_instance: int = 1) -> tuple[int, int]:
    """(instances, threads each) for `cores`: one-thread instances up to MAX_INSTANCES, then wider ones."""
    t = max(threads_per_instance, -(-cores // MAX_INSTANCES))
    return max(1, cores // t), t


def plan_classify(*, cores: int, pools: int, cuda: bool, workers: Optional[int], threads: Optional[int]) -> ThreadPlan:
    """The classify pool's plan. `pools`: pools sharing the cores; given values are kept."""
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
    w, t = split(share)
    return ThreadPlan(w, t, f"{where}: one-thread instances beat one wide instance on a CPU", auto=True)
