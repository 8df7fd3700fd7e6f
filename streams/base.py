"""The source interface: open a stream, iterate decoded RGB frames, close."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

from streams.urls import redact_url


@dataclass(slots=True)
class DecodedFrame:
    """One decoded frame and when its data arrived. `repr` shows times, never pixels."""

    rgb: Optional[np.ndarray] = field(repr=False)  # (H, W, 3) uint8; None for NVDEC frames (see nv12)
    pts: float                           # seconds
    #: packet -> rgb only: the decode call that produced the frame plus its conversion, never the
    #: wait for packets (a live source spends most of its time waiting)
    decode_s: float = 0.0
    #: when the packet that completed the frame came out of the demuxer (monotonic, and the same
    #: moment on the wall clock): a network frame's capture time
    t_arrival: float = field(default_factory=time.monotonic)
    t_arrival_wall: float = field(default_factory=time.time)
    #: NV12 frames: (H * 3 // 2, W) uint8 (the Y plane, then the interleaved UV plane), with `rgb` None. NVDEC's
    #: (streams/nvdec.py) in GPU memory, owned by this frame (copied out of the decoder's surface); a CPU
    #: decoder's (streams/convert.py), when its owner asked for `pixel_format` "nv12": a numpy array, or for 4:2:0
    #: frames of even size a convert.NV12Planes, written into the slot later (np.asarray(x) makes the array; its
    #: write is then not in decode_s).
    nv12: Optional[Any] = field(default=None, repr=False)
    #: a CUDA event recorded on the decoder's stream after `nv12` was written: a reader on another
    #: stream waits on it (stream.wait_event), never with a host sync. None on the CPU. The decoder's own event,
    #: re-recorded for a later frame: queue the wait (or sync) before asking for the next frame (streams/nvdec.py).
    ready: Optional[Any] = field(default=None, repr=False)
    #: the colour matrix and range the pixels were coded with (from the bitstream's metadata), which
    #: an NV12 -> RGB conversion needs: ("bt601" | "bt709", "limited" | "full")
    colour: tuple[str, str] = ("bt601", "limited")
    #: decoded but not converted (rgb and nv12 None): no slot was free for it (Source.wants), so it is dropped
    #: unseen, counted ring_full, and its colour conversion is not spent on a frame that has nowhere to go
    unconverted: bool = False


class Source(ABC):
    """One stream. `frames()` yields decoded frames of one session (one open connection).

    Sources do no pacing and no buffering: the ingest thread decides when a frame counts as captured.
    """

    #: network sources reconnect when their session ends; files and synthetic streams end
    network: bool = False
    #: set by the ingest thread before open: the consumer wants the freshest frames, not every frame
    live: bool = False
    #: set by the ingest thread with `live`: a live frame's latency budget (seconds). A live network source
    #: stops decoding while it is further than this behind its camera (streams/clock.py); None: never
    budget_s: Optional[float] = None
    #: set by the ingest thread: called with n when the source discarded n frames unseen (packets skipped to
    #: reach the live edge), so that they are counted as dropped and seq moves on by n
    on_skipped: Optional[Callable[[int], None]] = None
    #: set by the ingest thread (live streams written into slots an ingest process was lent): whether a decoded
    #: frame of (h, w) would find a free slot now; False: the source hands it out unconverted
    #: (DecodedFrame.unconverted). None: every frame converted
    wants: Optional[Callable[[int, int], bool]] = None
    #: set by the owner before open: what a CPU decoder hands out, "rgb24" (DecodedFrame.rgb) or "nv12"
    #: (DecodedFrame.nv12, a host numpy array, for a pool that converts it or reads no pixels); only sources
    #: listed in `host_formats` take "nv12"
    pixel_format: str = "rgb24"
    #: the host pixel formats this source can hand out
    host_formats: tuple[str, ...] = ("rgb24",)
    #: nominal frame rate, used to pace files in live mode (None: use pts only)
    fps: Optional[float] = None
    #: where its video is decoded: "cpu" (PyAV) or "cuda" (NVDEC); None until an NVDEC-capable source
    #: has opened and seen its codec (streams/nvdec.py)
    decode_device: Optional[str] = "cpu"
    #: why that was chosen ("decode: cpu", "synthetic", or the reason auto fell back to the CPU)
    decode_reason: str = ""

    def __init__(self, stream_id: str, url: str):
        self.stream_id, self.url = stream_id, url

    @property
    def display_url(self) -> str:
        return redact_url(self.url)

    @abstractmethod
    def open(self) -> None:
        """Open the stream. Raises SourceOpenError naming the stream on failure."""

    @abstractmethod
    def frames(self) -> Iterator[DecodedFrame]:
        """Decoded frames until the session ends (end of file, or a disconnect for network sources)."""

    def close(self) -> None:
        """Release the session. Idempotent."""

    def cancel(self) -> None:
        """Make a blocked open or read give up soon: called from another thread (the ingest thread's stop) so a
        removed stream's decoder thread ends. The thread that reads still closes the source. Default:
        nothing to do (network reads are bounded by their timeouts; synthetic streams never block)."""

    @property
    def total_frames(self) -> Optional[int]:
        """Frames in the stream when known (files), for progress bars."""
        return None

    def capture_time(self, frame: DecodedFrame) -> tuple[float, float]:
        """(monotonic, wall) moment a network frame counts as captured: its packet's arrival here; a live network
        source on its camera's clock says when the camera sent it (streams/clock.py), never later."""
        return frame.t_arrival, frame.t_arrival_wall

    @property
    def lag_s(self) -> Optional[float]:
        """How far behind the live edge the stream is read, in seconds (a live network stream's last packet:
        its arrival minus its camera time); None when not known or not meaningful (files, synthetic)."""
        return None

    #: corrupt packets skipped so far (the decoder resyncs at the next keyframe)
    decode_errors: int = 0
    #: why the last session ended early (a read timeout, a connection reset), if it did
    session_error: str = ""
    #: the last session was ended by the source itself: it could not get back to the live edge (streams/clock.py)
    fell_behind: bool = False
