"""Binding the control socket under the rules every socket obeys (CURVE when configured, a message size cap,
a handshake deadline). Here rather than in engine/control because the Engine facade binds it at start-up
(a busy port is a configuration error, exit 2, before any stream starts) and the facade sits below the
control plane that serves the socket."""

from __future__ import annotations

import logging

from engine.errors import ConfigError
from engine.security.binds import ZMQ_HANDSHAKE_MS

log = logging.getLogger("vidar.control")


def bind_control_socket(endpoint: str, max_message_bytes: int, *, curve=None, ctx=None):
    """The control socket, bound now (at start-up: a busy port is a configuration error, exit 2).
    A plain ZeroMQ REP socket; `serve` answers on it through an asyncio shadow."""
    import zmq

    sock = (ctx or zmq.Context.instance()).socket(zmq.REP)
    if curve is not None:  # the CURVE authenticator is per context: it covers this socket too
        curve.server_socket(sock)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # larger requests are cut off by ZeroMQ itself
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, ZMQ_HANDSHAKE_MS)  # a peer that never handshakes: closed (binds.py)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as err:
        sock.close(0)
        raise ConfigError(f"control.endpoint: cannot bind {endpoint!r}: {err} "
                          "(another vidar running? pick another port, or control.enabled: false)") from None
    log.info("control socket on %s", endpoint)
    return sock
