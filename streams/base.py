"""The source interface: open a stream, iterate decoded RGB frames, close; and the URL rules:
which strings vidar opens (and how), and how credentials are kept out of every text it shows."""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from engine.errors import SourceOpenError

#: Query keys whose values are credentials: a key CONTAINING one of these (after %-decoding, case-
#: insensitive) has its value shown as `***`, the key kept, so the shown URL still says what was given:
#: `?password=x&user=y&passphrase=z&x_auth_token=t` -> `?password=***&user=***&passphrase=***&x_auth_token=***`.
#: Cameras, gateways and signed URLs spell these many ways; matching parts of keys errs on hiding too
#: much (a `keyint=` that is not secret) rather than too little.
CREDENTIAL_KEY_PARTS = ("pass", "pwd", "secret", "token", "key", "auth", "sig", "cred", "user", "login",
                        "session")
# key=value in a query; a value runs to the next `&`, `#` or line break, and (in free text, where a URL
# may be followed by the rest of a message) to whitespace; a quote ends it only when the text goes on
# with whitespace or punctuation after it (the end of a quoted URL in a message, `'...?token=x'`).
_QUERY_PAIR = re.compile(r"([?&;])([^=&#?\s]+)=((?:[^&#\s'\"]|['\"](?![\s:,;)\]]|$))*)")
_QUERY_PAIR_BARE = re.compile(r"([?&;])([^=&#?\r\n]+)=([^&#\r\n]*)")
#: A password holding `/`, `?` or `#` ends the authority early for urlsplit and FFmpeg (which then fail
#: to connect), but the text still holds it: the `@` is looked for up to whitespace, a quote or a line end.
_TOKEN_END = re.compile(r"[\s'\"]")
#: Where a `scheme://` URL starts inside a free-form text (an exception message, an FFmpeg error).
_URL_START = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://")
#: What ends an authority: urllib.parse.urlsplit's netloc runs to the first `/`, `?` or `#`; in a text,
#: a line break ends it too. Whitespace does not: a password may hold a space.
_AUTHORITY_END = re.compile(r"[/?#\r\n]")


def redact_url(text: str) -> str:
    """Credentials out of a URL, or out of any text that contains URLs (an exception message).

    Userinfo is everything before the LAST `@` of the authority (as urllib.parse.urlsplit and FFmpeg
    read it: `rtsp://admin:pa@ss@host/x` has the password `pa@ss`), and is shown as `***`; the values
    of query keys containing CREDENTIAL_KEY_PARTS are shown as `***`. Credentials never reach logs, events, replies or metrics.

    Example::

        redact_url("cannot open 'rtsp://admin:pa@ss@cam/x?token=t0k': refused")
        # "cannot open 'rtsp://***@cam/x?token=***': refused"
    """
    out, pos = [], 0
    for m in _URL_START.finditer(text):
        start = m.end()
        end = _authority_end(text, start)
        userinfo, at, _host = text[start:end].rpartition("@")
        if not at:  # a password with `/`, `?` or `#` in it: `rtsp://admin:Pa#ss1@cam/x`
            stop = _TOKEN_END.search(text, start)
            ui, at2, _ = text[start:stop.start() if stop else len(text)].rpartition("@")
            if at2 and ":" in ui and "//" not in ui:  # errs on hiding: `http://h:80/u/bob@x` -> `http://***@x`
                userinfo, at = ui, at2
        if at and userinfo:  # `udp://@239.0.0.1:5000` (multicast: no userinfo) stays as it is
            out += [text[pos:start], "***"]
            pos = start + len(userinfo)
    out.append(text[pos:])
    bare = _URL_START.match(text) is not None and "\n" not in text  # one URL, as configured: spaces are its own
    return (_QUERY_PAIR_BARE if bare else _QUERY_PAIR).sub(_hide_credential, "".join(out))


def _hide_credential(m: re.Match) -> str:
    from urllib.parse import unquote
    key = unquote(m.group(2)).lower()
    if any(part in key for part in CREDENTIAL_KEY_PARTS):
        return f"{m.group(1)}{m.group(2)}=***"
    return m.group(0)


def _authority_end(text: str, start: int) -> int:
    """Where the authority that starts at `start` ends (a second URL's `//` ends it too)."""
    stop = _AUTHORITY_END.search(text, start)
    return stop.start() if stop else len(text)


