"""Binding the control sockets under the rules every socket obeys (CURVE when configured, a message size cap,
a handshake deadline, no ZMTP 1.0 peers, a valid request within the deadline). Here rather than in
engine/control because the Engine facade binds its control socket at start-up (a busy port is a configuration
error, exit 2, before any stream starts) and the facade sits below the control plane that serves the socket;
a cluster head binds its own the same way (engine/cluster/driver.py).

Why ROUTER, not REP: a REP socket reads a request's first part and must then reply with exactly one
message; a request of several parts (a REQ `send_multipart`, a DEALER without the empty delimiter) put it
in a state where the reply fails (EFSM), which ended the task serving it, and three of those were engine
death. A ROUTER hands over every message whole with its envelope, so each shape can be checked and answered
(engine/control/control_socket.py `split_request`) and none can wedge the socket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from engine.errors import BindError
from engine.security.binds import ZMQ_HANDSHAKE_MS, zmq_ipv6
from engine.security.ports import MovedPort, in_use, zmq_any_port
from engine.security.peers import PeerWatch

log = logging.getLogger("vidar.control")

#: the ZAP domain set on every socket vidar binds. With a domain set, libzmq asks the ZAP handler about NULL-
#: mechanism peers too (allowed when no handler runs, or by pyzmq's authenticator when CURVE runs) and, the
#: point of it, refuses ZMTP 1.0 peers outright: two bytes (`01 00`) were otherwise a subscriber of every topic
#: that never reads (libzmq `zmtp_engine.cpp`: "reject ZMTP 1.0 connections if ZAP is enabled").
ZAP_DOMAIN = b"vidar"


def guard_socket(sock, *, curve=None) -> None:
    """The options every ZeroMQ socket vidar binds gets, before bind: CURVE when configured, the ZAP domain
    (no ZMTP 1.0 peers), the handshake deadline, no linger."""
    import zmq

    if curve is not None:  # the CURVE authenticator is per context: it covers this socket too (and refuses
        curve.server_socket(sock)  # ZMTP 1.0: only NULL-mechanism sockets take such peers)
    else:  # not with CURVE: pyzmq's authenticator holds its certificates under the domain "*" only
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.HANDSHAKE_IVL, ZMQ_HANDSHAKE_MS)  # a peer that never handshakes: closed (binds.py)


@dataclass
class ControlSocket:
    """A bound control socket (ZeroMQ ROUTER) and what its server keeps across restarts of its task."""

    sock: object
    endpoint: str
    watch: PeerWatch
    moved: Optional[MovedPort] = None  # the default endpoint was taken: bound on a free port instead
    pending: Optional[list] = None   # the envelope of the request being handled (answered if the task died)
    malformed: int = 0               # requests refused for their shape (not one msgpack part after a delimiter)
    logged_at: float = field(default=-1e9)

    def close(self, linger: int = 0) -> None:
        self.watch.close()
        self.sock.close(linger)


def bind_control_socket(endpoint: str, max_message_bytes: int, *, curve=None, ctx=None,
                        key: str = "control.endpoint", movable: bool = False) -> ControlSocket:
    """A control socket, bound now (at start-up: a busy port is a configuration error, exit 2). `movable`: the
    endpoint is the key's default, left unset: taken, it moves to a port the OS picks (engine/security/ports.py),
    and `ControlSocket.moved` says so."""
    import zmq

    sock = (ctx or zmq.Context.instance()).socket(zmq.ROUTER)
    watch = PeerWatch(sock, f"control socket {endpoint}", ZMQ_HANDSHAKE_MS / 1e3)  # before bind: sees every peer
    guard_socket(sock, curve=curve)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # larger message parts are cut off by ZeroMQ itself
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, zmq_ipv6(endpoint))
    moved = None
    try:
        try:
            sock.bind(endpoint)
            bound = endpoint
        except zmq.ZMQError as err:
            if not (movable and in_use(err)):
                raise
            sock.bind(zmq_any_port(endpoint))
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            moved = MovedPort(key, endpoint, bound)
            log.warning("%s", moved.note())
    except zmq.ZMQError as err:
        watch.close()
        sock.close(0)
        fix = (" (or leave it unset: its default moves to a free port when taken), or control.enabled: false"
               if key == "control.endpoint" else "")
        raise BindError(key, endpoint, f"{key}: cannot bind {endpoint!r}: {err} (another vidar running? set {key} "
                                       f"to a free port{fix})") from None
    watch.name = f"control socket {bound}"
    log.info("control socket on %s", bound)
    return ControlSocket(sock, bound, watch, moved=moved)
