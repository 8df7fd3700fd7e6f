"""Reading a field of a control request (a msgpack or JSON map) with a typed error that names the op and the key,
and the one check that request and config text is valid UTF-8 (`text_error`).

Here, below every package, because two sides read requests: the control socket (engine/control) and a
model family's post-processor serving its own ops (SAM 2's add_object, in engine/models), which must
not import the control plane.
"""

from __future__ import annotations

from typing import Any, Optional

from engine.errors import ControlError


def need(req: dict, key: str, kind: type) -> Any:
    """req[key], which must be a `kind`; a ControlError naming the op and the key otherwise."""
    if key not in req:
        raise ControlError(f"{req.get('op')}: missing key {key!r}")
    value = req[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ControlError(f"{req.get('op')}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def text_error(value: Any) -> Optional[str]:
    """Where `value` (a request or a config tree: maps, lists, scalars) holds text that is not valid
    UTF-8, and what to do; None when it holds none. Such text is a lone UTF-16 surrogate ("\\ud800"):
    JSON and YAML escapes decode to one, and Python reads undecodable bytes of argv and headers as
    them. It cannot be encoded again, so a stream with one in its URL broke every `list` reply, its
    events and its log lines: refused where text enters (Engine.control, the config, the websocket).
    The text itself is never echoed (a URL may carry credentials). Walked without recursion: a
    request may nest as deep as its decoder allows."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if not _is_utf8(v):
                at = next(i for i, c in enumerate(v) if not _is_utf8(c))
                return (f"{path[:200] or 'the request'}: not valid UTF-8 text (a lone surrogate "
                        f"U+{ord(v[at]):04X} at character {at}): send the text as UTF-8")
        elif isinstance(v, dict):
            for k, item in v.items():
                key = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and not _is_utf8(k):
                    return f"{path[:200] or 'the request'}: a key is not valid UTF-8 text: send keys as UTF-8"
                todo.append((key, item))
        elif isinstance(v, (list, tuple)):
            todo.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(v))
    return None


def _is_utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
