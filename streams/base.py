"""The source interface: open a stream, iterate decoded RGB frames, close."""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from engine.errors import SourceOpenError

_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")


def redact_url(url: str) -> str:
    """rtsp://user:pass@host/x -> rtsp://***@host/x. Credentials never reach logs, events or metrics."""
    return _CREDENTIALS.sub("***@", url)


@dataclass(slots=True)
class DecodedFrame:
    """One decoded frame and when its data arrived. `repr` shows times, never pixels."""

    rgb: np.ndarray = field(repr=False)  # (H, W, 3) uint8
    pts: float                           # seconds
    #: packet -> rgb only: the decode call that produced the frame plus its conversion, never the
    #: wait for packets (a live source spends most of its time waiting)
    decode_s: float = 0.0
    #: when the packet that completed the frame came out of the demuxer (monotonic, and the same
    #: moment on the wall clock): a network frame's capture time
    t_arrival: float = field(default_factory=time.monotonic)
    t_arrival_wall: float = field(default_factory=time.time)


class Source(ABC):
    """One stream. `frames()` yields decoded frames of one session (one open connection).

    Sources do no pacing and no buffering: the runner decides when a frame counts as captured.
    """

    #: network sources reconnect when their session ends; files and synthetic streams end
    network: bool = False
    #: set by the runner before open: the consumer wants the freshest frames, not every frame
    live: bool = False
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


#: URL schemes read over the network: open/read timeouts always set, and reconnected when they end
NETWORK_SCHEMES = ("rtsp", "rtsps", "http", "https", "rtmp", "udp", "srt", "tcp")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
KNOWN_SCHEMES = ("file", "synthetic") + NETWORK_SCHEMES


def url_scheme(url: str) -> str:
    """The URL's scheme, lower case; "file" for a plain path."""
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else "file"


def open_source(stream_id: str, url: str, *, open_timeout_s: float = 5.0, read_timeout_s: float = 2.5,
                max_frame_pixels: int = 8192 * 8192) -> Source:
    """The Source for a URL: synthetic://..., a network URL (NETWORK_SCHEMES), or a file path (file:// accepted).

    Raises SourceOpenError naming the stream for any other scheme: an unknown scheme opened as a
    file would have no timeout and no reconnect.
    """
    scheme = url_scheme(url)
    if scheme == "synthetic":
        from .synthetic import SyntheticSource
        return SyntheticSource(stream_id, url)
    from .pyav import FileSource, NetworkSource
    if scheme in NETWORK_SCHEMES:
        return NetworkSource(stream_id, url, open_timeout_s=open_timeout_s, read_timeout_s=read_timeout_s,
                             max_frame_pixels=max_frame_pixels)
    if scheme == "file":
        path = url[len("file://"):] if _SCHEME.match(url) else url  # file://PATH or a plain path
        return FileSource(stream_id, path, max_frame_pixels=max_frame_pixels)
    raise SourceOpenError(stream_id, scheme_error(url))


def scheme_error(url: str) -> Optional[str]:
    """Why a URL's scheme is refused (credentials redacted), or None if vidar reads it. The config checks
    this when it is read or a stream added; open_source checks it again for callers that skip the config."""
    scheme = url_scheme(url)
    if scheme in KNOWN_SCHEMES:
        return None
    return (f"unsupported URL scheme {scheme!r} in {redact_url(url)!r}; allowed: a file path (or file://), "
            f"synthetic://, or a network URL: {', '.join(NETWORK_SCHEMES)}")
