"""One rule for every socket vidar listens on: reachable from the network only when guarded.

The sockets: the publisher and the control socket (ZeroMQ; guarded by CURVE), the live view (guarded
by its token), the metrics endpoint (guarded by its token), and a cluster head's results proxy and
control socket (no guard yet: CURVE is not supported with a cluster). A socket bound to a loopback
address (or ZeroMQ's ipc:// and inproc://, which never leave the machine) needs no guard. Any other
bind needs its guard, or `security.allow_insecure_bind: true`, which is logged as a warning at every
start: the control socket makes the engine open any URL or local file it is given, so an open one on
a network is an open door.

Pure (no sockets): the config checks it when it is read, and `Engine.start` again (configs built
with `model_copy`, such as a cluster's engines, skip pydantic's checks).
"""

from __future__ import annotations

import ipaddress
import math
import zlib
from collections import Counter
from typing import Optional

#: a token must carry at least this many bits by `token_bits`' estimate
MIN_TOKEN_BITS = 96
_ZLIB_EMPTY = len(zlib.compress(b"", 9))
#: ZeroMQ sockets we bind (the publisher, the control sockets): a TCP peer that has not completed ZeroMQ's
#: handshake by then is closed (libzmq's default is 30 s). ZeroMQ has no connection cap, so the time each
#: such connection holds a descriptor is the bound there is (`vidar run` also raises the soft descriptor
#: limit to the hard one).
ZMQ_HANDSHAKE_MS = 5000


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost`; a name other than localhost may resolve to anything: False."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def zmq_bind_host(endpoint: str) -> Optional[str]:
    """The host a ZeroMQ bind endpoint listens on; None when it cannot leave the machine (ipc://,
    inproc://). `tcp://*:5556` -> "*"; an interface name (`tcp://eth0:5556`) comes back as it is.
    Transports other than tcp (ws, udp, pgm, ...) come back as "*": treated as reachable."""
    scheme, sep, rest = endpoint.partition("://")
    scheme = scheme.lower()
    if not sep:
        return "*"
    if scheme in ("ipc", "inproc"):
        return None
    if scheme != "tcp":
        return "*"
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.split(";")[-1] or "*"  # `src;dst` is a connect form; the last part is where it goes


def token_bits(token: str) -> float:
    """A rough strength estimate, the smaller of two:
    - length x min(log2 of the alphabet its character classes span, log2(distinct characters) + 1), where a
      character that continues a run past its second (`abcd`, `4321`: each code one above or below the
      one before) counts a tenth: refuses short, single-class, repetitive and sequential tokens (16 spaces: 16 bits; `abab...`:
      2 bits a character; `0123456789` x 3: ~20 bits);
    - 8 x the bytes zlib needs for it beyond an empty input: refuses what repeats (`Password1!` x 2 is
      caught by neither rule alone, and passes: ~96 bits is a rough bar, not a guarantee).
    Random tokens of 16 bytes or more pass (`secrets.token_urlsafe(16)`, `token_hex(16)`, `auto`).
    Hand-written: zxcvbn, the known library, counts 10 guesses per character of a random token and would
    refuse a 128-bit `token_urlsafe(16)`; nothing here needs its dictionaries."""
    if not token:
        return 0.0
    alphabet = 0
    if any(c.islower() for c in token):
        alphabet += 26
    if any(c.isupper() for c in token):
        alphabet += 26
    if any(c.isdigit() for c in token):
        alphabet += 10
    if any(not c.isalnum() for c in token):
        alphabet += 33  # ASCII punctuation and space
    if any(ord(c) > 127 for c in token):
        alphabet += 100
    distinct = len(Counter(token))
    per_char = min(math.log2(alphabet), math.log2(distinct) + 1.0)
    steps = [ord(b) - ord(a) for a, b in zip(token, token[1:])]
    runs = sum(1 for x, y in zip(steps, steps[1:]) if x == y and abs(x) == 1)  # 3rd+ of `abc`, `321`
    by_classes = (len(token) - 0.9 * runs) * per_char
    by_zlib = 8.0 * max(0, len(zlib.compress(token.encode("utf-8", "surrogatepass"), 9)) - _ZLIB_EMPTY)
    return min(by_classes, by_zlib)


def token_problem(token: str) -> Optional[str]:
    """Why a token is refused, or None (the config's error names the key)."""
    bits = token_bits(token)
    if bits < MIN_TOKEN_BITS:
        return (f"the token is too weak (about {bits:.0f} bits by vidar's estimate, at least "
                f"{MIN_TOKEN_BITS} needed): use `auto`, or a random one such as the output of "
                "`python3 -c 'import secrets; print(secrets.token_urlsafe(24))'`")
    return None


def exposed_sockets(cfg) -> list[tuple[str, str]]:
    """(key, address) of every enabled listening socket of an EngineConfig that is reachable from the
    network without its guard. Empty: every socket is loopback-only or guarded."""
    out = []
    curve = cfg.security.curve

    def zmq(key: str, endpoint: str, guarded: bool) -> None:
        host = zmq_bind_host(endpoint)
        if host is not None and not is_loopback_host(host) and not guarded:
            out.append((key, endpoint))

    zmq("publish.endpoint", cfg.publish.endpoint, curve)
    if cfg.control.enabled:
        zmq("control.endpoint", cfg.control.endpoint, curve)
    if cfg.view.enabled and not cfg.view.token and not is_loopback_host(cfg.view.host):
        out.append(("view.host", cfg.view.host))
    if cfg.metrics.enabled and not cfg.metrics.token and not is_loopback_host(cfg.metrics.host):
        out.append(("metrics.host", cfg.metrics.host))
    if cfg.cluster is not None:  # the head's sockets: no CURVE with a cluster yet
        zmq("cluster.publish.endpoint", cfg.cluster.publish.endpoint, False)
        zmq("cluster.control.endpoint", cfg.cluster.control.endpoint, False)
    return out


def listening_stream(url: str) -> Optional[str]:
    """The address a stream URL makes FFmpeg listen on, when it does (`tcp://0.0.0.0:9000?listen=1`,
    `srt://:9000?mode=listener`): a stream added over the control socket or the view could otherwise open
    a port that takes video from anyone. None: it connects out. (`udp://` input always binds a local port
    to receive: that is how UDP video arrives, so it is left to the network's own filtering.)"""
    from urllib.parse import parse_qs, urlsplit
    try:
        u = urlsplit(url)
        host = u.hostname or ""
    except ValueError:
        return None
    q = {k.lower(): v[-1].lower() for k, v in parse_qs(u.query, keep_blank_values=True).items()}
    scheme = u.scheme.lower()
    if scheme == "tcp" and "listen" in q and q["listen"] != "0":  # `?listen` alone means listen=1
        return host or "*"
    if scheme == "srt" and q.get("mode") in ("listener", "rendezvous"):
        return host or "*"
    return None


def stream_exposure_error(url: str, allow_insecure_bind: bool) -> Optional[str]:
    """Why a stream URL is refused under the rule (a listening stream on a network address)."""
    host = listening_stream(url)
    if host is None or allow_insecure_bind or (host != "*" and is_loopback_host(host)):
        return None
    return (f"this URL makes the engine listen on {host!r} for anyone's stream (tcp `listen`, srt "
            "`mode=listener`): give a loopback address, connect to the sender instead, or set "
            "security.allow_insecure_bind: true")


_GUARD = {"publish.endpoint": "security.curve", "control.endpoint": "security.curve",
          "view.host": "view.token (or auto)", "metrics.host": "metrics.token (or auto)",
          "cluster.publish.endpoint": None, "cluster.control.endpoint": None}


def exposure_error(cfg) -> Optional[str]:
    """The config error for unguarded network binds (None when there are none or they are allowed)."""
    exposed = exposed_sockets(cfg)
    if not exposed or cfg.security.allow_insecure_bind:
        return None
    parts = []
    for key, where in exposed:
        guard = _GUARD[key]
        parts.append(f"{key}={where!r} (" + (f"set {guard}, " if guard else "") + "or bind 127.0.0.1)")
    return ("listening on a network address without a guard: " + "; ".join(parts) + ". Anyone who can reach "
            "these could read the results or, through the control socket or the view, make the engine open any "
            "URL or local file. To do it anyway (a private network), set security.allow_insecure_bind: true")


def exposure_warning(cfg) -> Optional[str]:
    """The warning logged at every start when unguarded network binds were allowed."""
    exposed = exposed_sockets(cfg)
    if not exposed:
        return None
    return ("security.allow_insecure_bind: listening on the network WITHOUT authentication: "
            + ", ".join(f"{k}={w!r}" for k, w in exposed) + " (anyone who can reach them can use them)")
