"""A worker with no model: measures engine overhead, stands in for models in fault tests, and serves the
`models.noop` pool (a fixed cost per frame, for benchmarks and sizing).

`latency_s` sleeps per batch (plus `per_frame_s` per frame); `fail_on_batch=N` raises on
the N-th batch (1-based); `hang_on_batch=N` blocks on the N-th batch until released.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Sequence

from engine.errors import ModelError
from engine.models.base import ModelRunner


class NoopRunner(ModelRunner):
    accepts_nv12 = True  # it reads no pixels: its streams' frames are never converted to RGB (stream_table.py)
    def __init__(self, *, kind: str = "vit", latency_s: float = 0.0, per_frame_s: float = 0.0,
                 fail_on_batch: Optional[int] = None, hang_on_batch: Optional[int] = None):
        self.kind = kind
        self.weights_tag = "none"
        self.latency_s, self.per_frame_s = latency_s, per_frame_s
        self.fail_on_batch, self.hang_on_batch = fail_on_batch, hang_on_batch
        self.batches = 0
        self.batch_sizes: list[int] = []
        self.release_hang = threading.Event()

    def prepare(self, frames: Sequence) -> Any:
        return [f.meta.seq for f in frames]

    def infer(self, inputs: Any) -> list[dict]:
        self.batches += 1
        self.batch_sizes.append(len(inputs))
        if self.fail_on_batch is not None and self.batches == self.fail_on_batch:
            raise ModelError(f"injected failure on batch {self.batches}")
        if self.hang_on_batch is not None and self.batches == self.hang_on_batch:
            self.release_hang.wait()
        delay = self.latency_s + self.per_frame_s * len(inputs)
        if delay:
            time.sleep(delay)
        return [{} for _ in inputs]

    def warmup(self, batch_sizes: Sequence[int]) -> dict[int, float]:
        return {b: self.latency_s + self.per_frame_s * b for b in batch_sizes}


def build_pool(cfg, *, models=None, factory=None):
    """The `noop` pool: `cfg.workers` NullWorkers sleeping `cfg.per_frame_s` per frame."""
    from engine.models.registry import PoolSpec

    def make() -> NoopRunner:
        return NoopRunner(kind="noop", per_frame_s=cfg.per_frame_s)
    if models is None:
        models, factory = [make() for _ in range(cfg.workers)], factory or make
    return PoolSpec("noop", models, factory, cfg.max_batch)
