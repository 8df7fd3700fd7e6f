"""The URL rules: which strings vidar opens (and how), and how credentials are kept out of every text it
shows. Pure string work, imported by the config (to refuse a URL when it is read) and by every source.

How a URL is shown (redact_url): an ALLOW-LIST, because every deny-list of credential key names missed
forms cameras use (`pw=`, `u=`, `jwt=`, XMEye's `user=admin_password=x` path). A shown URL keeps:

- its scheme, host and port. Userinfo, everything up to the LAST `@` of the URL (in a message, of its
  line), however written (spaces, `/`, `//`, `?`, `#`, a user alone), is `***@`. A password holding
  `/` or a space moves the `@` past where urllib and FFmpeg end the authority, so the last `@` is used
  instead: this errs on hiding (`rtsp://cam/a@b` shows as `rtsp://***@b`). When that `@` comes after a
  `?` or `#` it may sit in a query value (`?password=a@b`), so what follows it is not shown as a host:
  `***`. A host that is not a host name or `[IPv6]` with a port of at most 5 digits and at most 65535
  (`admin:pw` or `admin:73519` without `@`), or, with no `@` before it, that is a user name cameras ship
  with (KNOWN_USERS, any case) followed by `:` (`admin:1234`: userinfo typed without `@host`), is `***`,
  its port too. Not caught: a numeric password up to 65535 after another user name (`rtsp://john:1234/x`
  reads as host `john`, port 1234).
- path segments that look like names: at most 32 of `A-Z a-z 0-9 . _ ~ -`, in which every run of 12
  or more letters and digits is a word (letters only, lower case after the first, under 24 long): a
  random token, a JWT, a UUID or a hex digest has a run that is not (`Xy7fA9bQz1cD2eF3`), a camera's
  path has none (`Streaming`, `realmonitor`, `h264Preview_01_main`, `axis-media`, `media.amp`); any
  other segment is `***`. Not caught: a path secret of short pieces (`abcd-efgh-ijkl`) or one
  dictionary-like word; put secrets in userinfo or the query, where they are always hidden. A segment
  holding `=` (XMEye's `user=admin_password=x_channel=1_stream=0.sdp`) is read as `key=value` parts
  split at `_`, `&` and `;`, each shown as a query pair is. An RTMP URL's last segment is its stream
  key: always `***`.
- query (and path) pairs, by key (%-decoded, any case): a stream selector's value (SELECTOR_KEYS; servers
  put a stream's key there too, `?stream=<key>`) is kept when, %-decoded, it is at most 32 characters of
  pieces split at `.`, `_` and `-`, each a number of at most 4 digits or a word of SELECTOR_WORDS followed by
  at most 4 digits (`101`, `main`, `Profile_1`, `channel0_main.bcs`); a format parameter's value (FORMAT_KEYS)
  is kept when it looks like a name, by the path-segment rule (`h264`, `1280x720`, `29.97`: no long random
  run); any other value of theirs is `***`. Any other key keeps its name (when the name looks like a name,
  by the path-segment rule, else `***`) and its value becomes `***`; a part without `=` (`?S3cret`,
  `?real_stream`) is a value: `***`. The fragment is `***`. Not caught: a selector's secret made of
  SELECTOR_WORDS and short numbers (`stream=main_1234`).

Files (a plain path, `file:` and `file://`) hold no credentials and are shown as they are. In a free
text (an exception message, FFmpeg's error) each `scheme://` URL is found and shown by the same rule; its
end is whitespace, or a quote followed by whitespace, punctuation or the end, trailing punctuation
excluded. A message keeps every byte outside its URLs. The cost is a few regex scans of the text: it
runs when streams are listed and on errors, never per frame."""

from __future__ import annotations

import re
from typing import Optional
from urllib.parse import unquote

#: Stream selectors of the cameras and servers vidar reads (Dahua `channel`/`subtype`, Axis `camera`, XMEye
#: `channel`/`stream`, ONVIF `profile`), in a query or a `key=value` path segment (%-decoded, any case). Some
#: servers put the stream's key in the same place (`?stream=<key>`, `?channel=<key>`), so a value is shown only
#: when made of short numbers and SELECTOR_WORDS (_is_selector).
SELECTOR_KEYS = frozenset({"channel", "ch", "subtype", "stream", "streamtype", "profile", "camera"})
#: Format parameters (Axis `videocodec`/`resolution`, vidar's synthetic:// parameters, FFmpeg protocol options
#: that carry no secret): a value is shown when it looks like a name (_is_name), so no long random token passes.
FORMAT_KEYS = frozenset({
    "videocodec", "resolution", "codec", "width", "height", "fps", "size", "seed", "frames", "unicast", "transport",
    "rtsp_transport", "latency", "pkt_size", "buffer_size"})
