"""The JSON HTTP API of the live view: the control socket's ops over HTTP, through `Engine.control`
(one implementation: the same checks, the same threads, the same replies). See server.py.

Every refusal here is {"ok": false, "error": ...} with a 4xx status; the server's middleware gives
aiohttp's own refusals on /api/ paths the same format, and anything unexpected a 500 without details."""

from __future__ import annotations

import asyncio
import json
import re
from typing import NoReturn

from aiohttp import web

MAX_BODY_BYTES = 64 * 1024  # a stream or an object is a few hundred bytes (the app's client_max_size too)
MAX_DEPTH = 64              # JSON nesting refused beyond this, before json.loads (which recurses) sees it
MAX_OID_DIGITS = 10         # object ids are < 2**31: the config bounds the value, the path its length
_JSON_SYNTAX = re.compile(rb'[\[\]{}"\\]')


def refuse(cls: type[web.HTTPClientError], why: str, **kw) -> NoReturn:
    """Raise an aiohttp client error whose body is the API's error reply."""
    raise cls(**kw, text=json.dumps({"ok": False, "error": why}), content_type="application/json")


def json_depth(raw: bytes, limit: int) -> int:
    """The nesting depth of a JSON text, counted up to `limit + 1` (brackets inside strings are not
    nesting). Only brackets, quotes and backslashes are looked at: fast on a 64 KB body."""
    depth = deepest = 0
    in_string, escaped = False, -1  # escaped: the position of the character after a backslash
    for m in _JSON_SYNTAX.finditer(raw):
        pos, c = m.start(), m.group()
        if pos == escaped:
            continue
        if in_string:
            if c == b"\\":
                escaped = pos + 1
            elif c == b'"':
                in_string = False
        elif c == b'"':
            in_string = True
        elif c in b"[{":
            depth += 1
            if depth > limit:
                return depth
            deepest = max(deepest, depth)
        elif c in b"]}":
            depth -= 1
    return deepest


def routes(engine, body_timeout_s: float) -> list:
    """The API's routes. body_timeout_s: a request body must arrive within this long (view.request_timeout_s)."""

    async def control(req: dict) -> web.Response:
        reply = await asyncio.get_running_loop().run_in_executor(None, engine.control, req)
        return web.json_response(reply, status=200 if reply.get("ok") else 400)

    async def body(request: web.Request) -> dict:
        if request.content_type != "application/json":  # also what keeps other sites' forms out
            refuse(web.HTTPUnsupportedMediaType, "send a JSON body with Content-Type: application/json")
        # JSON is UTF-8 (RFC 8259 §8.1): decoded as such; a charset that says otherwise is refused, not guessed
        charset = request.charset
        if charset is not None and charset.lower().replace("-", "") != "utf8":
            refuse(web.HTTPUnsupportedMediaType, f"send the JSON body as UTF-8 (charset {charset[:40]!r} given)")
        encoding = request.headers.get("Content-Encoding", "identity")
        if encoding.lower() != "identity":  # the server never decompresses a request (see server.py)
            refuse(web.HTTPUnsupportedMediaType, f"send the JSON body uncompressed (Content-Encoding "
                                                 f"{encoding[:40]!r} given)")
        too_large = f"the body is over {MAX_BODY_BYTES} bytes"
        size = request.content_length
        if size is not None and size > MAX_BODY_BYTES:  # refused before it is read
            refuse(web.HTTPRequestEntityTooLarge, too_large, max_size=MAX_BODY_BYTES, actual_size=size)
        try:
            raw = await asyncio.wait_for(request.read(), body_timeout_s)
        except web.HTTPRequestEntityTooLarge:  # a chunked body, counted while read
            refuse(web.HTTPRequestEntityTooLarge, too_large, max_size=MAX_BODY_BYTES)
        except asyncio.TimeoutError:
            refuse(web.HTTPRequestTimeout, f"the body did not arrive within {body_timeout_s:g} s "
                                           "(view.request_timeout_s)")
        except web.RequestPayloadError as err:  # a broken chunked or compressed body
            refuse(web.HTTPBadRequest, f"the body could not be read: {str(err)[:80]}")
        if json_depth(raw, MAX_DEPTH) > MAX_DEPTH:
            refuse(web.HTTPBadRequest, f"the body nests deeper than {MAX_DEPTH} levels")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            refuse(web.HTTPBadRequest, "the body is not valid UTF-8")
        except ValueError:
            refuse(web.HTTPBadRequest, "the body is not valid JSON")
        if not isinstance(data, dict):
            refuse(web.HTTPBadRequest, "the body must be a JSON object")
        return data

    async def list_streams(request: web.Request) -> web.Response:
        return await control({"op": "list"})

    async def get_stream(request: web.Request) -> web.Response:
        reply = await asyncio.get_running_loop().run_in_executor(None, engine.control, {"op": "list"})
        sid = request.match_info["id"]
        if sid not in reply.get("streams", {}):
            return web.json_response({"ok": False, "error": f"unknown stream {sid!r}; streams: "
                                      f"{sorted(reply.get('streams', {}))}"}, status=404)
        return web.json_response({"ok": True, "stream": reply["streams"][sid]})

    async def add_stream(request: web.Request) -> web.Response:
        return await control({"op": "add_stream", "stream": await body(request)})

    async def remove_stream(request: web.Request) -> web.Response:
        return await control({"op": "remove_stream", "stream": request.match_info["id"]})

    async def add_object(request: web.Request) -> web.Response:
        data = await body(request)
        return await control({**data, "op": "add_object", "stream": request.match_info["id"]})

    async def remove_object(request: web.Request) -> web.Response:
        oid = request.match_info["oid"]
        # ASCII digits only: str.isdigit() is True for "²" and "٣", which int() refuses or reads as 3
        if not (oid.isascii() and oid.isdigit()):
            refuse(web.HTTPBadRequest, f"object id {oid[:40]!r} is not a number")
        if len(oid) > MAX_OID_DIGITS:
            refuse(web.HTTPBadRequest, f"object id {oid[:40]!r} is out of range (0 <= id < 2**31)")
        return await control({"op": "remove_object", "stream": request.match_info["id"], "id": int(oid)})

    return [web.get("/api/streams", list_streams), web.post("/api/streams", add_stream),
            web.get("/api/streams/{id}", get_stream), web.delete("/api/streams/{id}", remove_stream),
            web.post("/api/streams/{id}/objects", add_object),
            web.delete("/api/streams/{id}/objects/{oid}", remove_object)]
