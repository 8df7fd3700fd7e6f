"""What an ingest process sends the core (frames, states, events, heartbeats) travels on a socketpair of its own.

One AF_UNIX SOCK_SEQPACKET socketpair per process, made by the core before the process starts and handed to it
by multiprocessing (forkserver passes the descriptor with the process's arguments); the payload is still one
wire.py message (type byte + msgspec) per packet. Commands (core -> process) stay on ZeroMQ (client.py): they
are few and off a frame's path.

Why not ZeroMQ here, as issue 33 item 7 suggested and this path used until it was measured (48 x 240p60 live,
null pool, this 2-core machine): a ZeroMQ socket is not thread-safe, so a process's stream threads shared one
PUSH under a lock; a thread holding it released the GIL inside zmq_send and had to take the GIL back before it
could let go of the lock, so every other sender waited behind that GIL wait. The time from a frame's write to
its descriptor's send was p99 0.9-1.4 ms of the crossing's 2 ms (an instrumented run), and each message then
passed ZeroMQ's I/O thread in the process and the core's before the core's reader woke: two more thread
wake-ups on a busy machine. A seqpacket socket keeps message boundaries (the kernel frames them: nothing
hand-rolled), a send from any thread is one atomic packet (no lock), the core's reader wakes on the socket
itself, and what a process sent before it died stays readable up to its end of file (a ZeroMQ disconnect
discarded what was unread). The bytes a sender may queue are its socket's send buffer: SNDBUF asked for,
capped by the kernel's net.core.wmem_max (Linux's default, 208 KiB, holds ~170 descriptors: ~0.1 s of 24 streams
at 60 fps; ZeroMQ queued up to its high-water mark, 100,000). A full buffer blocks the sender, the process's
main thread (heartbeats, commands) too, until the core reads again: only while the core's I/O thread is not
reading, and at shutdown the core reads until its processes have exited (IngestHub.close).
"""

from __future__ import annotations

import select
import socket
from typing import Any, Optional

#: the send buffer asked for on a process's end (the kernel caps it at net.core.wmem_max and doubles it): ~4 s of
#: descriptors at 1,500 a second where wmem_max allows, ~0.1 s at Linux's default 208 KiB
SNDBUF = 4 << 20
#: the longest message read; wire.py's messages are far smaller (texts are clipped to wire.TEXT_MAX)
MAX_MESSAGE = 1 << 16


def pair() -> tuple[socket.socket, socket.socket]:
    """(the core's end, non-blocking; the process's end). Raises OSError (EMFILE: out of descriptors)."""
    core, proc = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        proc.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        core.setblocking(False)
    except BaseException:
        core.close()
        proc.close()
        raise
    return core, proc


class Reader:
    """The core's end of one uplink. Read by the I/O thread only, into its one buffer."""

    def __init__(self, sock: socket.socket, owner: Any = None):
        self.sock, self.owner = sock, owner  # owner: the IngestProcess (None: a test's injected uplink)
        self.fd = sock.fileno()
        self.eof = False

    def read(self, buf: bytearray) -> Optional[int]:
        """The next message's length, its bytes in buf[:length] (a length over len(buf): it did not fit and was
        cut); 0 at end of file (the process is gone and everything it sent was read); -1 for an empty packet (never
        one of ours); None when none is waiting."""
        if self.eof:
            return 0
        try:
            n = self.sock.recv_into(buf, 0, socket.MSG_TRUNC)  # MSG_TRUNC: the packet's real length
        except BlockingIOError:
            return None
        except OSError:  # ECONNRESET and the like (the core never writes here): the peer is gone
            n = 0
        if n == 0:
            if not self._hung_up():  # a packet of no bytes, not the end of file: the peer is still there
                return -1
            self.eof = True
        return n

    def _hung_up(self) -> bool:
        """Whether the peer closed its end (after a read of 0 bytes, which an empty packet also gives)."""
        p = select.poll()
        p.register(self.fd, select.POLLRDHUP)
        return any(ev & (select.POLLRDHUP | select.POLLHUP) for _, ev in p.poll(0))

    def close(self) -> None:
        self.eof = True
        self.sock.close()
