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

import functools
import ipaddress
import math
import string
from typing import Optional

#: a token must carry at least this many bits by `token_bits`' estimate. Not 96: a random 96-bit token
#: (`secrets.token_urlsafe(12)`) holds word fragments often enough to score 68 to 96 bits, as it must
#: under any estimate of patterns, while short tokens made of words (`vidar-view-token-0001`,
#: `Summer2024!Winter2025!`) score up to 62. 2**64 guesses are out of reach of a guesser over HTTP.
MIN_TOKEN_BITS = 64
#: ... and at least this share of what a random token of its length and alphabet carries (bits / (length x
#: log2 alphabet)): long tokens made of words reach 64 bits by length alone (`my-vidar-view-token-for-
#: production-2024`: 109 bits) but only half of a random token's share. Measured: the issue's and the review's
#: word tokens 0.18-0.61; 1,000 random draws each of token_urlsafe(12/16/24) and token_hex(16): 0.70 at the
#: lowest (median 0.94).
MIN_TOKEN_SHARE = 0.66
#: characters of a token that are scored (zxcvbn's matchers are quadratic in the length)
_SCORED_CHARS = 64
#: words a vidar token would be made of, tried first as zxcvbn's `user_inputs`
_VIDAR_WORDS = ("vidar", "view", "token", "secret", "metrics", "api", "admin", "password", "pass", "key",
                "auth", "bearer", "login", "prod", "production", "dev", "staging", "test", "stream",
                "camera", "cam", "engine", "video", "analytics", "grafana", "prometheus")
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
    """Bits a guesser who knows the usual patterns needs for this token: zxcvbn's estimate, with what it
    cannot explain counted at the token's own alphabet.

    zxcvbn (Dropbox's estimator) finds the patterns: dictionary words (English, names, common
    passwords, and vidar's own words: `_VIDAR_WORDS`), l33t, reversed words, keyboard runs, repeats,
    sequences, years and dates, each with its number of guesses. Its own total prices a character it
    cannot explain at 10 guesses (it is made for passwords people type), so any random 16-character
    token scores 53 bits, below `correct-horse` forms. Here the cheapest cover of the token by its
    matches is computed again with an unexplained character at log2 of the token's alphabet (the
    character classes it uses: hex digits 16; lower 26, upper 26, digits 10, `-_` 2 (base64url, what
    `secrets.token_urlsafe` draws from), other ASCII punctuation and space 33, anything else 100), plus
    zxcvbn's log2(n!) for the order of n parts. Scored on the first `_SCORED_CHARS` characters (the
    matchers are quadratic; a longer token is at least as strong as its start).
    """
    if not token:
        return 0.0
    from zxcvbn import matching, scoring
    text = token[:_SCORED_CHARS]
    per_char = math.log2(_alphabet(text))
    ends: dict[int, list[tuple[int, float]]] = {}
    for m in matching.omnimatch(text, _dictionaries()):
        ends.setdefault(m["j"] + 1, []).append((m["i"], math.log2(scoring.estimate_guesses(m, text))))
    # best[k][n]: the fewest bits (log2 of the product of guesses) covering text[:k] with n parts, a part
    # being a zxcvbn match or a run of unexplained characters (zxcvbn's own dynamic programme, repriced)
    best: list[dict[int, float]] = [{0: 0.0}] + [{} for _ in text]
    for k in range(1, len(text) + 1):
        parts = ends.get(k, []) + [(i, (k - i) * per_char) for i in range(k)]
        for i, bits in parts:
            for n, before in best[i].items():
                if before + bits < best[k].get(n + 1, math.inf):
                    best[k][n + 1] = before + bits
    return min(b + math.lgamma(n + 1) / math.log(2) for n, b in best[-1].items())


def _alphabet(text: str) -> int:
    chars = set(text)
    if chars <= set(string.digits):
        return 10
    if chars <= set(string.hexdigits.lower()) or chars <= set(string.hexdigits.upper()):
        return 16  # `secrets.token_hex`
    size = 26 * any(c.islower() for c in chars) + 26 * any(c.isupper() for c in chars) \
        + 10 * any(c.isdigit() for c in chars) + 100 * any(not c.isascii() for c in chars)
    punctuation = {c for c in chars if c.isascii() and not c.isalnum()}
    return size + (2 if punctuation <= {"-", "_"} and punctuation else 33 if punctuation else 0)


