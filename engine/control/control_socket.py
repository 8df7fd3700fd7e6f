"""The control socket: add and remove streams and SAM 2 objects while the engine runs.

ZeroMQ REP on `control.endpoint` (default tcp://127.0.0.1:5557), served by the asyncio control
plane. Requests and replies are msgpack maps; every request gets exactly one reply:
    {"op": "list"}
    {"op": "add_stream", "stream": {"id": "cam2", "url": "rtsp://...", "mode": "live"}}
    {"op": "remove_stream", "stream": "cam2"}                                     # optional "reason": the eos's
    {"op": "add_object", "stream": "cam1", "id": 3, "box": [x0, y0, x1, y1]}      # or "points": [[x, y, 1], ...]
    {"op": "remove_object", "stream": "cam1", "id": 3}
    {"op": "reset_stream", "stream": "cam1"}                                      # forget its objects
Replies: {"ok": true, ...} or {"ok": false, "error": "what was wrong and what to do"}.
A bad request never stops the engine.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any

import msgpack
from pydantic import ValidationError

from streams import redact_url

from engine.security.binds import ZMQ_HANDSHAKE_MS
from engine.config import StreamConfig
from engine.errors import ConfigError, ControlError, VidarError
from engine.models.registry import FAMILY_OPS, pool_for_op

log = logging.getLogger("vidar.control")

CORE_OPS = ("list", "add_stream", "remove_stream")
OPS = CORE_OPS + tuple(op for ops in FAMILY_OPS.values() for op in ops)

__all__ = ["ControlError", "OPS", "bind", "handle", "need", "request", "serve"]


def need(req: dict, key: str, kind: type) -> Any:
    """req[key], which must be a `kind`; a ControlError naming the op and the key otherwise."""
    if key not in req:
        raise ControlError(f"{req.get('op')}: missing key {key!r}")
    value = req[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ControlError(f"{req.get('op')}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _wait(fut: Future, timeout: float, op: str) -> Any:
    try:
        return fut.result(timeout)
    except FutureTimeout:
        # A request that has not started is dropped (an add_stream still waiting for the same id's
        # removal, a request still queued): the caller was told it failed, so it must not happen later.
        # The core never marks its futures running, so cancel() succeeds until they are resolved.
        fut.cancel()
        raise ControlError(f"{op}: no answer from the engine within {timeout:g} s (overloaded, or an add waiting "
                           "for a removal of the same id): not applied if it had not started; check with list") from None


def handle(engine, req: Any, timeout: float = 10.0) -> dict:
    """Run one request against the engine, through the thread that owns what it changes: stream ops on
    the engine core, object ops on the output thread of the pool that serves them. Never raises:
    errors become {"ok": false, "error": ...}. Requests are never logged (URLs may hold credentials)."""
    op = req.get("op") if isinstance(req, dict) else None
    try:
        if not isinstance(op, str):
            raise ControlError(f"a request is a map with an 'op' key, one of {list(OPS)}")
        if op == "list":
            return {"ok": True, "streams": engine.describe()}
        if op == "add_stream":
            try:
                scfg = StreamConfig.model_validate(need(req, "stream", dict))
            except ValidationError as err:
                e = err.errors()[0]
                raise ControlError(f"add_stream: stream.{'.'.join(map(str, e['loc']))}: {e['msg']}") from None
            _wait(engine.core.call(engine.table.add, scfg), timeout, op)
            log.info("stream %s added (%s)", scfg.id, redact_url(scfg.url))
            return {"ok": True, "stream": scfg.id}
        if op == "remove_stream":
            why = req.get("reason", "removed")  # the eos's reason (a cluster moving the stream says so)
            if not isinstance(why, str) or not why:
                raise ControlError("remove_stream: 'reason' must be a non-empty string")
            _wait(engine.core.call(engine.table.remove, need(req, "stream", str), why[:200]), timeout, op)
            return {"ok": True}
        pool = engine.pool_serving(op)
        if pool is not None:
            processor = pool.spec.processor
            extra = _wait(pool.output.post(lambda: processor.control(op, dict(req))), timeout, op)
            return {"ok": True, **(extra or {})}
        family = pool_for_op(op)
        if family is not None:
            raise ControlError(f"{op} needs the {family} pool: configure models.{family}")
        raise ControlError(f"unknown op {op!r}; allowed: {list(OPS)}")
    except VidarError as err:
        return {"ok": False, "error": str(err)}
    except Exception as err:  # a bug must not take the engine down with it
        why = redact_url(f"{type(err).__name__}: {err}")
        log.error("control: %s request failed with an internal error: %s", str(op)[:40], why)
        return {"ok": False, "error": f"internal error: {why}"}


def bind(endpoint: str, max_message_bytes: int, *, curve=None, ctx=None):
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
