"""Reading a field of a control request (a msgpack or JSON map) with a typed error that names the op and the key.

Here, below every package, because two sides read requests: the control socket (engine/control) and a
model family's post-processor serving its own ops (SAM 2's add_object, in engine/models), which must
not import the control plane.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ControlError


def need(req: dict, key: str, kind: type) -> Any:
    """req[key], which must be a `kind`; a ControlError naming the op and the key otherwise."""
    if key not in req:
        raise ControlError(f"{req.get('op')}: missing key {key!r}")
    value = req[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ControlError(f"{req.get('op')}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value
