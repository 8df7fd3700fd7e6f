"""The control socket: the engine's control API (engine/core/ops.py) over ZeroMQ on `control.endpoint`
(default tcp://127.0.0.1:5557), served by the asyncio control plane. Requests and replies are msgpack
maps; every request gets exactly one reply (the ops are listed in engine/core/ops.py). The socket is bound
by the Engine at start (engine/security/sockets.py: a ROUTER, so that no message shape can wedge it);
`request` is the client side (a REQ socket, as any ZeroMQ client may use).

What a request is on the wire: the client's envelope (ROUTER's routing id, any routing frames a proxy
added), one empty delimiter frame, then exactly one frame holding the msgpack map. That is what a REQ
socket sends for `send(payload)`, and what a DEALER sends for `send_multipart([b"", payload])`. Every other
shape is refused with an error reply and counted (`split_request`); none reaches the engine.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import msgpack

log = logging.getLogger("vidar.control")

LOG_EVERY_S = 5.0  # malformed requests are logged in aggregate
#: why each malformed shape is refused (the error reply says it; the client can fix it)
NO_DELIMITER = ("a request is an empty delimiter frame, then one msgpack frame (a REQ socket's send, or a "
                "DEALER's send_multipart([b'', payload])); this message has no delimiter")
NO_BODY = "a request is one msgpack frame after the empty delimiter; this message has none"
MANY_PARTS = "a request is one msgpack frame after the empty delimiter; this message has {n}"


def split_request(frames: list[bytes]) -> tuple[list[bytes], Optional[bytes], Optional[str]]:
    """A ROUTER message as (envelope to reply with, the request's payload or None, why it is refused or None).
    The envelope ends with the delimiter when there is one, so a REQ client can read the reply; a message
    without one is answered with its routing id alone (a DEALER then reads the error as its only frame)."""
    try:
        k = frames.index(b"", 1)  # frames[0] is the routing id ROUTER prepends: never the delimiter
    except ValueError:
        return frames[:1], None, NO_DELIMITER
    body = frames[k + 1:]
    if len(body) == 1:
        return frames[:k + 1], body[0], None
    return frames[:k + 1], None, NO_BODY if not body else MANY_PARTS.format(n=len(body))


_NOT_MSGPACK = object()


def decode_request(payload: bytes) -> object:
    """The request as msgpack decodes it (the engine checks that it is a map), or _NOT_MSGPACK."""
    try:
        return msgpack.unpackb(payload, raw=False)
    except Exception:  # ExtraData, UnicodeDecodeError (msgpack refuses invalid UTF-8), ValueError, ...
        return _NOT_MSGPACK


def note_malformed(ctl, why: str) -> None:
    """Count a refused shape; log at most every LOG_EVERY_S (a flood must not flood the log)."""
    ctl.malformed += 1
    now = time.monotonic()
    if now - ctl.logged_at >= LOG_EVERY_S:
        ctl.logged_at = now
        log.warning("%s: refused a malformed request (%s); %d so far", ctl.watch.name, why.split(";")[-1].strip(),
                    ctl.malformed)


def _fd(frames) -> Optional[int]:
    import zmq
    try:
        return frames[-1].get(zmq.SRCFD)
    except (AttributeError, zmq.ZMQError):
        return None


async def serve(engine, ctl, stop) -> None:
    """Answer requests on the bound ControlSocket until `stop` (an asyncio.Event) is set. Requests run on an
    executor thread (they wait for the engine's threads), never on the event loop; one at a time, in order."""
    import asyncio

    import zmq.asyncio

    asock = zmq.asyncio.Socket.shadow(ctl.sock.underlying)
    loop = asyncio.get_running_loop()
    # An earlier run of this task that died while handling a request (it is restarted by its supervisor):
    # that request is answered now, with an error, so its client does not wait for a reply that never comes.
    if ctl.pending is not None:
        envelope, ctl.pending = ctl.pending, None
        await _send(asock, envelope, {"ok": False, "error": "internal error: the control socket restarted while "
                                                            "handling this request; check with list"})
    while not stop.is_set():
        ctl.watch.expire()  # peers that sent nothing valid within the handshake limit are closed
        if not await asock.poll(100):
            continue
        frames = await asock.recv_multipart(copy=False)
        envelope, req, reply = check_message(ctl, frames)
        if reply is None:
            ctl.pending, t0 = envelope, time.monotonic()
            reply = await loop.run_in_executor(None, engine.control, req)
            ctl.watch.defer(time.monotonic() - t0)  # requests queued meanwhile were not read: not their fault
        await _send(asock, envelope, reply)
        ctl.pending = None


def check_message(ctl, frames) -> tuple[list[bytes], object, Optional[dict]]:
    """Check one message's shape and payload: (envelope, request, None) for a request to run, or
    (envelope, None, error reply) for one refused before it reaches the engine (counted)."""
    envelope, payload, why = split_request([f.bytes for f in frames])
    if why is not None:
        note_malformed(ctl, why)
        return envelope, None, {"ok": False, "error": why}
    req = decode_request(payload)
    if req is _NOT_MSGPACK:
        note_malformed(ctl, "not msgpack")
        return envelope, None, {"ok": False, "error": "request is not valid msgpack"}
    ctl.watch.seen(_fd(frames))  # a valid request: this peer may stay connected
    return envelope, req, None


async def _send(asock, envelope: list[bytes], reply: dict) -> None:
    """Reply, never blocking: a peer that does not read its replies (or is gone) loses them, nobody else."""
    import zmq
    try:
        await asock.send_multipart([*envelope, encode_reply(reply)], zmq.NOBLOCK)
    except zmq.ZMQError:  # ROUTER drops what it cannot route; NOBLOCK keeps a full peer from blocking us
        pass


def serve_blocking(ctl, handler: Callable[[object], dict], stop) -> None:
    """The same service on a plain thread (a cluster head's control socket): `handler(request) -> reply`,
    until `stop` (a threading.Event) is set."""
    import zmq

    sock = ctl.sock
    while not stop.is_set():
        ctl.watch.expire()
        if not sock.poll(100):
            continue
        frames = sock.recv_multipart(copy=False)
        envelope, req, reply = check_message(ctl, frames)
        if reply is None:
            t0 = time.monotonic()
            reply = handler(req)
            ctl.watch.defer(time.monotonic() - t0)
        try:
            sock.send_multipart([*envelope, encode_reply(reply)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


def encode_reply(reply: dict) -> bytes:
    """A reply as msgpack; one that cannot be encoded becomes an error reply (every request is answered, and
    an exception here would end the control socket's task)."""
    try:
        return msgpack.packb(reply, use_bin_type=True)
    except Exception as err:  # OverflowError, TypeError, ValueError: a bug in what a reply carries
        log.error("control: a reply could not be encoded: %s: %s", type(err).__name__, err)
        return msgpack.packb({"ok": False, "error": f"internal error: the reply could not be encoded "
                                                    f"({type(err).__name__})"}, use_bin_type=True)


def request(endpoint: str, req: dict, timeout: float = 10.0, curve: tuple[str, str] | None = None) -> dict:
    """Client side: send one request, wait for its reply (raises TimeoutError).
    curve: (client secret certificate, server public certificate) when the engine uses CURVE."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        from engine.security.keys import client_socket
        client_socket(sock, *curve)
    sock.connect(endpoint)
    try:
        sock.send(msgpack.packb(req, use_bin_type=True))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply from {endpoint} within {timeout} s (is vidar running?)")
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)
