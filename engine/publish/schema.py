"""Message schema (version `SCHEMA_VERSION`), shared by the publisher and the client.

Every message is a two-frame ZeroMQ multipart: [topic, msgpack map].
  results: topic `<type>.<stream>` (e.g. `classify.cam1`), map with v, type, stream, seq, pts,
           t_capture, t_publish (unix seconds), latency_ms (capture to publish, measured on the monotonic
           clock, so a step of the wall clock never shows as latency), weights and the model's fields
  events:  topic `event.<stream>`, map with v, type="event", stream, kind, reason, t; `degraded` and
           `restored` (the degradation ladder) add pool, rung, interval and level
The schema may grow (new keys); a change of meaning bumps `v`.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

SCHEMA_VERSION = 2
#: `pending`: a cluster has no engine with room for the stream yet; it is placed (`started`) as soon as one has
EVENT_KINDS = ("started", "eos", "error", "reconnecting", "connected", "degraded", "restored", "relocated", "pending")


def result_message(kind: str, *, stream: str, seq: int, pts: float, t_capture: float, weights: str,
                   fields: dict[str, Any], t_publish: float | None = None,
                   latency_ms: float | None = None) -> dict[str, Any]:
    """latency_ms: measured by the caller on the monotonic clock; None: t_publish - t_capture (wall clock)."""
    t_pub = time.time() if t_publish is None else t_publish
    if latency_ms is None:
        latency_ms = (t_pub - t_capture) * 1e3
    msg = {"v": SCHEMA_VERSION, "type": kind, "stream": stream, "seq": seq, "pts": pts,
           "t_capture": t_capture, "t_publish": t_pub, "latency_ms": latency_ms,
           "weights": weights}
    msg.update(fields)
    return msg


def event_message(stream: str, kind: str, reason: str, t: float | None = None) -> dict[str, Any]:
    if kind not in EVENT_KINDS:
        raise ValueError(f"event kind {kind!r} not in {EVENT_KINDS}")
    return {"v": SCHEMA_VERSION, "type": "event", "stream": stream, "kind": kind, "reason": reason,
            "t": time.time() if t is None else t}


def topic(kind: str, stream: str) -> bytes:
    return f"{kind}.{stream}".encode()


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(payload: bytes) -> dict[str, Any]:
    return msgpack.unpackb(payload, raw=False)
