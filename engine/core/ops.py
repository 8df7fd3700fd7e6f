"""The engine's control API: a request (a map, as the control socket, the live view and the cluster send it)
checked and turned into a typed request to the thread that owns what it changes: stream ops to the engine
core (requests.py), object ops to the output stage of the pool that serves them. No transport here: the
ZeroMQ socket is engine/control/control_socket.py.

    {"op": "list"}                       # "streams", and "ended": the last max_ended streams forgotten after they ended
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

from pydantic import ValidationError

from streams import redact_url

from engine.config import StreamConfig
from engine.core.requests import AddStream, RemoveStream
from engine.errors import ControlError, VidarError
from engine.executor.messages import ProcessorControl
from engine.models.registry import FAMILY_OPS, pool_for_op
from engine.util.request_fields import need

log = logging.getLogger("vidar.control")

CORE_OPS = ("list", "add_stream", "remove_stream")
OPS = CORE_OPS + tuple(op for ops in FAMILY_OPS.values() for op in ops)


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
            # "ended": the final state of streams forgotten after they ended (bounded: max_ended)
            return {"ok": True, "streams": engine.describe(), "ended": engine.ended_streams()}
        if op == "add_stream":
            try:
                scfg = StreamConfig.model_validate(need(req, "stream", dict))
            except ValidationError as err:
                e = err.errors()[0]
                raise ControlError(f"add_stream: stream.{'.'.join(map(str, e['loc']))}: {e['msg']}") from None
            _wait(engine.core.submit(AddStream(scfg)), timeout, op)
            log.info("stream %s added (%s)", scfg.id, redact_url(scfg.url))
            return {"ok": True, "stream": scfg.id}
        if op == "remove_stream":
            why = req.get("reason", "removed")  # the eos's reason (a cluster moving the stream says so)
            if not isinstance(why, str) or not why:
                raise ControlError("remove_stream: 'reason' must be a non-empty string")
            _wait(engine.core.submit(RemoveStream(need(req, "stream", str), why[:200])), timeout, op)
            return {"ok": True}
        pool = engine.pool_serving(op)
        if pool is not None:
            extra = _wait(pool.output.request(ProcessorControl(op, dict(req))), timeout, op)
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
