"""What other threads ask of the engine core: typed requests, not queued closures.

The core thread owns the engine's state (the stream table, the pools' scheduling, the shutdown state
machine); every other thread (the control socket, the CLI, `Engine.start` and `Engine.stop`) asks it
with one of these, through `EngineCore.submit(request) -> Future`, and the core applies it between
steps. Why typed: a request is data, so it can be logged (by type and stream id: a stream's URL may
hold credentials), checked (an unknown one is refused with a ControlError, not run), compared in a
test, and later sent across a process (a cluster's controller to an engine); a closure can be none of
these, and could run anything on the core's thread.

As in vLLM's engine core (its request types, its SchedulerOutput): small frozen dataclasses, every
field commented. The core's handler for each is in `EngineCore._apply`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import StreamConfig


@dataclass(frozen=True)
class AddStream:
    cfg: StreamConfig  # the stream to start (checked by StreamConfig); resolves with its id once it runs,
    #                    later if the same id is still being removed, or fails with a ControlError


@dataclass(frozen=True)
class RemoveStream:
    stream: str            # the id of the stream to stop; an unknown id fails with a ControlError
    reason: str = "removed"  # its eos's reason (a cluster moving the stream says "relocated: ..."); resolves
    #                          once that eos is queued


@dataclass(frozen=True)
class Stop:
    drain: bool  # True: the pools finish what they hold (up to shutdown_timeout_s), then the rest is dropped;
    #              False: what is left is dropped now. Resolves once the decoders are told to stop.
    reason: str = "shutdown"  # every stream's eos says it (engine death names its cause here)


# Requests the engine core accepts; it runs them on its thread, between steps, in the order they came.
CoreRequest = AddStream | RemoveStream | Stop