#: Keys whose values may be shown. Everything else is `***`: a key missing here costs a `***`, never a credential.
SHOWN_KEYS = SELECTOR_KEYS | FORMAT_KEYS
#: The words a stream selector's value is made of (any case), each optionally followed by up to 4 digits: stream
#: names (Hikvision/ONVIF `Profile_1`, `MainStream`; Reolink `channel0_main.bcs`; XMEye `0.sdp`), codecs and
#: the file extensions servers append. A word missing here costs a `***`, never a credential.
SELECTOR_WORDS = frozenset({
    "main", "sub", "mainstream", "substream", "third", "thirdstream", "primary", "secondary", "hd", "sd", "low",
    "high", "default", "channel", "ch", "stream", "profile", "media", "video", "live", "track", "h264", "h265",
    "hevc", "mjpeg", "sdp", "bcs", "mp4", "flv", "m3u8"})
#: User names cameras and NVRs ship with (Hikvision and Dahua `admin`, Axis `root`, ONVIF's `administrator`,
#: `operator`, `user`, Ubiquiti `ubnt`, ...): such a name before a `:` where the host goes (`rtsp://admin:1234/x`)
#: is userinfo typed without `@host`, never a camera's host name. Kept small: each costs a `***` for a host so named.
KNOWN_USERS = frozenset({
    "admin", "administrator", "root", "user", "guest", "operator", "supervisor", "service", "viewer", "support",
    "ubnt"})
#: `scheme://` where a URL starts inside a text (the lookbehind keeps `xrtsp://` from matching at `rtsp`).
_URL_START = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*)://")
_LINE_END = re.compile(r"[\r\n]")
#: Where a URL inside a message ends: whitespace, or a quote then whitespace, punctuation or the end
#: (the end of `'rtsp://...': refused`; a quote inside a value, `pw=a'b`, does not end it).
_TEXT_URL_END = re.compile(r"\s|['\"](?=[\s:,;)\]]|$)")
_TRAILING_PUNCT = ".,;:!)]>"
#: A host name, an IPv4 address or an `[IPv6%zone]`, with an optional numeric port (checked in _is_host).
_HOST = re.compile(r"(?P<name>\[[0-9A-Za-z:.%]*\]|[A-Za-z0-9._~%-]*)(?P<colon>:(?P<port>[0-9]*))?")
_MAX_PORT = 65535
#: A piece of a stream selector's value: letters (a word of SELECTOR_WORDS, or none), then at most 4 digits.
_SELECTOR_PIECE = re.compile(r"([A-Za-z]*)([0-9]{0,4})")
_SELECTOR_SEP = re.compile(r"[._-]")
_NAME = re.compile(r"[A-Za-z0-9._~-]{1,32}")
#: 12 or more letters and digits in a row: a word when shorter than 24 and lower case after its first
#: letter (`transportmode`, `Surveillance`), else a token: a random run of 12 from [A-Za-z0-9] is a word
#: with a chance of (52/62) * (26/62)**11, about 6 in 100,000 (a hex or base64 token: less).
_LONG_RUN = re.compile(r"[A-Za-z0-9]{12,}")
_PATH_PART_SEP = re.compile(r"([&;_])")
_QUERY_PART_SEP = re.compile(r"([&;])")
_HIDDEN = "***"


def redact_url(text: str) -> str:
    """A URL as it may be shown, or any text with every URL in it shown so (an exception message).

    The rule is the module's docstring: scheme, host, port, name-like path segments and the values of
    SHOWN_KEYS are kept; userinfo and every other value are `***`. Credentials never reach logs,
    events, replies, the view or metrics.

    Example::

        redact_url("cannot open 'rtsp://admin:pa@ss@cam/live?channel=1&pw=x': refused")
        # "cannot open 'rtsp://***@cam/live?channel=1&pw=***': refused"
    """
    m = _URL_START.match(text)
    if m is not None and _LINE_END.search(text) is None:  # one URL, as configured: spaces are its own
        return text[:m.end()] + _shown_url(text, m.group(1), m.end(), len(text), bare=True)[0]
    out, pos = [], 0
    starts = list(_URL_START.finditer(text))
    for i, m in enumerate(starts):
        if m.start() < pos:  # inside the userinfo of the URL before (a password holding `x://`)
            continue
        line = _LINE_END.search(text, m.end())
        stop = min(line.start() if line else len(text), starts[i + 1].start() if i + 1 < len(starts) else len(text))
        shown, end = _shown_url(text, m.group(1), m.end(), stop, bare=False)
        out += [text[pos:m.end()], shown]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _shown_url(text: str, scheme: str, start: int, stop: int, bare: bool) -> tuple[str, int]:
    """What follows `scheme://` (or `scheme:`) at text[start:], as shown, and where it ended: `stop` for a
    whole URL; in a message, the end of the URL after its last `@` before `stop`."""
    if scheme.lower() == "file":  # a local path: no credentials, and its name is what the user needs
        end = stop if bare else _text_url_end(text, start, stop)
        return text[start:end], end
    out, host_shown = [], True
    at = text.rfind("@", start, stop)
    if at >= 0:
        userinfo = text[start:at]
        out.append(f"{_HIDDEN}@" if userinfo else "@")  # `udp://@239.0.0.1:5000`: multicast, no userinfo
        host_shown = "?" not in userinfo and "#" not in userinfo
        start = at + 1
    end = stop if bare else _text_url_end(text, start, stop)
    rest, hash_, fragment = text[start:end].partition("#")
    rest, qmark, query = rest.partition("?")
    host, slash, path = rest.partition("/")
    out.append(host if host_shown and _is_host(host, userinfo=at >= 0) else _HIDDEN)
    if slash:
        segments = [_shown_segment(s) for s in path.split("/")]
        if scheme.lower() in ("rtmp", "rtmps") and segments[-1]:
            segments[-1] = _HIDDEN  # rtmp://server/app/STREAM_KEY: the last segment is the stream's key
        out += ["/", "/".join(segments)]
    if qmark:
        out += ["?", _shown_pairs(query, _QUERY_PART_SEP)]
    if hash_:
        out += ["#", _HIDDEN if fragment else ""]
    return "".join(out), end


