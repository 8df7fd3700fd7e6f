"""`budget.latency_ms` left unset: the budget chosen at start for the machine the engine runs on.

Pure: it reads where each pool runs and what its batch 1 measured at warm-up, no model and no clock, so the
table tests need neither. The engine calls it once at start (engine/core/engine.py) and writes the result into
`budget.latency_ms`, so every reader (the pools' deadlines, `max_batch: auto`, the ingest, the view, the
ring sizing lines) sees the one value; `choose_budget`'s note is said at start.

The rule, per pool, and the engine's budget is the largest (the budget is the engine's, every pool must meet it):
  * a pool on a GPU: 17 ms, the 60 FPS-class target the engine is built for (ViT-L/16 batch 1: 1.39 ms with
    CUDA graphs on an H200, ../shared/gpu/README.md);
  * a pool on the CPU (no CUDA GPU, `device: cpu`, or a family without a GPU such as `noop`):
    max(150 ms, 4 x its batch 1's warm-up time), rounded up to 10 ms.
Why 150 ms: the most a user of a live system accepts as "now" (ITU-T G.114 puts 150 ms one way as the limit
for interactive use), and what CPU peers give on the same machine (issue 42, 48 x 240p60 on 2 cores: Roboflow
Inference's defaults p99 111-177 ms); 17 ms on a CPU drops nearly every frame as `deadline` (36 of 2,880
frames/s published there). It also leaves a CPU's decoding its time: the capture time of a network frame is
taken when its last packet arrived, so decoding counts in the budget (issue 42 measured 1.4 ms of CPU a 240p
frame and ~5 ms a 720p frame, everything included).
Why 4 x batch 1: a live frame that arrives as its worker starts a batch waits for it and then runs in its own
(2 x, the rule `max_batch: auto` plans with: engine/sched/batch_size.py), and on a CPU the decoders, the
preprocessing and the publisher take the same cores as the model while the warm-up measured it alone (2 x more).
A model whose batch 1 takes 0.5 s gets a 2 s budget: its user cannot have less than a model's own time, and
a budget it can meet publishes results instead of a counter of drops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

#: the budget of a pool on a GPU (and the budget before issue 42 everywhere)
GPU_BUDGET_MS = 17.0
#: the least budget of a pool on the CPU
CPU_FLOOR_MS = 150.0
#: a pool on the CPU gets at least this many times its batch 1's warm-up time
CPU_BATCH1_MULTIPLE = 4
#: a CPU budget is rounded up to a multiple of this (a value a user reads and sets, not 153.7 ms)
ROUND_MS = 10.0


@dataclass(frozen=True)
class PoolTiming:
    """Where a pool runs, and its batch 1's warm-up time in seconds (None: not measured, on a GPU; or the
    model reports none)."""

    on_gpu: bool
    batch1_s: Optional[float] = None


@dataclass(frozen=True)
class BudgetChoice:
    latency_ms: float
    note: str  # the start-up line: the value, how it was chosen, and how to choose another


def runs_on_gpu(device: Optional[str], cuda_available: bool) -> bool:
    """Whether a pool whose config says `device` (auto | cpu | cuda; None: a family with no model on a device,
    such as `noop`) runs on a GPU, as engine/models/device.py resolves it."""
    return cuda_available and device in ("auto", "cuda")


def pool_budget_ms(timing: PoolTiming) -> float:
    """The budget one pool can meet (the module's rule)."""
    if timing.on_gpu:
        return GPU_BUDGET_MS
    need = round(CPU_BATCH1_MULTIPLE * (timing.batch1_s or 0.0) * 1e3, 3)  # 4 x 0.06 s is 240.00000000000003 ms
    return max(CPU_FLOOR_MS, math.ceil(need / ROUND_MS) * ROUND_MS)


def choose_budget(configured_ms: Optional[float], pools: Mapping[str, PoolTiming]) -> BudgetChoice:
    """`configured_ms`: budget.latency_ms as the config set it (the file, --set or on_cpu), None when unset.
    A set value always wins; unset, the largest of the pools' budgets (`pool_budget_ms`).

    Example:
        >>> choose_budget(None, {"classify": PoolTiming(on_gpu=False, batch1_s=0.0142)}).latency_ms
        150.0
    """
    if configured_ms is not None:
        return BudgetChoice(float(configured_ms), f"budget.latency_ms: {configured_ms:g} ms (set in the config)")
    if not pools:
        raise ValueError("choose_budget: no pool to choose the budget for")
    budgets = {name: pool_budget_ms(t) for name, t in pools.items()}
    name = max(budgets, key=lambda n: (budgets[n], n))
    ms, timing = budgets[name], pools[name]
    if timing.on_gpu:
        why = f"auto on a GPU: the {GPU_BUDGET_MS:g} ms target of a pool on a GPU"
    else:
        cpu = {n: t for n, t in pools.items() if not t.on_gpu}
        times = ", ".join(f"{n} {t.batch1_s * 1e3:.1f} ms" if t.batch1_s is not None else f"{n} not measured"
                          for n, t in sorted(cpu.items()))
        where = "on the CPU" if len(cpu) == len(pools) else f"pool {name} runs on the CPU"
        why = (f"auto, {where}: the larger of {CPU_FLOOR_MS:g} ms and {CPU_BATCH1_MULTIPLE} x the slowest "
               f"batch 1 at warm-up ({times}), rounded up to {ROUND_MS:g} ms")
    return BudgetChoice(ms, f"budget.latency_ms: {ms:g} ms ({why}; set budget.latency_ms to choose)")
