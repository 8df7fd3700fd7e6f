"""What the pool's threads hand each other: typed messages, not callbacks.

  core -> worker         Batch            frames to run, in dispatch order
  worker -> output       BatchResult      what the model made of them (or why it failed)
  any -> output thread   StreamAdded, StreamRemoved, ProcessorControl: requests run on the output
                         stage's thread (the output processor's one owner), each answered by a Future
  output -> core         timings, drained by the pool's step (OutputStage.take_timings)

Frames travel as FrameRefs (engine.frames.ref): references to ring slots, never pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from engine.frames.lifecycle import FailReason
from engine.frames.ref import FrameRef


@dataclass(eq=False)  # identity: a batch is one dispatch, never equal to another
class Batch:
    id: int                   # dispatch order within the pool: the output stage publishes in this order
    frames: list[FrameRef]    # held by the batch's holder (worker, then output stage); slots released once prepared
    t_dispatch: float = 0.0   # monotonic; dispatch -> output done is what the scheduler's latency model learns
    level: int = 0            # the pool's quality level (degradation ladder) this batch runs at


@dataclass(eq=False)
class BatchResult:
    batch: Batch                               # the batch it answers (its id orders the output)
    outputs: Optional[list[dict]] = None       # one dict of message fields per frame; None when it failed
    fail_reason: Optional[FailReason] = None   # why every frame of the batch fails (None: it ran)
    error: Optional[BaseException] = None      # the error behind fail_reason, for the log and the fault policy
    elapsed: float = 0.0                       # seconds prepare + infer took on the worker (inference metric)

    @property
    def frames(self) -> list[FrameRef]:
        """The batch's frames (the output stage replaces those that reach a terminal state early)."""
        return self.batch.frames


@dataclass(frozen=True)
class StreamAdded:
    stream: str  # a stream starts feeding the pool: the output processor sets up its state


@dataclass(frozen=True)
class StreamRemoved:
    stream: str  # the stream was removed: the output processor forgets its state


@dataclass(frozen=True)
class ProcessorControl:
    op: str         # a control op the output processor serves (its `ops`, e.g. add_object)
    request: dict   # the control request (a copy: the processor may keep parts of it); the reply's extra fields come back


# Requests the output stage runs on its thread, between batches, in the order they came.
OutputRequest = Union[StreamAdded, StreamRemoved, ProcessorControl]
