"""The URL rules: which strings vidar opens (and how), and how credentials are kept out of every text it
shows. Pure string work, imported by the config (to refuse a URL when it is read) and by every source."""

from __future__ import annotations

import re
from typing import Optional

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
