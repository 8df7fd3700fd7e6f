"""The live view's web server: aiohttp on the control plane's event loop (uvloop).

Pages (plain HTML and ES modules from `static/`, no build step, nothing fetched from a CDN):
    GET /                      every stream: a tile each
    GET /stream/{id}           one stream, larger, with its objects
    GET /login?token=...       sets the token cookie, then redirects to / (printed at start)
JSON API (the page uses it; so can scripts). Every reply is {"ok": true, ...} or {"ok": false,
"error": ...}, as the control socket's, because it is the same control path (`Engine.control`):
    GET    /api/streams                      streams with state, pools, objects
    GET    /api/streams/{id}
    POST   /api/streams                      a stream as in the config: {"id", "url", "mode", ...}
    DELETE /api/streams/{id}
    POST   /api/streams/{id}/objects         {"id": 3, "box": [x0, y0, x1, y1]} or {"id": 3, "points": [[x, y, 1], ...]}
    DELETE /api/streams/{id}/objects/{oid}
WebSocket /ws: the page sends {"watch": {stream id: size}}, size being the longer side in device
pixels it shows the stream at (an int, clamped to [64, view.max_side]; null: view.max_side), or
{"watch": [stream ids]} (each at view.max_side); again whenever what it shows changes (a stream, a
size). Each stream is encoded at the largest size its watchers ask for; a message or entry of another
shape is ignored. The server sends a text message
{"type": "state", ...} every second (every stream's state, rates, drops, latency history) and, for
each watched stream whose shown frame changed, a binary message: 4 bytes (big-endian length n),
n bytes of JSON {"stream", "seq", "pts", "t_capture", "width", "height", "results": {kind: result}},
then the JPEG. A slow page gets the newest frame when it is ready again (the ones it missed are
counted in the state's `skipped`).

Security: bound on loopback by default; any other address needs `view.token` (config check, exit 2).
With a token, every request carries it (`Authorization: Bearer`, or the cookie from the login URL).
Without one, requests must name a loopback host (a DNS-rebinding page gets 403). Changes (POST,
DELETE) need a JSON body where they have one and, when the browser sends an Origin, the same
origin: another site open in the browser cannot drive the engine. Stream URLs reach the page with
their credentials removed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import struct
import time
from collections import deque
from pathlib import Path
from typing import Optional
from urllib.parse import quote, urlsplit

import numpy as np
from aiohttp import WSMsgType, web

from streams import redact_url

from ..config import ViewConfig, _is_loopback
from ..errors import ConfigError

log = logging.getLogger("vidar.view")

STATIC = Path(__file__).parent / "static"
COOKIE = "vidar_token"
HISTORY_S = 60          # latency chart: one point a second for the last minute
STATE_EVERY_S = 1.0


class ViewServer:
    def __init__(self, engine, cfg: ViewConfig):
        self.engine, self.cfg = engine, cfg
        self.hub = engine.view
        self._runner: Optional[web.AppRunner] = None
        self._clients: set["_Client"] = set()
        self._history: dict[tuple[str, str], deque] = {}
        self._last: dict[tuple[str, str], tuple[float, int, int]] = {}
        self._state: dict = {"type": "state", "streams": {}}
        self._task: Optional[asyncio.Task] = None
        self.port: Optional[int] = None
        self.skipped = 0  # frames a slow page did not get (it got a newer one instead)

    @property
    def url(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{self.port}/"

    @property
    def login_url(self) -> Optional[str]:
        return f"{self.url}login?token={quote(self.cfg.token)}" if self.cfg.token else None

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind now (a busy port is a configuration error: exit 2)."""
        loop = asyncio.get_running_loop()
        self.hub.on_update = lambda stream: loop.call_soon_threadsafe(self._frame_ready, stream)
        from .api import routes
        app = web.Application(middlewares=[self._guard], client_max_size=64 * 1024)
        app.add_routes([web.get("/", self._page("index.html")), web.get("/stream/{id}", self._page("stream.html")),
                        web.get("/login", self._login), web.get("/ws", self._ws),
                        web.static("/static", STATIC)] + routes(self.engine))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, shutdown_timeout=1.0)
        try:
            await site.start()
        except OSError as err:
            await self._runner.cleanup()
            raise ConfigError(f"view.port: cannot serve on {self.cfg.host}:{self.cfg.port}: {err} "
                              "(set view.port to a free port, or view.enabled: false)") from None
        self.port = site._server.sockets[0].getsockname()[1]  # aiohttp has no public accessor for port 0
        self._task = asyncio.create_task(self._tick())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for c in list(self._clients):
            await c.ws.close()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- auth ------------------------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler):
        if not self.cfg.token and not _is_loopback(request.url.host or ""):
            return _deny(request, 403, f"host {request.host!r} is not a loopback name (DNS rebinding?)")
        if request.path != "/login" and self.cfg.token and not self._authorized(request):
            return _deny(request, 401, "this view needs its token: open the login URL printed at start, "
                                       "or send Authorization: Bearer <view.token>")
        # Browsers send Origin on every cross-site request that matters here, the websocket upgrade (a GET)
        # included: another site open in the same browser can neither drive the engine nor watch it.
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc != request.host:
            return _deny(request, 403, f"cross-origin request from {origin!r} refused")
        return await handler(request)

    def _authorized(self, request: web.Request) -> bool:
        sent = request.cookies.get(COOKIE, "")
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            sent = auth[7:]
        return hmac.compare_digest(sent.encode(), self.cfg.token.encode())

    async def _login(self, request: web.Request) -> web.Response:
        if not self.cfg.token:
            raise web.HTTPFound("/")
        if not hmac.compare_digest(request.query.get("token", "").encode(), self.cfg.token.encode()):
            return _deny(request, 401, "wrong or missing token")
        resp = web.HTTPFound("/")
        resp.set_cookie(COOKIE, self.cfg.token, httponly=True, samesite="Strict", path="/")
        return resp

    def _page(self, name: str):
        async def page(request: web.Request) -> web.FileResponse:
            return web.FileResponse(STATIC / name, headers={"Cache-Control": "no-store"})
        return page

    # -- websocket -------------------------------------------------------------------------------
    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=20, max_msg_size=64 * 1024)
        await ws.prepare(request)
        client = _Client(ws)
        self._clients.add(client)
        sender = asyncio.create_task(self._send_loop(client))
        try:
            await ws.send_str(json.dumps(self._state))
            async for msg in ws:
                want = parse_watch(msg.data, self.hub.side) if msg.type == WSMsgType.TEXT else None
                if want is not None:
                    self._rewatch(client, want)
        finally:
            self._clients.discard(client)
            for s, size in client.watching.items():
                self.hub.watch(s, -1, size)
            sender.cancel()
        return ws

    def _rewatch(self, client: "_Client", want: dict[str, int]) -> None:
        """The page now shows these streams at these sizes. A stream that is no longer known is let go
        even if the page still asks for it: the hub's count for it must come back to zero."""
        old = client.watching
        new = {s: n for s, n in want.items() if self.hub.known(s)}  # names of no stream hold nothing
        for s, n in list(new.items()):
            if old.get(s) == n:
                continue
            # new, or resized: the new size is counted before the old one is let go. A start the hub did
            # not count (the stream went between known() and here) is not recorded: its stop would take
            # away another page's count of the same size
            if not self.hub.watch(s, +1, n):
                if s in old:
                    new[s] = old[s]  # still counted at the old size, let go below with the others
                    continue
                del new[s]
            elif s not in old:
                client.mark(s)  # send what is on show now
        for s, n in old.items():
            if new.get(s) != n:
                self.hub.watch(s, -1, n)
        client.watching = new

    def _frame_ready(self, stream: str) -> None:
        for c in self._clients:
            if stream in c.watching and c.mark(stream):
                self.skipped += 1

    async def _send_loop(self, client: "_Client") -> None:
        try:
            while True:
                await client.wake.wait()
                client.wake.clear()
                if client.state is not None:
                    text, client.state = client.state, None
                    await client.ws.send_str(text)
                while client.dirty:
                    stream = client.dirty.pop()
                    version, frame, results = self.hub.shown(stream)
                    if frame is None or client.sent.get(stream) == version:
                        continue
                    client.sent[stream] = version
                    head = json.dumps({"stream": stream, "seq": frame.seq, "pts": frame.pts,
                                       "t_capture": frame.t_capture, "width": frame.width,
                                       "height": frame.height, "results": results}).encode()
                    await client.ws.send_bytes(struct.pack(">I", len(head)) + head + frame.jpeg)
        except (asyncio.CancelledError, ConnectionResetError):
            pass

    # -- state, once a second ---------------------------------------------------------------------
    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                # the ledgers' locks and the percentiles: off the event loop
                self._state = await loop.run_in_executor(None, self._sample)
                text = json.dumps(self._state)
                for c in list(self._clients):  # each page's own sender: a stalled page holds up nobody else
                    c.state = text
                    c.wake.set()
            except Exception:  # a sampling bug must not end the view
                log.exception("view: state sampling failed")
            await asyncio.sleep(STATE_EVERY_S)

    def _sample(self) -> dict:
        eng, now, wall = self.engine, time.monotonic(), time.time()
        described = eng.describe()
        streams = {}
        for entry in eng.streams.values():
            sid = entry.id
            if entry.state == "removing" or sid not in described:
                continue
            d = dict(described[sid])
            d["url"] = redact_url(entry.cfg.url)
            pools = {}
            for name in entry.pools:
                pools[name] = self._pool_state(name, sid, now, wall)
            d["pools"] = pools
            view = self.hub.state(sid)
            event = view.pop("event", None)
            if event is not None:
                d["event"] = {"kind": event["kind"], "reason": redact_url(str(event["reason"]))}
            runner = entry.runner
            d["reason"] = entry.reason or (runner.end_reason if runner else "")
            d["view"] = view
            streams[sid] = d
        for key in [k for k in self._history if k[1] not in streams]:
            self._history.pop(key, None)
            self._last.pop(key, None)
        return {"type": "state", "t": wall, "budget_ms": eng.cfg.budget.latency_ms, "view_fps": self.cfg.fps,
                "skipped": self.skipped,
                "streams": streams}

    def _pool_state(self, pool: str, sid: str, now: float, wall: float) -> dict:
        s = self.engine.pools[pool].acct.snapshot(sid)
        t0, ing0, pub0 = self._last.get((pool, sid), (now, s.ingested, s.published))
        dt = now - t0
        self._last[(pool, sid)] = (now, s.ingested, s.published)
        p50 = None if s.p50_ms != s.p50_ms else round(s.p50_ms, 2)  # NaN: nothing published yet
        p99 = None if s.p99_ms != s.p99_ms else round(s.p99_ms, 2)
        # the chart: percentiles of the results published since the last point (None: none were)
        recent = self.engine.pools[pool].acct.recent_latencies(sid, s.published - pub0) if dt > 0 else []
        q = np.percentile(recent, [50, 99]).round(2).tolist() if recent else [None, None]
        hist = self._history.setdefault((pool, sid), deque(maxlen=HISTORY_S))
        hist.append([round(wall, 2), *q])
        return {"fps_in": round((s.ingested - ing0) / dt, 2) if dt > 0 else None,
                "fps_out": round((s.published - pub0) / dt, 2) if dt > 0 else None,
                "published": s.published, "dropped": s.dropped, "failed": s.failed, "in_flight": s.in_flight,
                "p50_ms": p50, "p99_ms": p99, "history": list(hist)}


