"""The source interface: open a stream, iterate decoded RGB frames, close."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")


def redact_url(url: str) -> str:
    """rtsp://user:pass@host/x -> rtsp://***@host/x. Credentials never reach logs, events or metrics."""
    return _CREDENTIALS.sub("***@", url)


@dataclass(slots=True)
class DecodedFrame:
    rgb: np.ndarray          # (H, W, 3) uint8
    pts: float               # seconds
    decode_s: float = 0.0    # time spent decoding and converting this frame


class Source(ABC):
    """One stream. `frames()` yields decoded frames of one session (one open connection).

    Sources do no pacing and no buffering: the runner decides when a frame counts as captured.
    """

    #: network sources reconnect when their session ends; files and synthetic streams end
    network: bool = False
    #: nominal frame rate, used to pace files in live mode (None: use pts only)
    fps: Optional[float] = None

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

    @property
    def total_frames(self) -> Optional[int]:
        """Frames in the stream when known (files), for progress bars."""
        return None

    #: corrupt packets skipped so far (the decoder resyncs at the next keyframe)
    decode_errors: int = 0
    #: why the last session ended early (a read timeout, a connection reset), if it did
    session_error: str = ""


def open_source(stream_id: str, url: str, *, open_timeout_s: float = 5.0, read_timeout_s: float = 2.5,
                max_frame_pixels: int = 8192 * 8192) -> Source:
    """The Source for a URL: synthetic://..., rtsp(s)://..., or a file path (file:// accepted)."""
    if url.startswith("synthetic://"):
        from .synthetic import SyntheticSource
        return SyntheticSource(stream_id, url)
    if url.startswith(("rtsp://", "rtsps://")):
        from .pyav import RtspSource
        return RtspSource(stream_id, url, open_timeout_s=open_timeout_s, read_timeout_s=read_timeout_s,
                          max_frame_pixels=max_frame_pixels)
    from .pyav import FileSource
    return FileSource(stream_id, url[len("file://"):] if url.startswith("file://") else url,
                      max_frame_pixels=max_frame_pixels)