def _text_url_end(text: str, start: int, stop: int) -> int:
    """Where a URL that goes on at `start` ends inside a message (not past `stop`)."""
    m = _TEXT_URL_END.search(text, start, stop)
    end = m.start() if m else stop
    while end > start and text[end - 1] in _TRAILING_PUNCT:  # `see rtsp://cam/x.` or `(rtsp://cam/x)`
        end -= 1
    return end


def _is_name(token: str) -> bool:
    """A path segment or key name that may be shown: short, plain characters, no random-looking run."""
    if _NAME.fullmatch(token) is None:
        return False
    return all(len(run) < 24 and run.isalpha() and run[1:].islower() for run in _LONG_RUN.findall(token))


def _is_host(host: str, userinfo: bool) -> bool:
    """A host part that may be shown: a host name or address with a real port (at most 5 digits, at most 65535)
    or none; without userinfo before it, not a known user name before a `:` (`admin:1234` is userinfo typed
    without `@host`; after `user:pw@` it is a host that happens to be named so)."""
    m = _HOST.fullmatch(host)
    if m is None:
        return False
    port = m.group("port")
    if port and (len(port) > 5 or int(port) > _MAX_PORT):
        return False
    return userinfo or not (m.group("colon") and unquote(m.group("name")).lower() in KNOWN_USERS)


def _is_selector(value: str) -> bool:
    """A stream selector's value that may be shown (%-decoded): at most 32 characters of pieces split at `.`,
    `_`, `-`, each a number of at most 4 digits or a word of SELECTOR_WORDS with at most 4 digits after it."""
    if not value:
        return True
    if len(value) > 32:
        return False
    for piece in _SELECTOR_SEP.split(value):
        m = _SELECTOR_PIECE.fullmatch(piece)
        if piece.lower() in SELECTOR_WORDS:  # `h264`: a word that ends in digits itself
            continue
        if m is None or not (m.group(1).lower() in SELECTOR_WORDS or (not m.group(1) and m.group(2))):
            return False
    return True


def _shown_value(key: str, value: str) -> bool:
    """Whether the value of `key` (a key of SHOWN_KEYS, lower case) may be shown."""
    value = unquote(value)
    return _is_selector(value) if key in SELECTOR_KEYS else not value or _is_name(value)


def _shown_segment(segment: str) -> str:
    if "=" in segment:
        return _shown_pairs(segment, _PATH_PART_SEP)
    return segment if not segment or _is_name(segment) else _HIDDEN


def _shown_pairs(text: str, sep: re.Pattern) -> str:
    """`key=value` parts split at `sep` (its separators kept): SHOWN_KEYS keep a value their rule allows
    (_shown_value), every other value (and a part without `=`, which is a value) is `***`."""
    parts = sep.split(text)
    for i in range(0, len(parts), 2):  # the odd items are the separators
        key, eq, value = parts[i].partition("=")
        name = unquote(key).lower()
        if not eq:
            parts[i] = _HIDDEN if key else ""
        elif name not in SHOWN_KEYS:
            parts[i] = f"{key if _is_name(unquote(key)) else _HIDDEN}={_HIDDEN}"
        elif not _shown_value(name, value):
            parts[i] = f"{key}={_HIDDEN}"
    return "".join(parts)


def _redact_bare(url: str) -> str:
    """redact_url for a whole string that is one URL, also when written without `//` (`http:u:p@host/x`,
    which FFmpeg reads with credentials too): used where a refused URL is echoed."""
    m = _FFMPEG_PROTOCOL.match(url)
    if m is None:
        return redact_url(url)
    # Every string FFmpeg would read as a protocol goes through the rule here, `//` or not: free text's URL
    # pattern wants a scheme that starts with a letter, so `://u:p@h`, `2rtsp://u:p@h` or `.rtsp://u:p@h` (a
    # pasted URL missing or mangling its scheme) were echoed whole, password included.
    start = m.end()
    while start < min(len(url), m.end() + 2) and url[start] == "/":  # `http:/host` reads like `http://host`
        start += 1
    return url[:start] + _shown_url(url, m.group()[:-1], start, len(url), bare=True)[0]


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
