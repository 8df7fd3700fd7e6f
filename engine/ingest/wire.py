"""The messages between the core and its ingest processes: one ZeroMQ frame, a type byte then a msgspec payload.

vLLM v1's pattern (vllm/v1/engine/__init__.py): dispatch on the type byte without decoding, then a typed
decode that fails loudly when the two sides drift. One frame, not two (type, payload): pyzmq releases and
retakes the GIL around every frame it sends or receives, and under load each retake waits for whichever
thread holds it; a frame less per message halved those waits on the core's I/O thread. No pickle crosses: an unknown type byte is a
`WireError`. Pixels never cross; a FrameReady names the slot they were copied into. The public ZeroMQ
schema (engine/publish/schema.py) is unrelated and unchanged. What a process sends goes on its uplink (uplink.py,
a seqpacket socketpair); commands come down a ZeroMQ PUSH (client.py).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import msgspec


class WireError(ValueError):
    """A message that is not one of ours (unknown type byte or a payload that does not decode)."""


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


# -- ingest process -> core (one PUSH socket per process, in order) --------------------------------------
class Ready(_Msg):
    """The process is up and listening for commands."""
    proc: int          # the process's index (ingest-<proc>)
    gen: int           # its generation (bumped at each restart of that index)
    pid: int


class Heartbeat(_Msg):
    proc: int
    gen: int
    t_mono: float
    bad_commands: int = 0    # commands the process could not decode or apply so far (counted, ignored)
    cuda: bool = False       # the process made a CUDA context (an NVDEC stream opened here): held until it exits


class FrameReady(_Msg):
    """A frame copied into lent slot `slot` of the stream's segment generation `gen`."""
    stream: str
    slot: int
    gen: int                 # the stream's lease generation the slot was lent under (stale ones are dropped)
    seq: int
    pts: float
    t_capture: float         # wall
    t_capture_mono: float
    deadline: float          # monotonic; inf offline
    decode_s: float
    h: int
    w: int
    colour: tuple[str, str]
    dropped: int = 0         # frames dropped at the source so far in this lease (cumulative): ring_full
    t_written: float = 0.0   # monotonic (system-wide on Linux), when the copy into the slot was done: the core's
    #                          commit time minus it is the crossing (the ingest -> scheduler target, bench_host)
    expired: int = 0         # frames dropped at the source past their deadline so far in this lease (cumulative)


class Geometry(_Msg):
    """The stream needs slots of h x w (its first frame, or a size change); it holds no credit until Slots."""
    stream: str
    gen: int
    h: int
    w: int


class StreamEvent(_Msg):
    """What IngestThread used to `emit` (started, connected, reconnecting, error)."""
    stream: str
    kind: str
    reason: str
    gen: int


class StreamState(_Msg):
    """A stream's progress; `final` once its ingest thread has ended (after its last FrameReady)."""
    stream: str
    gen: int
    state: str
    failed: bool
    end_reason: str
    total_frames: Optional[int]
    reconnects: int
    decode_errors: int
    seq: int
    dropped: int                 # dropped at the source in this lease (cumulative)
    decode_device: Optional[str] = None
    decode_reason: str = ""
    final: bool = False
    expired: int = 0             # dropped at the source past their deadline in this lease (cumulative)
    lag_s: Optional[float] = None  # a live network stream: seconds behind its camera (streams/clock.py); else None


# -- core -> ingest process (one PUSH socket per process) ------------------------------------------------
class AddStream(_Msg):
    stream: str
    gen: int
    config: dict[str, Any]       # the StreamConfig as a dict, revalidated on arrival
    source: dict[str, Any]       # the SourceConfig as a dict
    max_frame_pixels: int
    budget_s: float
    start_seq: int
    pixel_format: str = "rgb24"  # what the stream's frames are written as (slots.slot_shape): the core's choice
    decode: str = "cpu"          # where the process decodes it (streams.sources.open_source): the core's choice


class RemoveStream(_Msg):
    stream: str


class Slots(_Msg):
    """Attach the stream's segment `name` (generation `gen`): `count` slots of h x w in the stream's pixel format
    (AddStream.pixel_format: slots.slot_shape)."""
    stream: str
    gen: int
    name: str
    count: int
    h: int
    w: int


class Credit(_Msg):
    """Slots lent to the writer (FREE -> WRITING in the core), of lease generation `gen`."""
    stream: str
    gen: int
    slots: list[int]


class Credits(_Msg):
    """Several streams' credits at once: what the core's I/O thread lends one process in one wake-up goes as one
    message (a message per stream was a GIL round trip each, see above)."""
    credits: list[Credit]


class CudaSlots(_Msg):
    """Attach the stream's CUDA slot pool (engine/ingest/cuda_slots.py; NOT RUN ON A GPU YET): `count` NV12 slots
    of h x w in one block the core allocated, exported once with torch's CUDA IPC reduction, and two
    interprocess event handles per slot. Sent once per process and pool, never per frame."""
    stream: str
    gen: int
    name: str
    count: int
    h: int
    w: int
    gpu: int
    handle: bytes                # cudaIpcMemHandle of the block's allocation (torch's storage handle)
    storage_bytes: int
    storage_offset: int          # bytes into that allocation
    tensor_offset: int           # elements into the storage
    ref_counter: bytes           # torch's producer-side reference counter (shared memory file name)
    ref_counter_offset: int
    event: bytes                 # torch's "storage ready" event handle (b"" when none)
    event_sync: bool
    written: list[bytes]         # per slot: recorded by the ingest after its copy
    released: list[bytes]        # per slot: recorded by the core after the slot's last reader


class Exit(_Msg):
    """Stop every stream and exit (the engine is stopping)."""


_TYPES: list[type] = [Ready, Heartbeat, FrameReady, Geometry, StreamEvent, StreamState,
                      AddStream, RemoveStream, Slots, Credit, Exit, CudaSlots, Credits]
_TAG = {t: bytes([i]) for i, t in enumerate(_TYPES)}
_ENC = msgspec.msgpack.Encoder()
_DECS = [msgspec.msgpack.Decoder(t) for t in _TYPES]


def encode(msg: _Msg) -> bytes:
    """The type byte then the payload: one frame for send."""
    return _TAG[type(msg)] + _ENC.encode(msg)


def decode(data: Any) -> _Msg:
    """The message of one received frame. Raises WireError for anything else."""
    data = bytes(data)
    if not data or data[0] >= len(_TYPES):
        raise WireError(f"not an ingest message: type byte {data[:1]!r}")
    try:
        return _DECS[data[0]].decode(memoryview(data)[1:])
    except msgspec.DecodeError as err:
        raise WireError(f"{_TYPES[data[0]].__name__}: {err}") from None


INF = math.inf

#: the longest text (a reason) a process sends: every up message then fits uplink.MAX_MESSAGE
TEXT_MAX = 2000


def clip(text: str) -> str:
    """A reason as sent up: at most TEXT_MAX characters (an error quoting a long URL or a traceback)."""
    return text if len(text) <= TEXT_MAX else text[:TEXT_MAX - 3] + "..."