def parse_watch(text: str, side) -> Optional[dict[str, int]]:
    """A page's watch message -> {stream: longer side}, sizes through `side` (the hub's clamp; None
    for view.max_side). None: not a watch message (ignored). Entries of another shape are left out."""
    try:
        want = json.loads(text).get("watch", [])
    except (ValueError, AttributeError):
        return None
    if isinstance(want, list):
        return {s: side(None) for s in want if isinstance(s, str)}
    if isinstance(want, dict):  # JSON keys are strings; bool is an int to Python, not a size
        return {s: side(n) for s, n in want.items()
                if n is None or (isinstance(n, int) and not isinstance(n, bool))}
    return None


class _Client:
    def __init__(self, ws: web.WebSocketResponse):
        self.ws = ws
        self.watching: dict[str, int] = {}  # stream -> the size this page asked for (clamped)
        self.dirty: set[str] = set()
        self.sent: dict[str, int] = {}
        self.state: Optional[str] = None  # the newest state message not sent yet
        self.wake = asyncio.Event()

    def mark(self, stream: str) -> bool:
        """Queue the stream's shown frame for this page; True if an unsent one was replaced."""
        replaced = stream in self.dirty
        self.dirty.add(stream)
        self.wake.set()
        return replaced


def _deny(request: web.Request, status: int, why: str) -> web.Response:
    if request.path.startswith("/api/") or request.path == "/ws":
        return web.json_response({"ok": False, "error": why}, status=status)
    return web.Response(status=status, text=f"vidar live view: {why}\n", content_type="text/plain")


class ViewThread:
    """The view server on its own event loop thread, for programs that drive an `Engine` themselves
    (`vidar run` serves it on the control plane's loop instead). Raises ConfigError like `start`."""

    def __init__(self, engine):
        import threading

        self.loop = asyncio.new_event_loop()
        self.server = ViewServer(engine, engine.cfg.view)
        self._error: Optional[BaseException] = None
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.server.start())
            except BaseException as err:  # re-raised in the caller's thread
                self._error = err
            ready.set()
            if self._error is None:
                self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="view-server", daemon=True)
        self._thread.start()
        ready.wait(30)
        if self._error is not None:
            raise self._error
        self.url = self.server.url

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
