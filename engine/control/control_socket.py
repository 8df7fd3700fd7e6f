"""The control socket: the engine's control API (engine/core/ops.py) over ZeroMQ REP on `control.endpoint`
(default tcp://127.0.0.1:5557), served by the asyncio control plane. Requests and replies are msgpack
maps; every request gets exactly one reply (the ops are listed in engine/core/ops.py). The socket is bound
by the Engine at start (engine/security/sockets.py); `request` is the client side.
"""

from __future__ import annotations

import logging

import msgpack

log = logging.getLogger("vidar.control")


async def serve(engine, sock, stop) -> None:
    """Answer requests on the bound socket until `stop` (an asyncio.Event) is set. Requests run on an
    executor thread (they wait for the engine's threads), never on the event loop."""
    import asyncio

    import zmq.asyncio

    asock = zmq.asyncio.Socket.shadow(sock.underlying)
    loop = asyncio.get_running_loop()
    # A REP socket must answer the request it received before it can receive another: if an earlier run
    # of this task died in between (it is restarted by its supervisor), that request is answered now,
    # with an error. When nothing was pending, ZeroMQ refuses the send (EFSM) and nothing happens.
    try:
        await asock.send(encode_reply({"ok": False, "error": "internal error: the control socket restarted "
                                                              "while handling this request; check with list"}),
                         zmq.NOBLOCK)
    except zmq.ZMQError:
        pass
    while not stop.is_set():
        if not await asock.poll(100):
            continue
        raw = await asock.recv()
        try:
            req = msgpack.unpackb(raw, raw=False)
        except Exception:
            reply = {"ok": False, "error": "request is not valid msgpack"}
        else:
            reply = await loop.run_in_executor(None, engine.control, req)
        await asock.send(encode_reply(reply))


def encode_reply(reply: dict) -> bytes:
    """A reply as msgpack; one that cannot be encoded becomes an error reply (a REP socket must answer
    every request, and an exception here would end the control socket's task)."""
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
