"""The peers of a bound ZeroMQ socket, one by one: which connection is which, which never said anything
valid, which does not read what is sent to it.

ZeroMQ hides connections behind its sockets: an XPUB fans out to every subscriber and a ROUTER names peers
by routing id, but neither says which TCP (or ipc) connection is slow, nor closes one on request. Its
socket monitor does say which descriptor each connection has (ACCEPTED, DISCONNECTED, CLOSED carry the fd),
and every message received carries the descriptor it came in on (`zmq.SRCFD`). With those two, this class
(owned by the one thread that serves the socket):
  * closes a peer that has completed no valid request within `limit_s` of being accepted (a raw TCP peer,
    a client that connected and said nothing; used on the control sockets): `shutdown(2)` on a duplicate of its descriptor makes
    libzmq see the connection end and close it itself (closing libzmq's descriptor under it would not be
    safe; shutting the connection down is);
  * reads how many bytes wait unsent in the kernel for each peer (SIOCOUTQ), which is how a subscriber
    that stopped reading shows: its send queue stays full.
Descriptors are reused by the OS after a close: monitor events are read before any descriptor is used, and
a peer's address is checked again before it is shut down.

Why not a library: pyzmq has no per-connection API (libzmq's `zmq_socket_monitor` plus SRCFD is the
documented way to see connections); the code is a socket monitor reader and two system calls.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import termios
import time
from dataclasses import dataclass, field
from typing import Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("vidar.security")

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_SIOCOUTQ = termios.TIOCOUTQ  # Linux: SIOCOUTQ == TIOCOUTQ: bytes queued (TCP: unsent and unacknowledged)
_SIOCOUTQNSD = 0x894B         # Linux: TCP bytes not yet sent (a healthy distant peer has bytes in flight, unacked)


@dataclass
class Peer:
    fd: int
    address: str                      # "127.0.0.1:51234", or the ipc path; "?" when it could not be read
    t_accepted: float                 # monotonic
    sndbuf: int = 0                   # the connection's kernel send buffer (SO_SNDBUF), bytes
    valid: bool = False               # has sent at least one valid request (or subscription)
    slow_since: Optional[float] = None  # monotonic: since when its queue was seen full
    extra: dict = field(default_factory=dict)


def peer_address(fd: int) -> str:
    """The remote address of a connection, read on a duplicate of its descriptor (never closing libzmq's)."""
    return _peer(fd)[0]


def _dup(fd: int) -> socket.socket:
    """A socket object on a duplicate of libzmq's descriptor (closing it never closes libzmq's). Raises OSError
    (the duplicate closed) when the descriptor is gone or, reused meanwhile, is not a socket."""
    d = os.dup(fd)
    try:
        return socket.socket(fileno=d)
    except OSError:
        os.close(d)
        raise


def _peer(fd: int) -> tuple[str, int]:
    """(remote address, SO_SNDBUF) of a connection, read on a duplicate of its descriptor."""
    try:
        with _dup(fd) as s:
            addr = s.getpeername()
            sndbuf = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    except OSError:
        return "?", 0
    return _address(addr), sndbuf


def _address(addr) -> str:
    if isinstance(addr, tuple):
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return addr or "ipc peer"


def unsent_bytes(fd: int) -> int:
    """Bytes queued in the kernel for this connection and not yet sent (0 when it cannot be read): TCP's
    not-yet-sent bytes (SIOCOUTQNSD: bytes in flight to a distant, reading peer do not count), or for a unix
    socket (ipc://) what its peer has not read."""
    for request in (_SIOCOUTQNSD, _SIOCOUTQ):
        try:
            return struct.unpack("i", fcntl.ioctl(fd, request, b"\0\0\0\0"))[0]
        except OSError:  # SIOCOUTQNSD is TCP's only
            continue
    return 0


class PeerWatch:
    """The connections of one bound ZeroMQ socket, by descriptor. Not thread-safe: the thread (or task)
    that serves the socket owns it. `close()` stops the monitor."""

    def __init__(self, sock: zmq.Socket, name: str, limit_s: Optional[float], clock=time.monotonic):
        self.name, self.limit_s, self._clock = name, limit_s, clock
        self._sock = sock
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self.peers: dict[int, Peer] = {}
        self.closed_idle = 0  # peers closed for sending nothing valid in time

    def poll(self) -> bool:
        """Apply pending monitor events; True if the set of peers changed."""
        changed = False
        while True:
            try:
                if not self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # asked, not found out by Again raised
                    return changed
                ev = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return changed
            except zmq.ZMQError:  # the monitor was closed (shutting down)
                return changed
            fd = ev["value"]
            if ev["event"] == zmq.EVENT_ACCEPTED:
                address, sndbuf = _peer(fd)
                self.peers[fd] = Peer(fd, address, self._clock(), sndbuf)
            else:  # DISCONNECTED or CLOSED: gone (the descriptor may be reused from now on)
                self.peers.pop(fd, None)
            changed = True

    def seen(self, fd: Optional[int]) -> None:
        """A valid request (or subscription) came in on this descriptor: the peer may stay."""
        if fd is None:
            return
        peer = self.peers.get(fd)
        if peer is None:  # its ACCEPTED event is still in the monitor's queue
            self.poll()
            peer = self.peers.get(fd)
        if peer is not None:
            peer.valid = True

    def expire(self) -> int:
        """Close the peers accepted more than `limit_s` ago that have sent nothing valid (none when limit_s is
        None). Returns how many."""
        self.poll()
        if self.limit_s is None:
            return 0
        now, n = self._clock(), 0
        for peer in list(self.peers.values()):
            if peer.valid or now - peer.t_accepted < self.limit_s:
                continue
            if peer_address(peer.fd) != peer.address:  # gone and the descriptor reused: not ours to shut
                self.peers.pop(peer.fd, None)
                continue
            try:
                with _dup(peer.fd) as s:
                    s.shutdown(socket.SHUT_RDWR)  # libzmq sees the end and closes its descriptor itself
            except OSError:
                pass
            self.peers.pop(peer.fd, None)
            self.closed_idle += 1
            n += 1
        if n:
            log.warning("%s: closed %d connection(s) that sent no valid request within %g s (%d so far)",
                        self.name, n, self.limit_s, self.closed_idle)
        return n

    def defer(self, seconds: float) -> None:
        """The server was busy for `seconds` (one request at a time): peers not yet validated get that time back,
        since a request they sent meanwhile sits unread in the socket (closing them would lose its reply)."""
        for peer in self.peers.values():
            if not peer.valid:
                peer.t_accepted += seconds

    def backlogged(self, min_bytes: int) -> list[Peer]:
        """Peers with at least `min_bytes` (or half their send buffer, when that is smaller) waiting unsent in
        the kernel: they are not reading."""
        self.poll()
        return [p for p in self.peers.values()
                if unsent_bytes(p.fd) >= (min(min_bytes, p.sndbuf // 2) if p.sndbuf else min_bytes)]

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
