"""Sending on an XPUB so that a subscriber that stops reading costs only itself, and is named.

libzmq's XPUB has two behaviours when a subscriber's queue (its HWM) is full: with XPUB_NODROP the send
fails for every subscriber of the topic (one hung client, or a raw TCP peer, held everyone's results
back: issue 31 item 2), without it the full subscriber silently misses the message and the others get it.
`Delivery.send` uses both: it tries NODROP first (so it knows when someone is full), and then either
  * `lossless=False` (live results, events of live streams): sends again without NODROP, so the subscribers
    with room get the message and the full one misses it; counted in `missed`;
  * `lossless=True` (offline results and events): reports the refusal; the caller keeps the message and
    retries (offline back-pressure: every connected subscriber of the topic may hold an offline stream back,
    which is what `publish.min_subscribers` waits for).
Either way the full subscribers are found (their unsent bytes in the kernel, engine/security/peers.py) and
logged with their address and how long they have been full, at most every REPORT_EVERY_S.

Toggling XPUB_NODROP per send is safe: it is read by the socket on each send, and the one thread that owns
the socket makes both calls.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Optional

import zmq

from engine.security.peers import Peer, PeerWatch

log = logging.getLogger("vidar.publish")

#: a subscriber with at least this much unsent in the kernel is not reading (a reading one drains it in
#: microseconds on loopback; a hung one fills the socket buffer, 200 KB to several MB)
SLOW_BYTES = 64 * 1024
CHECK_EVERY_S = 0.5   # how often full subscribers are looked for while sends find one
REPORT_EVERY_S = 5.0  # how often each slow subscriber is logged


class Sent(enum.Enum):
    ALL = "all"          # every subscriber of the topic had room
    MISSED = "missed"    # sent; one or more full subscribers missed it
    REFUSED = "refused"  # lossless and a subscriber was full: not sent (retry later)


class Delivery:
    """Owned by the thread that owns the socket. `sock` is a bound XPUB with XPUB_NODROP set.

    A subtlety of libzmq decides the design: a send without NODROP that finds a subscriber's pipe full
    deactivates that pipe until its reader has drained half of it, and while it is inactive every send,
    NODROP or not, skips it without a word (xpub.cpp / dist.cpp: inactive pipes are never "matching").
    So after the first lossy send the socket is `suspect` (a subscriber may be missing messages silently):
    every live message counts as missed, and no lossless message is sent (it could be skipped for that
    subscriber): offline streams wait, as they would for a full subscriber. Suspicion ends when no
    subscriber has been seen backlogged on SETTLE_CHECKS consecutive checks CHECK_EVERY_S apart (a pipe
    that is still full keeps its kernel buffer full: libzmq's I/O thread moves messages into the kernel
    as fast as it takes them, so an empty kernel queue for that long means the pipe was drained).
    """

    SETTLE_CHECKS = 2

    def __init__(self, sock: zmq.Socket, name: str, clock=time.monotonic):
        self._sock, self.name, self._clock = sock, name, clock
        # Subscribers are not closed for saying nothing: a SUB may connect before it subscribes (a cluster
        # head's XSUB does, until its own first subscriber comes), and one that never subscribes is sent
        # nothing. Raw peers are refused at the handshake (guard_socket: ZAP domain, HANDSHAKE_IVL).
        self.watch = PeerWatch(sock, name, None, clock)
        self.missed = 0           # messages sent while a subscriber was full (it missed them)
        self.refused = 0          # lossless sends refused (the caller retries)
        self._suspect_since: Optional[float] = None
        self._settled = 0         # consecutive checks that found nobody backlogged
        self._checked = -1e9
        self._reported: dict[int, float] = {}

    @property
    def suspect(self) -> bool:
        return self._suspect_since is not None

    def send(self, frames: list, *, lossless: bool) -> Sent:
        if self._suspect_since is None:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
                return Sent.ALL
            except zmq.Again:  # a subscriber is full
                pass
        self._check()
        if lossless:  # nothing deactivated by this: NODROP refused before writing to any pipe
            self.refused += 1
            return Sent.REFUSED
        if self._suspect_since is None:
            self._suspect_since, self._settled = self._clock(), 0
        self._sock.setsockopt(zmq.XPUB_NODROP, 0)
        try:  # without NODROP libzmq writes to every matching subscriber with room and skips the full ones
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        finally:
            self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.missed += 1
        return Sent.MISSED

    def read_subscriptions(self) -> list[bytes]:
        """Subscription messages received (b"\\x01topic" / b"\\x00topic")."""
        out = []
        while True:
            try:
                msg = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if msg[:1] in (b"\x00", b"\x01"):
                out.append(msg)

    def tick(self) -> None:
        """Between sends: track connections; while suspect, look again (a slow peer caught up or left)."""
        self.watch.poll()
        if self._suspect_since is not None:
            self._check()

    def slow(self) -> list[Peer]:
        return [p for p in self.watch.peers.values() if p.slow_since is not None]

    def _check(self) -> None:
        """At most every CHECK_EVERY_S: which subscribers are backlogged (named in the log), and whether the
        socket has settled (nobody backlogged SETTLE_CHECKS times in a row)."""
        now = self._clock()
        if now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        full = {p.fd for p in self.watch.backlogged(SLOW_BYTES)}
        for peer in self.watch.peers.values():
            if peer.fd in full:
                if peer.slow_since is None:
                    peer.slow_since = now
                    peer.extra["missed_at_start"] = self.missed
                if now - self._reported.get(peer.fd, -1e9) >= REPORT_EVERY_S:
                    self._reported[peer.fd] = now
                    log.warning("%s: subscriber %s is not reading: its queue has been full for %.0f s (%d messages "
                                "sent meanwhile were missed by a full subscriber; vidar_publish_missed_total)",
                                self.name, peer.address, now - peer.slow_since,
                                self.missed - peer.extra["missed_at_start"])
            elif peer.slow_since is not None:
                log.warning("%s: subscriber %s reads again after %.1f s", self.name, peer.address,
                            now - peer.slow_since)
                peer.slow_since = None
                self._reported.pop(peer.fd, None)
        for fd in [fd for fd in self._reported if fd not in self.watch.peers]:
            del self._reported[fd]
        self._settled = 0 if full else self._settled + 1
        if self._settled >= self.SETTLE_CHECKS:
            self._suspect_since = None

    def close(self) -> None:
        self.watch.close()
