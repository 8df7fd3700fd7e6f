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
import os
import struct
import time
from collections import deque
from pathlib import Path
from typing import Optional
from urllib.parse import quote, urlsplit

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web

from streams import redact_url

from engine.config import ViewConfig
from engine.security.binds import is_loopback_host
from engine.errors import BindError
from engine.security.ports import MovedPort, in_use, left_default
from engine.executor.supervise import SupervisedTask

log = logging.getLogger("vidar.view")

STATIC = Path(__file__).parent / "static"
COOKIE = "vidar_token"
HISTORY_S = 60          # latency chart: one point a second for the last minute
STATE_EVERY_S = 1.0
REPORT_EVERY_S = 10.0   # connections refused or timed out, internal errors: one log line at most this often
LINGER_S = 2.0          # after a reply, an unread request body is read and dropped this long at most


class ViewServer:
    def __init__(self, engine, cfg: ViewConfig):
        self.engine, self.cfg = engine, cfg
        self.hub = engine.view
        self._runner: Optional[web.AppRunner] = None
        self._clients: set["_Client"] = set()
        self._history: dict[tuple[str, str], deque] = {}
        self._last: dict[tuple[str, str], tuple[float, int, int]] = {}
        self._state: dict = {"type": "state", "streams": {}}
        self._task: Optional[SupervisedTask] = None
        self.port: Optional[int] = None
        self.moved: Optional[MovedPort] = None  # view.port's default was taken: served on a free port instead
        self.skipped = 0  # frames a slow page did not get (it got a newer one instead)
        self._gate: Optional[_Gate] = None
        self._internal_errors = 0
        self._internal_seen: set[str] = set()  # (error type, route) logged with its traceback once
        self.ws_refused = 0  # websocket messages refused (bad JSON, too deep, not UTF-8): the page closed, 1007
        self._reported = (0.0, (0, 0, 0, 0))  # (when, counts) of the last aggregate log line
        self._http_log = _HttpLog()

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
        from engine.view.api import MAX_BODY_BYTES, routes
        timeout_s = self.cfg.request_timeout_s
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY_BYTES)
        app.add_routes([web.get("/", self._page("index.html")), web.get("/stream/{id}", self._page("stream.html")),
                        web.get("/login", self._login), web.get("/ws", self._ws),
                        web.static("/static", STATIC)] + routes(self.engine, timeout_s))
        # aiohttp's own bounds: keepalive_timeout closes a connection that sends no next request within
        # timeout_s of its last reply (of its opening too, from aiohttp 3.14: see _Gate); at most 64
        # header lines of 8 KB each buffered per connection; an unread body is drained LINGER_S at most.
        # Request bodies are never decompressed (the API refuses a Content-Encoding): a compressed body
        # that is not what it says would otherwise fail again while aiohttp drains it after the reply.
        # aiohttp's log of requests it could not parse or finish goes to _HttpLog: counted, not a
        # traceback per malformed request.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=timeout_s,
                                     lingering_time=LINGER_S, max_line_size=8190, max_field_size=8190,
                                     max_headers=64, auto_decompress=False, logger=self._http_log)
        await self._runner.setup()
        cap = _connection_cap(self.cfg.max_connections)
        self._gate = _Gate(self._runner.server, cap, timeout_s)
        # The listen backlog stays aiohttp's 128: it bounds the connections one turn of the loop accepts
        # before the ones over the cap are closed (a brief burst of descriptors), and a smaller one made
        # the kernel drop SYNs in a burst of clients (a 1 s retransmit for each, well-behaved ones too)
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, shutdown_timeout=1.0)
        try:
            try:
                await site.start()
            except OSError as err:  # the default port, left unset and taken: one the OS picks (security/ports.py)
                if not (in_use(err) and left_default(self.cfg, "port")):
                    raise
                await site.stop()
                site = web.TCPSite(self._runner, self.cfg.host, 0, shutdown_timeout=1.0)
                await site.start()
        except OSError as err:
            await self._runner.cleanup()
            raise BindError("view.port", f"{self.cfg.host}:{self.cfg.port}",
                            f"view.port: cannot serve on {self.cfg.host}:{self.cfg.port}: {err} (another vidar "
                            "running? set view.port to a free port, or leave it unset: its default moves to a free "
                            "port when taken; or view.enabled: false)") from None
        self.port = site._server.sockets[0].getsockname()[1]  # aiohttp has no public accessor for port 0
        if self.port != self.cfg.port and self.cfg.port != 0:
            host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
            self.moved = MovedPort("view.port", f"http://{host}:{self.cfg.port}/", self.url)
            log.warning("%s", self.moved.note())
        self._task = SupervisedTask("live view state", self._tick)

    def health(self) -> Optional[str]:
        """The state ticker, restarted if it ended (see engine/supervise.py); the runtime calls this."""
        return self._task.health() if self._task is not None else None

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
        """Every request: the checks, then its handler. Whatever goes wrong becomes a reply (in the API's
        JSON on /api/ and /ws, aiohttp's own refusals included), never a traceback."""
        if self._gate is not None:
            self._gate.requested(request.protocol)  # its headers are in: the connection's deadline is met
        try:
            denied = self._check(request)
            return denied if denied is not None else await handler(request)
        except web.HTTPException as exc:  # a 404, a 405, aiohttp's 413, a websocket handshake's 400 ...
            if exc.status < 400 or not _is_api(request) or exc.content_type == "application/json":
                raise
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return _deny(request, exc.status, exc.text or exc.reason, headers=allow)
        except ConnectionError:  # the client went away: aiohttp ends the connection
            raise
        except Exception as err:
            return self._internal_error(request, err)

    def _check(self, request: web.Request) -> Optional[web.Response]:
        """The refusal for a request that may not go on; None if it may."""
        if not self.cfg.token:
            try:
                host = request.url.host or ""
            except ValueError:  # UnicodeError too: bytes no host name has (yarl IDNA-encodes it)
                return _deny(request, 400, f"the Host header {request.host[:80]!r} is not a host name")
            if not is_loopback_host(host):
                return _deny(request, 403, f"host {request.host[:80]!r} is not a loopback name (DNS rebinding?)")
        if request.path != "/login" and self.cfg.token and not self._authorized(request):
            return _deny(request, 401, "this view needs its token: open the login URL printed at start, "
                                       "or send Authorization: Bearer <view.token>")
        # Browsers send Origin on every cross-site request that matters here, the websocket upgrade (a GET)
        # included: another site open in the same browser can neither drive the engine nor watch it.
        origin = request.headers.get("Origin")
        if origin is not None and _netloc(origin) != request.host:
            return _deny(request, 403, f"cross-origin request from {origin[:80]!r} refused")
        return None

    def _authorized(self, request: web.Request) -> bool:
        sent = request.cookies.get(COOKIE, "")
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            sent = auth[7:]
        # header bytes that are not UTF-8 reach us as lone surrogates (surrogateescape): compared as the
        # bytes they came as, never an encoding error
        return hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), self.cfg.token.encode())

    def _internal_error(self, request: web.Request, err: Exception) -> web.Response:
        """A bug met by a request: a 500 that names nothing of the engine's insides; logged with its
        traceback the first time per (error type, route), counted in the aggregate line after that."""
        self._internal_errors += 1
        resource = request.match_info.route.resource
        self._log_once(f"{type(err).__name__} in {request.method} {resource.canonical if resource else '?'}", err)
        return _deny(request, 500, "internal error (the engine's log has the details)")

    def _log_once(self, key: str, err: Exception) -> None:
        """Log a bug with its traceback the first time it is met (per error type and route); later ones
        are counted (internal_errors), not logged."""
        if key not in self._internal_seen and len(self._internal_seen) < 100:
            self._internal_seen.add(key)
            log.error("view: internal error: %s (logged once; later ones are counted)", key, exc_info=err)

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
        """Once upgraded, nothing but websocket frames may go on this connection: whatever goes wrong
        closes it with a close code (1007 for a message it cannot take, 1011 for a bug), never an HTTP
        reply (the middleware's 500 would be written into the websocket's byte stream)."""
        ws = web.WebSocketResponse(heartbeat=20, max_msg_size=64 * 1024)
        await ws.prepare(request)
        client = _Client(ws)
        self._clients.add(client)
        sender = asyncio.create_task(self._send_loop(client))
        try:
            await ws.send_str(json.dumps(self._state))
            async for msg in ws:
                try:
                    want = parse_watch(msg.data, self.hub.side) if msg.type == WSMsgType.TEXT else None
                except BadMessage as err:
                    self.ws_refused += 1
                    if "ws_refused" not in self._internal_seen:  # one line: a client cannot flood the log
                        self._internal_seen.add("ws_refused")
                        log.warning("view: a websocket message was refused and its socket closed with 1007: %s "
                                    "(logged once; later ones are counted: ws_refused)", err)
                    await ws.close(code=WSCloseCode.INVALID_TEXT, message=str(err)[:120].encode("ascii", "replace"))
                    break
                if want is not None:
                    self._rewatch(client, want)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as err:
            self._internal_errors += 1
            self._log_once(f"{type(err).__name__} in the websocket", err)
            await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error (the engine's log has the details)")
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
            self._report()
            await asyncio.sleep(STATE_EVERY_S)

    def connection_counts(self) -> dict[str, int]:
        """Connections: open now, the cap, and since start refused at the cap or closed for want of a
        request within view.request_timeout_s; since start, internal errors (500s) and requests aiohttp
        could not parse or finish (its 400s for bad framing, clients gone mid-request)."""
        g = self._gate
        return {"open": g.open if g else 0, "cap": g.max_connections if g else 0, "refused": g.refused if g else 0,
                "timed_out": g.timed_out if g else 0, "internal_errors": self._internal_errors,
                "http_errors": self._http_log.count}

    def _report(self) -> None:
        """Closed connections and internal errors in aggregate: a line at most every REPORT_EVERY_S."""
        c = self.connection_counts()
        counts, now = (c["refused"], c["timed_out"], c["internal_errors"], c["http_errors"]), time.monotonic()
        (then, before) = self._reported
        if counts == before or now - then < REPORT_EVERY_S:
            return
        refused, timed_out, errors, http_errors = (a - b for a, b in zip(counts, before))
        self._reported = (now, counts)
        (log.warning if refused or errors else log.info)(
            "view: since the last report: %d connections refused at the cap of %d (view.max_connections), "
            "%d closed without a request within %g s (view.request_timeout_s), %d internal errors, "
            "%d requests aiohttp could not parse or finish (last: %s)", refused, c["cap"], timed_out,
            self.cfg.request_timeout_s, errors, http_errors, self._http_log.last or "none")

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
            ingest = entry.ingest
            d["reason"] = redact_url(entry.reason or (ingest.end_reason if ingest else ""))
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


class BadMessage(ValueError):
    """A websocket message the view will not read: the page's websocket is closed with 1007."""


def parse_watch(text: str, side) -> Optional[dict[str, int]]:
    """A page's watch message -> {stream: longer side}, sizes through `side` (the hub's clamp; None
    for view.max_side). None: not a watch message (ignored). Entries of another shape are left out.
    BadMessage: JSON nested deeper than the API allows (json.loads recurses: RecursionError), or
    text that is not UTF-8 (see request_fields.text_error)."""
    from engine.util.request_fields import text_error
    from engine.view.api import MAX_DEPTH, json_depth
    raw = text.encode("utf-8", "surrogatepass")
    if json_depth(raw, MAX_DEPTH) > MAX_DEPTH:
        raise BadMessage(f"the message nests deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(text)
    except ValueError:
        return None
    bad_text = text_error(data)
    if bad_text is not None:
        raise BadMessage(bad_text)
    want = data.get("watch", []) if isinstance(data, dict) else None
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


def _is_api(request: web.Request) -> bool:
    return request.path.startswith("/api/") or request.path == "/ws"


def _deny(request: web.Request, status: int, why: str, headers: Optional[dict] = None) -> web.Response:
    if _is_api(request):
        return web.json_response({"ok": False, "error": why}, status=status, headers=headers)
    return web.Response(status=status, text=f"vidar live view: {why}\n", content_type="text/plain", headers=headers)


def _netloc(url: str) -> Optional[str]:
    try:
        return urlsplit(url).netloc
    except ValueError:  # "http://[": not a URL, so no origin this view has
        return None


def _connection_cap(configured: int) -> int:
    """view.max_connections, lowered to half the file descriptors the process has free now (its soft
    RLIMIT_NOFILE less those open): slow clients can never take the descriptors the control socket, the
    publisher and the streams need. Where open descriptors cannot be counted: as configured."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        used = len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))
    except (ImportError, OSError):
        return configured
    if soft == resource.RLIM_INFINITY or (soft - used) // 2 >= configured:
        return configured
    cap = max(1, (soft - used) // 2)
    log.warning("view: at most %d connections, not view.max_connections=%d: the file descriptor limit "
                "(RLIMIT_NOFILE) is %d and %d are open", cap, configured, soft, used)
    return cap


class _HttpLog(logging.LoggerAdapter):
    """The logger aiohttp's connection handlers write to: a line with a traceback for each request it
    could not parse ("Error handling request") or finish (a broken body found while draining it). Those
    are counted here, the last one named, and reported in the view's aggregate line: a client sending
    garbage cannot flood the log. Debug lines pass through to vidar.view.http."""

    def __init__(self):
        super().__init__(logging.getLogger("vidar.view.http"), {})
        self.count = 0
        self.last = ""

    def log(self, level, msg, *args, exc_info=None, **kwargs) -> None:
        if level < logging.WARNING:
            super().log(level, msg, *args, exc_info=exc_info, **kwargs)
            return
        self.count += 1
        err = exc_info if isinstance(exc_info, BaseException) else None
        self.last = f"{type(err).__name__}: {' '.join(str(err).split())[:80]}" if err else str(msg)[:80]


class _Gate:
    """How many connections the view holds, and how long one may hold its slot without a request.

    Hand-written: aiohttp has no connection cap, and no request-header timeout as such. Its
    keepalive_timeout (view.request_timeout_s) closes a connection that has not sent a complete next
    request within that time of its last reply, and, from aiohttp 3.14 on, of its opening; the project
    allows older aiohttp, so the deadline for a first request is kept here too. Both sit on the
    low-level web.Server's connection_made / connection_lost, which every connection's RequestHandler
    calls as it opens and closes. A connection over the cap is closed at once (a browser retries), and
    counted: slow or half-open clients could otherwise hold every file descriptor of the process."""

    def __init__(self, server: web.Server, max_connections: int, timeout_s: float):
        self.max_connections, self.timeout_s = max_connections, timeout_s
        self._open: dict = {}  # RequestHandler -> its first-request deadline (None once a request came)
        self.refused = 0       # connections closed at once: the cap was reached
        self.timed_out = 0     # connections closed: no complete request header within timeout_s of opening
        self._made, self._lost = server.connection_made, server.connection_lost
        server.connection_made, server.connection_lost = self._connection_made, self._connection_lost

    @property
    def open(self) -> int:
        return len(self._open)

    def requested(self, handler) -> None:
        """A request's headers arrived on this connection (the middleware says so)."""
        deadline = self._open.get(handler)
        if deadline is not None:
            deadline.cancel()
            self._open[handler] = None

    def _connection_made(self, handler, transport) -> None:
        if len(self._open) >= self.max_connections:
            self.refused += 1
            # closed on the next turn of the loop: closed now, connection_lost would run before the
            # handler's start() task on Python 3.11 (tasks not started eagerly) and fail its assertion
            asyncio.get_running_loop().call_soon(handler.force_close)
            return
        self._open[handler] = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, handler)
        self._made(handler, transport)

    def _expire(self, handler) -> None:
        if self._open.get(handler) is not None:
            self._open[handler] = None
            self.timed_out += 1
            handler.force_close()

    def _connection_lost(self, handler, exc: Optional[BaseException] = None) -> None:
        deadline = self._open.pop(handler, None)
        if deadline is not None:
            deadline.cancel()
        self._lost(handler, exc)


class ViewThread:
    """The view server on its own event loop thread, for programs that drive an `Engine` themselves
    (`vidar run` serves it on the control plane's loop instead). Raises ConfigError like `start`."""

    def __init__(self, engine):
        import threading

        self.loop = asyncio.new_event_loop()
        self.server = ViewServer(engine, engine.cfg.view)
        self._error: Optional[BaseException] = None
        self.dead: Optional[str] = None  # why the view's state task could not be kept running
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.server.start())
            except BaseException as err:  # re-raised in the caller's thread
                self._error = err
            ready.set()
            if self._error is None:
                self.loop.call_soon(self._supervise)
                self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="view-server", daemon=True)
        self._thread.start()
        ready.wait(30)
        if self._error is not None:
            raise self._error
        self.url = self.server.url

    def _supervise(self) -> None:
        """As `vidar run`'s loop does: the state task restarted when it ends; when it keeps crashing, said
        loudly (the program that drives the engine decides what follows: `dead` tells it)."""
        why = self.server.health()
        if why and self.dead is None:
            self.dead = why
            log.error("live view: %s", why)
        if self.dead is None:
            self.loop.call_later(0.5, self._supervise)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
