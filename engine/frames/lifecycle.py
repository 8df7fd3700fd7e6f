"""A frame's metadata and lifecycle.

READY (ring) -> QUEUED (scheduler) -> RUNNING (a worker) -> OUTPUT (reorder, output processor)
  -> PUBLISHING (the publisher's queue) -> PUBLISHED | DROPPED(reason) | FAILED(reason)
Every frame a pool ingests ends in exactly one terminal state; `Accounting` counts them, and
counts the frames each stage holds, independently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class DropReason(str, Enum):
    RING_FULL = "ring_full"          # live: overwritten in the ring before the scheduler saw it
    DEADLINE = "deadline"            # scheduler: could not meet its deadline; no compute spent
    SUPERSEDED = "superseded"        # live: a newer frame of its stream went to a worker first (freshest first)
    INTERVAL = "interval"            # live: not sampled while the degradation ladder processes every k-th frame
    LATE = "late"                    # finished after its deadline; never published late
    PUBLISH_QUEUE = "publish_queue"  # live: publisher thread's queue full
    SHUTDOWN = "shutdown"            # aborted at shutdown after the drain timeout
    STREAM_REMOVED = "stream_removed"  # its stream was removed while the frame was queued or running


class FailReason(str, Enum):
    MODEL_ERROR = "model_error"
    MODEL_HANG = "model_hang"        # the batch outran faults.batch_timeout_s; its worker was replaced
    PREPROCESS_ERROR = "preprocess_error"
    OUTPUT_ERROR = "output_error"    # the output stage (e.g. SAM 2's tracking stage, rendering) raised
    ENCODE_ERROR = "encode_error"    # its result could not be serialised (msgpack): this frame only, logged
    ENGINE_DEAD = "engine_dead"      # in flight when the engine died (the eos says why)


@dataclass(slots=True)
class FrameMeta:
    """What a source stamps on every frame. `repr` shows numbers, never pixels."""

    stream: str
    seq: int                 # 0-based frame number in the stream
    pts: float               # presentation time, seconds
    t_capture: float         # unix seconds when the frame became available
    t_decoded: float = 0.0   # monotonic seconds, when written to the ring
    decode_s: float = 0.0    # time spent decoding it
    deadline: float = math.inf  # monotonic seconds; inf for offline streams
    height: int = 0
    width: int = 0
    extra: dict = field(default_factory=dict)
    # The moment of t_capture on the monotonic clock (nan where a caller did not say). Latency is measured
    # on it: the wall clock of these VMs was seen to step by tens of ms (and once, in a test, seconds),
    # which made results that passed the deadline check carry latency_ms past the budget.
    t_capture_mono: float = math.nan
    # How the pixels are laid out in the ring's slot: "rgb24" (host, (H, W, 3)) or "nv12" (GPU,
    # (H * 3 // 2, W)); set by the ring. The model runner converts accordingly.
    pixel_format: str = "rgb24"
    # The colour matrix and range the frame was coded with (an NV12 -> RGB conversion needs them):
    # ("bt601" | "bt709", "limited" | "full"); set by the ingest thread from the decoder.
    colour: tuple[str, str] = ("bt601", "limited")
    # Monotonic seconds, when an ingest process finished copying the frame into its slot (engine/ingest); nan for
    # frames written in the engine process (t_decoded is that moment). The commit's t_decoded minus it is the time
    # the frame took to cross from its process to the engine.
    t_written: float = math.nan

    @property
    def live(self) -> bool:
        return math.isfinite(self.deadline)
