"""The worker interface every model pool drives.

A pool calls `prepare(frames)` to build the model input from the frames' slots (`FrameRef.pixels()`;
after which the slots are released, on the GPU after `release_event()`, so decoding continues while the
model runs), then `infer(inputs)`,
which returns one dict of output fields per frame, merged into that frame's message.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

from engine.frames.ref import FrameRef


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


class ModelRunner(ABC):
    #: message `type` and topic prefix (`classify.<stream>`)
    kind: str = "worker"
    #: "pretrained", "random" or the weights file name; copied into every message
    weights_tag: str = "random"
    #: reads NV12 frames in GPU slots (NVDEC); a stream feeding a pool whose runners do not is decoded on the CPU
    accepts_nv12: bool = False

    @abstractmethod
    def prepare(self, frames: Sequence[FrameRef]) -> Any:
        """Build the model input, reading pixels with `ref.pixels()`. Must not keep references to
        the pixels: the slots are released (and reused) once this returns."""

    def release_event(self) -> Any:
        """Called right after prepare (returned or raised), on the same thread: a CUDA event recorded
        after the work prepare queued that reads the frames' slots, so the slots are reused only once
        it completes, without a host sync; None (the default, and on the CPU): prepare read them already."""
        return None

    @abstractmethod
    def infer(self, inputs: Any) -> list[dict]:
        """Run the model; one dict of output fields per frame, in order."""

    def warmup(self, batch_sizes: Sequence[int]) -> dict[int, float]:
        """Run each batch size once or more; return measured seconds per size (seeds the scheduler)."""
        return {}

    def set_level(self, level: int) -> None:
        """Run the next batches at this quality level (0: as configured; see the pool's `levels`).
        Called on the worker's thread between batches when the degradation ladder moves."""

    def close(self) -> None:
        """Release model memory."""


class PostProcessor(ABC):
    """A family's stage after the workers, run on its pool's output thread (its one owner), in
    dispatch order: SAM 2's shared tracking stage is one. Control requests that concern its state
    (`ops`) are run on the same thread, between batches."""

    #: control ops this processor serves (e.g. add_object); the engine routes them here
    ops: tuple[str, ...] = ()

    def warmup(self) -> None:
        """Run once at start, before the pool's threads and any stream: pay one-time costs (allocations,
        kernel selection) here rather than on the first camera frame."""

    def close(self) -> None:
        """The pool stopped and its output thread ended: free what the processor holds (GPU memory)."""

    def fallbacks(self) -> dict[str, str]:
        """The GPU pieces this processor runs without, each with why (Pool.fallbacks); read from any thread."""
        return {}

    def add_stream(self, stream: str) -> None:
        """A stream starts feeding the pool."""

    def remove_stream(self, stream: str) -> None:
        """A stream was removed: forget its state."""

    @abstractmethod
    def process(self, frames: Sequence[Any], fields: list[dict]) -> tuple[list, Callable[[], None]]:
        """Turn the workers' outputs of these frames (in dispatch order) into message fields. Returns
        (per frame: a dict of fields, or an exception that fails that frame alone; commit). Nothing
        may change the processor's state before `commit()` is called: the output stage calls it only
        if this step's results are used (not after a watchdog replaced the thread)."""

    def control(self, op: str, request: dict) -> dict:
        """Apply a control request; return the reply's extra fields. Raise VidarError for bad requests."""
        raise NotImplementedError(op)

    def describe(self) -> dict[str, dict]:
        """Per-stream state for `list` (a snapshot: called from other threads)."""
        return {}

    def counters(self) -> dict[str, dict[str, int]]:
        """Extra per-stream counters for the metrics: {metric name: {stream: n}}."""
        return {}

    def events(self) -> list[tuple[str, str, str]]:
        """Events to publish (stream, kind, reason), taken once."""
        return []
