"""Model families as plug-ins: the engine builds a pool for each configured `models.<name>` through
this table and names no family itself. A family module provides `build_pool(cfg, models=None,
factory=None) -> PoolSpec`; workers may be injected (tests, benchmarks)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from engine.errors import ConfigError
from engine.sched.tuning import ThreadPlan
from engine.models.base import PostProcessor, ModelRunner

# pool name (the `models.<name>` key, the message type and topic prefix) -> module with build_pool
FAMILIES = {"classify": "engine.models.classify", "sam2": "engine.models.sam2", "noop": "engine.models.noop"}
# control ops served by a family's output processor, for the error that says which pool is missing
FAMILY_OPS = {"sam2": ("add_object", "remove_object", "reset_stream")}


@dataclass
class PoolSpec:
    name: str
    models: list[ModelRunner]
    factory: Optional[Callable[[], ModelRunner]]   # a fresh instance after a failure (shares the model)
    max_batch: int                            # the largest batch; with auto_batch, the most the sweep may choose
    threads: Optional[int] = None             # intra-op threads per worker on the CPU
    processor: Optional[PostProcessor] = None  # run on the pool's output thread
    output_threads: Optional[int] = None      # intra-op threads of the output thread (SAM 2's tracking stage)
    levels: list[str] = field(default_factory=list)  # the family's quality levels, best first (ladder rungs)
    level_costs: list[float] = field(default_factory=list)  # relative cost of each level (level 0: 1.0)
    plan: Optional[ThreadPlan] = None         # chosen by auto_plan (None: injected workers or no plan)
    auto_batch: bool = False                  # max_batch: auto: the pool's warm-up chooses (sched/batch_size.py)


def instances(make: Callable[..., ModelRunner], n: int) -> tuple[list[ModelRunner], Callable[[], ModelRunner]]:
    """`n` worker instances sharing the first one's model (weights loaded once), and a factory for a
    fresh instance after a failure. `make(model=None, weights_tag=None)` builds one."""
    first = make()

    def more() -> ModelRunner:
        return make(model=first.model, weights_tag=first.weights_tag)
    return [first] + [more() for _ in range(n - 1)], more


def build_pool(name: str, cfg, models: Optional[list[ModelRunner]] = None,
               factory: Optional[Callable[[], ModelRunner]] = None) -> PoolSpec:
    if name not in FAMILIES:
        raise ConfigError(f"models.{name}: no such model family; known: {sorted(FAMILIES)}")
    module = importlib.import_module(FAMILIES[name])
    return module.build_pool(cfg, models=models, factory=factory)


def auto_plan(name: str, cfg, *, cores: int, pools: int, live: bool) -> tuple[object, Optional[ThreadPlan]]:
    """The family's defaults for what `cfg` leaves unset (instances, threads), from the machine; a
    family without `auto_plan` keeps its config as it is."""
    module = importlib.import_module(FAMILIES[name])
    if not hasattr(module, "auto_plan"):
        return cfg, None
    return module.auto_plan(cfg, cores=cores, pools=pools, live=live)


def pool_for_op(op: str) -> Optional[str]:
    return next((name for name, ops in FAMILY_OPS.items() if op in ops), None)
