"""The control socket: add and remove streams and SAM 2 objects while the engine runs.

ZeroMQ REP on `control.endpoint` (default tcp://127.0.0.1:5557), served by the asyncio control
plane. Requests and replies are msgpack maps; every request gets exactly one reply:
    {"op": "list"}
    {"op": "add_stream", "stream": {"id": "cam2", "url": "rtsp://...", "mode": "live"}}
    {"op": "remove_stream", "stream": "cam2"}
    {"op": "add_object", "stream": "cam1", "id": 3, "box": [x0, y0, x1, y1]}      # or "points": [[x, y, 1], ...]
    {"op": "remove_object", "stream": "cam1", "id": 3}
    {"op": "reset_stream", "stream": "cam1"}                                      # forget its objects
Replies: {"ok": true, ...} or {"ok": false, "error": "what was wrong and what to do"}.
A bad request never stops the engine.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
from pydantic import ValidationError

from .config import ObjectConfig, StreamConfig
from .errors import VidarError

log = logging.getLogger("vidar.control")

OPS = ("list", "add_stream", "remove_stream", "add_object", "remove_object", "reset_stream")


class ControlError(VidarError):
    """A control request was malformed or named something unknown."""


def _need(req: dict, key: str, kind: type) -> Any:
    if key not in req:
        raise ControlError(f"{req.get('op')}: missing key {key!r}")
    value = req[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ControlError(f"{req.get('op')}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _decoder(engine):
    if engine.decoder is None:
        raise ControlError("objects need the SAM 2 pool: configure models.sam2")
    return engine.decoder


def handle(engine, req: Any) -> dict:
    """Run one request against the engine. Never raises: errors become {"ok": false, "error": ...}."""
    try:
        if not isinstance(req, dict) or not isinstance(req.get("op"), str):
            raise ControlError(f"a request is a map with an 'op' key, one of {list(OPS)}")
        op = req["op"]
        if op == "list":
            return {"ok": True, "streams": engine.describe()}
        if op == "add_stream":
            try:
                scfg = StreamConfig.model_validate(_need(req, "stream", dict))
            except ValidationError as err:
                e = err.errors()[0]
                raise ControlError(f"add_stream: stream.{'.'.join(map(str, e['loc']))}: {e['msg']}") from None
            engine.add_stream(scfg)
            return {"ok": True, "stream": scfg.id}
        if op == "remove_stream":
            engine.remove_stream(_need(req, "stream", str))
            return {"ok": True}
        if op == "add_object":
            try:
                o = ObjectConfig.model_validate({k: v for k, v in req.items() if k != "op"})
            except ValidationError as err:
                e = err.errors()[0]
                raise ControlError(f"add_object: {'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}") from None
            from .workers.sam2_tracker import Prompt
            _decoder(engine).add_object(o.stream, Prompt(o.id, box=o.box, points=o.points))
            return {"ok": True}
        if op == "remove_object":
            _decoder(engine).remove_object(_need(req, "stream", str), _need(req, "id", int))
            return {"ok": True}
        if op == "reset_stream":
            _decoder(engine).reset_stream(_need(req, "stream", str))
            return {"ok": True}
        raise ControlError(f"unknown op {op!r}; allowed: {list(OPS)}")
    except VidarError as err:
        return {"ok": False, "error": str(err)}
    except Exception as err:  # a bug must not take the engine down with it
        log.exception("control: request %r failed", req)
        return {"ok": False, "error": f"internal error: {type(err).__name__}: {err}"}


async def serve(engine, endpoint: str, max_message_bytes: int, stop) -> None:
    """Answer requests until `stop` (an asyncio.Event) is set."""
    import asyncio

    import zmq
    import zmq.asyncio

    # Shadow the engine's context, so the CURVE authenticator (a per-context ZAP handler) covers it.
    ctx = zmq.asyncio.Context.shadow(zmq.Context.instance().underlying)
    sock = ctx.socket(zmq.REP)
    if engine.curve is not None:
        engine.curve.server_socket(sock)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # larger requests are cut off by ZeroMQ itself
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    log.info("control socket on %s", endpoint)
    loop = asyncio.get_running_loop()
    try:
        while not stop.is_set():
            if not await sock.poll(100):
                continue
            raw = await sock.recv()
            try:
                req = msgpack.unpackb(raw, raw=False)
            except Exception:
                reply = {"ok": False, "error": "request is not valid msgpack"}
            else:
                reply = await loop.run_in_executor(None, handle, engine, req)
            await sock.send(msgpack.packb(reply, use_bin_type=True))
    finally:
        sock.close(0)


def request(endpoint: str, req: dict, timeout: float = 10.0, curve: tuple[str, str] | None = None) -> dict:
    """Client side: send one request, wait for its reply (raises TimeoutError).
    curve: (client secret certificate, server public certificate) when the engine uses CURVE."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        from .security import client_socket
        client_socket(sock, *curve)
    sock.connect(endpoint)
    try:
        sock.send(msgpack.packb(req, use_bin_type=True))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply from {endpoint} within {timeout} s (is vidar running?)")
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)
