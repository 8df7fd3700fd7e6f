"""The worker interface every model pool drives.

A pool calls `prepare(frames)` to build the model input from ring slots (after which the
slots are released, so decoding continues while the model runs), then `infer(inputs)`,
which returns one dict of output fields per frame, merged into that frame's message.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

from ..ring import FrameView


def time_batches(run: Callable[[Any], Any], make_input: Callable[[int], Any], batch_sizes: Sequence[int],
                 device: Any) -> dict[int, float]:
    """Seconds per batch size, for warm-up: each size twice, the second timed (the first pays
    one-time costs: allocations, kernel selection)."""
    import torch

    seen: dict[int, float] = {}
    for b in batch_sizes:
        x = make_input(b)
        for _ in range(2):
            t0 = time.perf_counter()
            run(x)
            if getattr(device, "type", "cpu") == "cuda":
                torch.cuda.synchronize()
            seen[b] = time.perf_counter() - t0
    return seen


class Worker(ABC):
    #: message `type` and topic prefix (`vit.<stream>`)
    kind: str = "worker"
    #: "pretrained", "random" or the weights file name; copied into every message
    weights_tag: str = "random"

    @abstractmethod
    def prepare(self, frames: Sequence[FrameView]) -> Any:
        """Build the model input. Must not keep references to the frames' pixels."""

    @abstractmethod
    def infer(self, inputs: Any) -> list[dict]:
        """Run the model; one dict of output fields per frame, in order."""

    def warmup(self, batch_sizes: Sequence[int]) -> dict[int, float]:
        """Run each batch size once or more; return measured seconds per size (seeds the scheduler)."""
        return {}

    def close(self) -> None:
        """Release model memory."""
