"""The JSON HTTP API of the live view: the control socket's ops over HTTP, through `Engine.control`
(one implementation: the same checks, the same threads, the same replies). See server.py."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web


def routes(engine) -> list:
    async def control(req: dict) -> web.Response:
        reply = await asyncio.get_running_loop().run_in_executor(None, engine.control, req)
        return web.json_response(reply, status=200 if reply.get("ok") else 400)

    async def body(request: web.Request) -> dict:
        if request.content_type != "application/json":  # also what keeps other sites' forms out
            raise web.HTTPUnsupportedMediaType(text=json.dumps({"ok": False, "error": "send a JSON body "
                                               "with Content-Type: application/json"}), content_type="application/json")
        try:
            data = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text=json.dumps({"ok": False, "error": "the body is not valid JSON"}),
                                     content_type="application/json") from None
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(text=json.dumps({"ok": False, "error": "the body must be a JSON object"}),
                                     content_type="application/json")
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
        if not oid.isdigit():
            return web.json_response({"ok": False, "error": f"object id {oid!r} is not a number"}, status=400)
        return await control({"op": "remove_object", "stream": request.match_info["id"], "id": int(oid)})

    return [web.get("/api/streams", list_streams), web.post("/api/streams", add_stream),
            web.get("/api/streams/{id}", get_stream), web.delete("/api/streams/{id}", remove_stream),
            web.post("/api/streams/{id}/objects", add_object),
            web.delete("/api/streams/{id}/objects/{oid}", remove_object)]
