"""A frame's metadata and lifecycle.

QUEUED -> BATCHED -> RUNNING -> PUBLISHED | DROPPED(reason) | FAILED(reason)
Every frame a pool ingests ends in exactly one terminal state; `Accounting` counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class DropReason(str, Enum):
    RING_FULL = "ring_full"          # live: overwritten in the ring before the scheduler saw it
    DEADLINE = "deadline"            # scheduler: could not meet its deadline; no compute spent
    LATE = "late"                    # finished after its deadline; never published late
    PUBLISH_QUEUE = "publish_queue"  # live: publisher thread's queue full
    PUBLISH_HWM = "publish_hwm"      # live: a subscriber's ZeroMQ queue full (HWM)
    SHUTDOWN = "shutdown"            # aborted at shutdown after the drain timeout
    STREAM_REMOVED = "stream_removed"


class FailReason(str, Enum):
    MODEL_ERROR = "model_error"
    MODEL_HANG = "model_hang"        # the batch outran faults.batch_timeout_s; its worker was replaced
    PREPROCESS_ERROR = "preprocess_error"


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

    @property
    def live(self) -> bool:
        return math.isfinite(self.deadline)
