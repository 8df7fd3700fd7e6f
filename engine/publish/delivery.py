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

A subtlety of libzmq decides the rest: a send without NODROP that finds a subscriber's pipe full deactivates
that pipe until its reader has drained half of it, and while it is inactive every send, NODROP or not, skips it
without a word (xpub.cpp / dist.cpp: inactive pipes are never "matching"). So after a lossy send the
subscribers that were full are `suspect`: a live message on a topic one of them subscribed to counts as missed
(an upper bound: it may have caught up), and a lossless message on such a topic is not sent (it could be
skipped for that subscriber): that offline stream waits, as it would for a full subscriber. Which subscriber
subscribed to what is known from the subscription messages (XPUB_VERBOSE) and the descriptor each came in on
(zmq.SRCFD). A subscriber stops being suspect when it has had nothing unsent on SETTLE_CHECKS consecutive checks
CHECK_EVERY_S apart (libzmq's I/O thread moves a pipe's messages into the kernel as fast as it takes them, so an
empty kernel queue for that long means the pipe was drained). When a lossy send happens and no subscriber can be
named as full (libzmq's I/O thread behind rather than the kernel), the whole socket is suspect until nobody is
backlogged, so nothing lossless can be skipped silently. The kernel queue is a heuristic (a distant subscriber
on a slow link shows unsent bytes too): it errs on holding offline streams back, never on losing their messages.

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
SETTLE_CHECKS = 2     # checks with nothing unsent before a suspect subscriber is trusted again


class Sent(enum.Enum):
    ALL = "all"          # every subscriber of the topic had room
    MISSED = "missed"    # sent; one or more full subscribers missed it
    REFUSED = "refused"  # lossless and a subscriber was full: not sent (retry later)


class Delivery:
    """Owned by the thread that owns the socket. `sock` is an XPUB with XPUB_NODROP and XPUB_VERBOSE set;
    create the Delivery before binding it, so that its monitor sees every subscriber."""

    def __init__(self, sock: zmq.Socket, name: str, clock=time.monotonic):
        self._sock, self.name, self._clock = sock, name, clock
        # Subscribers are not closed for saying nothing: a SUB may connect before it subscribes (a cluster
        # head's XSUB does, until its own first subscriber comes), and one that never subscribes is sent
        # nothing. Raw peers are refused at the handshake (guard_socket: ZAP domain, HANDSHAKE_IVL).
        self.watch = PeerWatch(sock, name, None, clock)
        self.missed = 0           # messages sent while a subscriber subscribed to them was full or suspect
        self.refused = 0          # lossless sends refused (the caller retries)
        self._subs: dict[int, list[bytes]] = {}   # descriptor -> the topic prefixes it subscribed to
        self._suspect: dict[int, int] = {}        # descriptor -> checks in a row with nothing unsent
        self._all_suspect: Optional[int] = None   # the whole socket (nobody could be named): same count
        self._checked = -1e9
        self._reported: dict[int, float] = {}

    @property
    def suspect(self) -> bool:
        return bool(self._suspect) or self._all_suspect is not None

    def send(self, frames: list, *, lossless: bool) -> Sent:
        topic = bytes(frames[0])
        held = self._held(topic)
        if lossless and held:
            self._check()
            self.refused += 1
            return Sent.REFUSED
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
            if held:  # a suspect subscriber of this topic may have been skipped by libzmq without a word
                self.missed += 1
                return Sent.MISSED
            return Sent.ALL
        except zmq.Again:  # a subscriber of this topic is full
            pass
        if lossless:  # nothing deactivated by this: NODROP refused before writing to any pipe
            self._check()
            self.refused += 1
            return Sent.REFUSED
        self._sock.setsockopt(zmq.XPUB_NODROP, 0)
        try:  # without NODROP libzmq writes to every matching subscriber with room and skips the full ones
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        finally:
            self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.missed += 1
        self._suspect_full(topic)
        return Sent.MISSED

    def read_subscriptions(self) -> list[bytes]:
        """Subscription messages received (b"\\x01topic" / b"\\x00topic"), each noted for its subscriber."""
        out = []
        # asked first, not found out by a recv raising Again: pyzmq builds an exception (with its strerror) for each,
        # and this runs every time the publisher thread wakes
        while self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            msg = frame.bytes
            if msg[:1] not in (b"\x00", b"\x01"):
                continue
            out.append(msg)
            try:
                fd = frame.get(zmq.SRCFD)
            except zmq.ZMQError:
                continue
            prefixes = self._subs.setdefault(fd, [])
            if msg[:1] == b"\x01":
                prefixes.append(msg[1:])
            elif msg[1:] in prefixes:
                prefixes.remove(msg[1:])
        return out

    def tick(self) -> None:
        """Between sends: track connections; while anything is suspect, look again (caught up, or gone)."""
        if self.watch.poll():
            for fd in [fd for fd in self._subs if fd not in self.watch.peers]:
                del self._subs[fd]
            for fd in [fd for fd in self._suspect if fd not in self.watch.peers]:
                del self._suspect[fd]
        if self.suspect:
            self._check()

    def slow(self) -> list[Peer]:
        return [p for p in self.watch.peers.values() if p.slow_since is not None]

    def _subscribed(self, fd: int, topic: bytes) -> bool:
        return any(topic.startswith(p) for p in self._subs.get(fd, ()))

    def _held(self, topic: bytes) -> bool:
        """A suspect subscriber may be skipped silently on this topic."""
        return self._all_suspect is not None or any(self._subscribed(fd, topic) for fd in self._suspect)

    def _suspect_full(self, topic: bytes) -> None:
        """After a lossy send: the backlogged subscribers of the topic may have been deactivated."""
        self._checked = -1e9  # look now
        self._check()
        named = [p.fd for p in self.watch.peers.values()
                 if p.slow_since is not None and self._subscribed(p.fd, topic)]
        for fd in named:
            self._suspect[fd] = 0
        if not named:
            self._all_suspect = 0

    def _check(self) -> None:
        """At most every CHECK_EVERY_S: which subscribers are backlogged (named in the log), and which suspects
        (or the whole socket) have settled (nothing unsent SETTLE_CHECKS times in a row)."""
        now = self._clock()
        if now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        full = {p.fd for p in self.watch.backlogged(SLOW_BYTES)}
        for peer in self.watch.peers.values():
            if peer.fd in full:
                self._note_slow(peer, now)
            elif peer.slow_since is not None:
                log.warning("%s: subscriber %s reads again after %.1f s", self.name, peer.address,
                            now - peer.slow_since)
                peer.slow_since = None
                self._reported.pop(peer.fd, None)
        for fd in [fd for fd in self._reported if fd not in self.watch.peers]:
            del self._reported[fd]
        for fd in list(self._suspect):
            self._suspect[fd] = 0 if fd in full else self._suspect[fd] + 1
            if self._suspect[fd] >= SETTLE_CHECKS:
                del self._suspect[fd]
        if self._all_suspect is not None:
            self._all_suspect = 0 if full else self._all_suspect + 1
            if self._all_suspect >= SETTLE_CHECKS:
                self._all_suspect = None

    def _note_slow(self, peer: Peer, now: float) -> None:
        if peer.slow_since is None:
            peer.slow_since = now
            peer.extra["missed_at_start"] = self.missed
        if now - self._reported.get(peer.fd, -1e9) >= REPORT_EVERY_S:
            self._reported[peer.fd] = now
            log.warning("%s: subscriber %s is not reading: its queue has been full for %.0f s (%d messages sent "
                        "meanwhile may have been missed by it; vidar_publish_missed_total)", self.name, peer.address,
                        now - peer.slow_since, self.missed - peer.extra["missed_at_start"])

    def close(self) -> None:
        self.watch.close()