@functools.lru_cache(maxsize=1)
def _dictionaries() -> dict:
    """zxcvbn's ranked dictionaries plus vidar's words (its `user_inputs`), built once; passed to its
    matchers rather than set in its module (`zxcvbn()` itself writes a global on every call)."""
    from zxcvbn import matching
    return {**matching.RANKED_DICTIONARIES, "user_inputs": matching.build_ranked_dict(_VIDAR_WORDS)}


def token_share(token: str, bits: float) -> float:
    """`bits` as a share of what a random token of this length and alphabet would carry."""
    text = token[:_SCORED_CHARS]
    return bits / (len(text) * math.log2(_alphabet(text))) if text else 0.0


def token_problem(token: str) -> Optional[str]:
    """Why a token is refused, or None (the config's error names the key). Never contains the token."""
    bits = token_bits(token)
    share = token_share(token, bits)
    if bits >= MIN_TOKEN_BITS and share < MIN_TOKEN_SHARE:
        return (f"the token is made mostly of words or patterns (about {bits:.0f} bits by zxcvbn's patterns, "
                f"{share:.0%} of what a random token of its length carries, at least {MIN_TOKEN_SHARE:.0%} "
                "needed): use `auto`, or a random one such as the output of "
                "`python3 -c 'import secrets; print(secrets.token_urlsafe(24))'`")
    if bits < MIN_TOKEN_BITS:
        return (f"the token is too weak (about {bits:.0f} bits by zxcvbn's patterns, at least "
                f"{MIN_TOKEN_BITS} needed: words, names, keyboard runs, sequences, dates and repeats "
                "are what a guesser tries first): use `auto`, or a random one such as the output of "
                "`python3 -c 'import secrets; print(secrets.token_urlsafe(24))'`")
    return None


def _binds(cfg) -> list[tuple[str, str, bool]]:
    """(key, address, guarded) of every enabled listening socket of an EngineConfig; a ZeroMQ address is
    its endpoint, the view's and the metrics' their host."""
    curve = cfg.security.curve
    out = [("publish.endpoint", cfg.publish.endpoint, curve)]
    if cfg.control.enabled:
        out.append(("control.endpoint", cfg.control.endpoint, curve))
    if cfg.view.enabled:
        out.append(("view.host", cfg.view.host, bool(cfg.view.token)))
    if cfg.metrics.enabled:
        out.append(("metrics.host", cfg.metrics.host, bool(cfg.metrics.token)))
    if cfg.cluster is not None:  # the head's sockets: no CURVE with a cluster yet
        out.append(("cluster.publish.endpoint", cfg.cluster.publish.endpoint, False))
        out.append(("cluster.control.endpoint", cfg.cluster.control.endpoint, False))
    return out


def _host(key: str, address: str) -> Optional[str]:
    return zmq_bind_host(address) if key.endswith(".endpoint") else address


def exposed_sockets(cfg) -> list[tuple[str, str]]:
    """(key, address) of every enabled listening socket of an EngineConfig that is reachable from the
    network without its guard. Empty: every socket is loopback-only or guarded."""
    out = []
    for key, address, guarded in _binds(cfg):
        host = _host(key, address)
        if host is not None and not is_loopback_host(host) and not guarded:
            out.append((key, address))
    return out


def zmq_ipv6(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint binds an IPv6 address (`tcp://[::1]:5556`): libzmq binds those only with
    ZMQ_IPV6 set, and said "Invalid argument" otherwise (issue 31 item 9). Wildcards and names stay IPv4."""
    host = zmq_bind_host(endpoint)
    return bool(host) and ":" in host.strip("[]")


def unsupported_bind(cfg) -> Optional[str]:
    """A bind address vidar cannot honour, refused when the config is read instead of failing to bind:
    an IPv6 zone id (`::1%lo`, `fe80::1%eth0`) passed the loopback rule and then failed to bind."""
    for key, address, _ in _binds(cfg):
        host = _host(key, address) or ""
        if "%" in host:
            return (f"{key}={address!r}: IPv6 zone ids ('%...') are not supported; bind a global or loopback "
                    "address (::1, 127.0.0.1) instead")
    return None


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
    """The config error for unguarded network binds (None when there are none or they are allowed), or for a
    bind address vidar cannot honour."""
    if (why := unsupported_bind(cfg)) is not None:
        return why
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
