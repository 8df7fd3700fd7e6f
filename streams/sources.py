"""open_source: the table from a URL's scheme to the Source that reads it (synthetic, network, file)."""

from __future__ import annotations

from engine.errors import SourceOpenError
from streams.base import Source
from streams.pyav import FileSource, NetworkSource
from streams.synthetic import SyntheticSource
from streams.urls import NETWORK_SCHEMES, file_path, scheme_error, url_scheme


def open_source(stream_id: str, url: str, *, open_timeout_s: float = 5.0, read_timeout_s: float = 2.5,
                max_frame_pixels: int = 8192 * 8192) -> Source:
    """The Source for a URL: synthetic://..., a network URL (NETWORK_SCHEMES), or a file path (`file:` and
    `file://` accepted).

    Raises SourceOpenError naming the stream for anything else FFmpeg would read as a protocol
    (scheme_error): opened by FFmpeg's own protocols it would have no timeout and no reconnect. Whether a
    file exists is checked when it opens (a per-stream error: a file may appear after the config is read).
    """
    why = scheme_error(url)
    if why:
        raise SourceOpenError(stream_id, why)
    scheme = url_scheme(url)
    if scheme == "synthetic":
        return SyntheticSource(stream_id, url)
    if scheme in NETWORK_SCHEMES:
        return NetworkSource(stream_id, url, open_timeout_s=open_timeout_s, read_timeout_s=read_timeout_s,
                             max_frame_pixels=max_frame_pixels)
    return FileSource(stream_id, file_path(url), open_timeout_s=open_timeout_s, read_timeout_s=read_timeout_s,
                      max_frame_pixels=max_frame_pixels)