def _redact_bare(url: str) -> str:
    """redact_url for a whole string that is one URL, also when written without `//` (`http:u:p@host/x`,
    which FFmpeg reads with credentials too): used where a refused URL is echoed."""
    m = _FFMPEG_PROTOCOL.match(url)
    if m is None or url[m.end():].startswith("//"):
        return redact_url(url)
    start = m.end()
    while start < min(len(url), m.end() + 2) and url[start] == "/":  # `http:/host` reads like `http://host`
        start += 1
    userinfo, at, _host = url[start:_authority_end(url, start)].rpartition("@")
    if at and userinfo:
        url = url[:start] + "***" + url[start + len(userinfo):]
    return redact_url(url)


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

    def cancel(self) -> None:
        """Make a blocked open or read give up soon: called from another thread (the runner's stop) so a
        removed stream's decoder thread ends. The thread that reads still closes the source. Default:
        nothing to do (network reads are bounded by their timeouts; synthetic streams never block)."""

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
KNOWN_SCHEMES = ("file", "synthetic") + NETWORK_SCHEMES
#: What FFmpeg reads as a protocol (libavformat/avio.c, url_find_protocol): the longest prefix of
#: letters, digits, `+`, `-` and `.` (strspn of URL_SCHEME_CHARS, so also `2024` or an empty name),
#: when a `:` follows it. `clips/a:b.mp4` is a path (`/` comes first); `C:\x` reads as protocol `C`
#: on Linux (FFmpeg's DOS-path rule is compiled in on Windows only).
_FFMPEG_PROTOCOL = re.compile(r"[A-Za-z0-9+.-]*:")
_ALLOWED = ("allowed: a file path (or file:PATH, file://PATH), synthetic://, or a network URL: "
            f"{', '.join(s + '://' for s in NETWORK_SCHEMES)} (a file whose name has a ':' before any '/' "
            "would be read as a protocol: write it as file:NAME)")


def url_scheme(url: str) -> str:
    """The protocol FFmpeg would read in `url`, lower case; "file" for a plain path."""
    m = _FFMPEG_PROTOCOL.match(url)
    if m is not None:
        return m.group()[:-1].lower()
    if url.startswith("subfile,") and ":" in url[8:]:  # FFmpeg's other protocol form: subfile,,start,N,end,M,:URL
        return "subfile"
    return "file"


def file_path(url: str) -> str:
    """The path a file URL names: a plain path as it is; `file:PATH` and `file://PATH` without the prefix
    (`file:///abs` and `file:/abs` are `/abs`, `file://rel` is `rel`, as before)."""
    if _FFMPEG_PROTOCOL.match(url) is None:
        return url
    rest = url[len("file:"):]
    return rest[2:] if rest.startswith("//") else rest


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
        from .synthetic import SyntheticSource
        return SyntheticSource(stream_id, url)
    from .pyav import FileSource, NetworkSource
    if scheme in NETWORK_SCHEMES:
        return NetworkSource(stream_id, url, open_timeout_s=open_timeout_s, read_timeout_s=read_timeout_s,
                             max_frame_pixels=max_frame_pixels)
    return FileSource(stream_id, file_path(url), open_timeout_s=open_timeout_s, read_timeout_s=read_timeout_s,
                      max_frame_pixels=max_frame_pixels)


def scheme_error(url: str) -> Optional[str]:
    """Why vidar refuses a URL (credentials redacted), or None if it reads it. The config checks this when
    it is read or a stream added; open_source checks it again for callers that skip the config.

    Anything FFmpeg would read as a protocol (url_scheme) must be one vidar gives its timeouts to, written
    `scheme://` (`http:host/x` is FFmpeg's http protocol too, with no timeout), or `file:`; a plain path is
    a path. Whether the file exists is not checked here (see open_source)."""
    if not url:
        return f"empty URL; {_ALLOWED}"
    scheme = url_scheme(url)
    if scheme == "file":
        return None
    shown = _redact_bare(url)
    if scheme not in KNOWN_SCHEMES:
        return f"unsupported URL scheme {scheme!r} in {shown!r}; {_ALLOWED}"
    if not url[len(scheme) + 1:].startswith("//"):
        return (f"{shown!r} must be written {scheme}://... (without '//' it is not one of vidar's URLs, and "
                f"FFmpeg would open it with its own {scheme!r} protocol, without vidar's timeouts); {_ALLOWED}")
    return None
