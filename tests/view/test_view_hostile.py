"""The live view and the control socket against hostile clients (issue 21, items 6 and 7): every bad
request gets a 4xx in the API's format, never a 500 or a traceback; a bug is a 500 that says nothing of
the engine's insides; slow or half-open connections are closed at view.request_timeout_s, the view holds
at most view.max_connections, and neither the view nor the control socket stops answering, even under a
low file descriptor limit. Requests go out as raw bytes: http.client refuses to send most of them."""

import asyncio
import gzip
import json
import logging
import resource
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import time

import msgpack
import pytest
import yaml
import zmq

from engine.control.control_socket import request
from engine.core.engine import Engine
from engine.view.server import REPORT_EVERY_S, ViewThread
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.engines import engine_config
from tests.support.net import free_port

pytestmark = pytest.mark.timeout(120)

TOKEN = "Q7vX2mK9pL4wR8zT3nB6yF1c"
AUTH = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"


def _view(**view):
    cfg = engine_config([{"id": "cam1", "url": "synthetic://shapes?size=96x64&fps=30"}],
                        f"tcp://127.0.0.1:{free_port()}", budget={"latency_ms": 2000},
                        view={"enabled": True, "port": 0, **view})
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    return eng, ViewThread(eng)


@pytest.fixture(scope="module")
def views():
    """One view without a token (loopback names only), one with: {"open": (eng, view), "token": ...}."""
    made = {"open": _view(request_timeout_s=2.0), "token": _view(token=TOKEN)}
    yield made
    for eng, view in made.values():
        view.close()
        eng.stop()


def exchange(port: int, data: bytes, timeout: float = 15.0) -> tuple[int, dict, bytes]:
    """Send `data` as it is, read the reply until the server closes: (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):  # refused before the whole body was sent
            pass
        reply = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def http_request(method: str, path: str, headers: bytes = b"", body: bytes = b"", *, host: bytes = b"127.0.0.1",
                 auth: bool = True, length: bool = True) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\n".encode() + b"Host: " + host + b"\r\nConnection: close\r\n"
    head += (AUTH if auth else b"") + headers
    if body and length:
        head += b"Content-Length: %d\r\n" % len(body)
    return head + b"\r\n" + body


def post(body: bytes, ctype: bytes = b"application/json", headers: bytes = b"", length: bool = True) -> bytes:
    return http_request("POST", "/api/streams", b"Content-Type: " + ctype + b"\r\n" + headers, body, length=length)


def _chunked(body: bytes, size: int = 65536) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


def _nested(depth: int) -> bytes:
    return json.dumps({"id": "cam9", "url": "synthetic://shapes", "pad": json.loads("[" * (depth - 1) + "]" * (depth - 1))}).encode()


# view: which fixture view; then the raw request, the status and a piece of the error it must carry
CASES = [
    # issue 21, item 6: each of these was a 500 with a traceback
    ("30k-brackets", "open", post(b"[" * 30_000), 400, "nests deeper than 64 levels"),
    ("objects-nested-10k", "open", post(b'{"a":' * 10_000), 400, "nests deeper than 64 levels"),
    ("charset-bogus", "open", post(b'{"id": "x"}', b"application/json; charset=bogus"), 415, "charset 'bogus' given"),
    ("object-id-superscript-two", "open", http_request("DELETE", "/api/streams/cam1/objects/%C2%B2"), 400,
     "is not a number"),
    ("bearer-not-utf8", "token", http_request("GET", "/api/streams", b"Authorization: Bearer \xff\xfe\r\n", auth=False),
     401, "this view needs its token"),
    ("cookie-not-utf8", "token", http_request("GET", "/api/streams", b"Cookie: vidar_token=\xff\xfe\r\n", auth=False),
     401, "this view needs its token"),
    # neighbours
    ("object-id-arabic-three", "open", http_request("DELETE", "/api/streams/cam1/objects/%D9%A3"), 400, "is not a number"),
    ("object-id-11-digits", "open", http_request("DELETE", "/api/streams/cam1/objects/12345678901"), 400, "out of range"),
    ("host-not-utf8", "open", http_request("GET", "/api/streams", host=b"\xff\xfe"), 400, "is not a host name"),
    ("origin-not-a-url", "open", http_request("GET", "/api/streams", b"Origin: http://[\r\n"), 403, "cross-origin"),
    ("login-token-not-utf8", "token", http_request("GET", "/login?token=%FF%FE", auth=False), 401, "wrong or missing token"),
    ("body-not-utf8", "open", post(b'{"id": "\xff\xfe"}'), 400, "not valid UTF-8"),
    ("body-empty", "open", post(b""), 400, "not valid JSON"),
    ("body-an-array", "open", post(b"[1, 2]"), 400, "must be a JSON object"),
    ("body-1MB", "open", post(b"x" * 1_000_000), 413, "the body is over 65536 bytes"),
    ("body-1MB-chunked", "open", post(_chunked(b" " * 1_000_000), headers=b"Transfer-Encoding: chunked\r\n",
                                      length=False),
     413, "the body is over 65536 bytes"),
    ("body-gzip-bomb", "open", post(gzip.compress(b" " * 2_000_000), headers=b"Content-Encoding: gzip\r\n"), 415,
     "send the JSON body uncompressed"),
    ("page-with-a-broken-gzip-body", "open", http_request("GET", "/", b"Content-Encoding: gzip\r\n", b"not gzip"), 200,
     "live view"),  # never decompressed, so never an error while aiohttp drains it after the reply
    ("nesting-at-the-limit", "open", post(_nested(64)), 400, "stream.pad: Extra inputs"),  # parsed: the engine's check
    ("nesting-one-over", "open", post(_nested(65)), 400, "nests deeper than 64 levels"),
    ("unknown-api-path", "open", http_request("GET", "/api/nope"), 404, "Not Found"),
    ("wrong-method", "open", http_request("PUT", "/api/streams"), 405, "Method Not Allowed"),
    ("websocket-without-upgrade", "open", http_request("GET", "/ws"), 400, "Upgrade"),
]


@pytest.mark.parametrize("which, data, status, error", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_request_gets_a_4xx_in_the_api_format_never_a_500(views, caplog, which, data, status, error):
    eng, view = views[which]
    caplog.set_level(logging.WARNING)
    http_errors = view.server.connection_counts()["http_errors"]
    got, headers, body = exchange(view.server.port, data)
    assert got == status, (got, body[:300])
    path = data.split(b" ", 2)[1]
    if path.startswith(b"/api/") or path == b"/ws":
        assert headers["content-type"].startswith("application/json"), headers
        reply = json.loads(body)
        assert reply["ok"] is False and error in reply["error"], reply
    elif status >= 400:  # a page's refusal: the plain-text format
        assert body.startswith(b"vidar live view: ") and error.encode() in body, body
    else:
        assert error.encode() in body
    assert b"Traceback" not in body and b'File "' not in body
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert view.server.connection_counts()["http_errors"] == http_errors  # nor one aiohttp met (and counted)
    assert eng.live_streams() == ["cam1"]


def test_a_bug_is_a_500_without_details_logged_once(views, caplog, monkeypatch):
    eng, view = views["open"]

    def broken(req):
        raise RuntimeError("secret-internal-detail at /srv/vidar/engine.py")
    monkeypatch.setattr(eng, "control", broken)
    caplog.set_level(logging.INFO)
    before = view.server.connection_counts()["internal_errors"]
    for _ in range(3):
        got, headers, body = exchange(view.server.port, http_request("GET", "/api/streams"))
        assert got == 500 and headers["content-type"].startswith("application/json")
        reply = json.loads(body)
        assert reply["ok"] is False and "internal error" in reply["error"], reply
        assert b"secret" not in body and b"RuntimeError" not in body and b"Traceback" not in body
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].name == "vidar.view" and errors[0].exc_info, \
        [(r.name, r.getMessage()) for r in errors]
    assert view.server.connection_counts()["internal_errors"] - before == 3


async def _ws_until_closed(port: int, message: str, timeout: float = 15.0):
    """Open the view's websocket, send one message, read until the server closes: (close code, reason)."""
    import aiohttp
    async with aiohttp.ClientSession() as s, s.ws_connect(f"http://127.0.0.1:{port}/ws") as ws:
        await ws.send_str(message)
        end = time.monotonic() + timeout
        while time.monotonic() < end:  # state messages (text) come every second until then
            try:
                m = await ws.receive(timeout=end - time.monotonic())
            except asyncio.TimeoutError:
                break
            if m.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                return ws.close_code, m.extra
        return None, "still open"


async def _ws_gets_a_frame(ws, stream: str, timeout: float = 15.0) -> bool:
    import aiohttp
    await ws.send_str(json.dumps({"watch": [stream]}))
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = await ws.receive(timeout=end - time.monotonic())
        if m.type == aiohttp.WSMsgType.BINARY:
            return True
        if m.type != aiohttp.WSMsgType.TEXT:
            return False
    return False


# issue 31 item 7: 40 KB (under the 64 KB cap) of nesting raised RecursionError and wrote an HTTP 500 onto the
# upgraded socket; a lone surrogate (item 5) is text the view does not take either
WS_BAD = [("nested-20k", "[" * 20_000 + "]" * 20_000, "nests deeper than 64 levels"),
          ("nested-objects", '{"watch":' * 5_000 + "1" + "}" * 5_000, "nests deeper than 64 levels"),
          ("lone-surrogate", '{"watch": ["\\ud800"]}', "watch.0: not valid UTF-8")]


@pytest.mark.parametrize("message, reason", [c[1:] for c in WS_BAD], ids=[c[0] for c in WS_BAD])
def test_a_websocket_message_it_cannot_take_closes_that_socket_with_1007(views, caplog, message, reason):
    """Closed with 1007 (invalid data) and the reason, counted, logged once at most; a page connected
    meanwhile keeps getting frames."""
    import aiohttp
    eng, view = views["open"]
    caplog.set_level(logging.WARNING)
    before = view.server.ws_refused

    async def run():
        async with aiohttp.ClientSession() as s, s.ws_connect(view.server.url + "ws") as other:
            code, why = await _ws_until_closed(view.server.port, message)
            return code, why, await _ws_gets_a_frame(other, "cam1")
    code, why, other_served = asyncio.run(run())
    assert (code, other_served) == (1007, True), (code, why)
    assert reason in why, why
    assert view.server.ws_refused - before == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert len([r for r in caplog.records if "websocket message was refused" in r.getMessage()]) <= 1


def test_a_bug_after_the_websocket_upgrade_closes_it_with_1011_logged_once(views, caplog, monkeypatch):
    """Never an HTTP reply on an upgraded socket: the middleware's 500 was written into the websocket."""
    eng, view = views["open"]

    def broken(client, want):
        raise RuntimeError("secret-internal-detail")
    monkeypatch.setattr(view.server, "_rewatch", broken)
    caplog.set_level(logging.INFO)
    before = view.server.connection_counts()["internal_errors"]
    for _ in range(3):
        code, why = asyncio.run(_ws_until_closed(view.server.port, json.dumps({"watch": ["cam1"]})))
        assert code == 1011 and "internal error" in why and "secret" not in why, (code, why)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info and "in the websocket" in errors[0].getMessage(), \
        [(r.name, r.getMessage()) for r in errors]
    assert view.server.connection_counts()["internal_errors"] - before == 3


def test_malformed_http_is_a_400_counted_not_a_traceback_per_request(views, caplog):
    """Framing aiohttp's parser refuses (a bad chunk size) never reaches the API: aiohttp's own 400, in
    plain text; its log line with a traceback per request is counted instead (the aggregate line)."""
    eng, view = views["open"]
    caplog.set_level(logging.DEBUG, logger="vidar.view.http")
    before = view.server.connection_counts()["http_errors"]
    bad = post(b"5\r\n{\"a\":\r\nzz\r\n0\r\n\r\n", headers=b"Transfer-Encoding: chunked\r\n", length=False)
    for _ in range(5):
        status, _, body = exchange(view.server.port, bad)
        assert status == 400 and b"chunk size" in body and b"Traceback" not in body, body
    assert view.server.connection_counts()["http_errors"] - before == 5
    assert view.server._http_log.last.startswith("BadHttpMessage: 400")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- slow and half-open clients ---------------------------------------------------------------------------
PARTIAL = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Never-Ends: "


class Slow:
    """Clients that opened a connection, sent part of their headers and never finish. `closed` maps each
    socket to when (monotonic) the server closed it; `tick()` trickles a byte to the ones that do (a
    slowloris keeps its connection busy, which must not extend it)."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.opened: dict[socket.socket, float] = {}
        self.closed: dict[socket.socket, float] = {}
        self.trickle: list[socket.socket] = []

    def open(self, port: int, n: int, trickle: bool = False) -> list[socket.socket]:
        socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            self.opened[s] = time.monotonic()
            try:
                s.sendall(PARTIAL)
            except OSError:  # refused at once: closed already
                pass
            s.setblocking(False)
            self.sel.register(s, selectors.EVENT_READ)
            socks.append(s)
            if trickle:
                self.trickle.append(s)
            self.poll(0)  # a connection refused at once is seen closed at once
            if len(socks) % 16 == 0:
                # let the server's thread accept: this loop can fill the listen queue faster than another
                # Python thread gets the GIL, and a full queue costs a connect a 1 s SYN retransmit, during
                # which no close is seen (the times measured here would be late)
                time.sleep(0.005)
        return socks

    def poll(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while len(self.closed) < len(self.opened):
            for key, _ in self.sel.select(min(0.05, max(0.0, end - time.monotonic()))):
                try:
                    data = key.fileobj.recv(4096)
                except OSError:
                    data = b""
                if not data:  # EOF or reset: the server closed it
                    self.closed[key.fileobj] = time.monotonic()
                    self.sel.unregister(key.fileobj)
            for s in self.trickle:
                if s not in self.closed:
                    try:
                        s.send(b"x")
                    except OSError:
                        pass
            if time.monotonic() >= end:
                break

    def lived(self, socks) -> list[float]:
        return [self.closed[s] - self.opened[s] for s in socks if s in self.closed]

    def close(self) -> None:
        for s in self.opened:
            s.close()


def _round_trip_s(port: int, n: int = 5) -> float:
    """The median time of a well-formed request: the unit the slack of the timing checks is made of."""
    times = []
    for _ in range(n):
        t = time.monotonic()
        assert exchange(port, http_request("GET", "/api/streams"))[0] == 200
        times.append(time.monotonic() - t)
    return statistics.median(times)


def test_half_open_connections_are_closed_at_the_timeout_and_the_cap_holds(caplog):
    """A token view (the slow clients never authenticate), cap 16, timeout 3 s: clients under the cap are
    held until their timeout, trickling a byte or not, while a well-formed request answers at once; beyond
    the cap connections are closed at once and counted; once the slow ones are gone the view answers
    again; a keep-alive connection idle after its reply is closed at the same timeout; one log line."""
    cap, timeout_s = 16, 3.0
    caplog.set_level(logging.INFO, logger="vidar.view")
    eng, view = _view(token=TOKEN, max_connections=cap, request_timeout_s=timeout_s)
    port, slow = view.server.port, Slow()
    try:
        # timer and scheduling delays on this machine, measured; under a third of the timeout, so that the
        # held clients are still open after the waits of `slack` below
        slack = min(timeout_s / 3, max(0.5, 20 * _round_trip_s(port)))
        assert wait_for(lambda: view.server.connection_counts()["open"] == 0, 5)
        held = slow.open(port, cap - 4) + slow.open(port, 2, trickle=True)
        slow.poll(0.2)
        assert not slow.closed and view.server.connection_counts()["open"] == cap - 2
        t = time.monotonic()
        assert exchange(port, http_request("GET", "/api/streams"))[0] == 200  # under the cap: served at once
        assert time.monotonic() - t < slack
        assert wait_for(lambda: view.server.connection_counts()["open"] == cap - 2, 2)
        held += slow.open(port, 2)  # at the cap now
        refused = slow.open(port, 200)  # beyond it
        slow.poll(slack)
        assert all(s in slow.closed for s in refused) and max(slow.lived(refused)) < slack
        assert not any(s in slow.closed for s in held)
        counts = view.server.connection_counts()
        assert counts["open"] == cap and counts["refused"] == 200, counts
        slow.poll(timeout_s + slack)
        lived = slow.lived(held)
        assert len(lived) == cap and timeout_s - 0.05 <= min(lived) and max(lived) <= timeout_s + slack, lived
        assert view.server.connection_counts()["timed_out"] == cap
        assert exchange(port, http_request("GET", "/api/streams"))[0] == 200  # the slots are free again
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # keep-alive, then idle
            s.sendall(http_request("GET", "/api/streams").replace(b"Connection: close", b"Connection: keep-alive"))
            t, data = time.monotonic(), b""
            while (chunk := s.recv(65536)):
                data += chunk
            assert data.startswith(b"HTTP/1.1 200") and timeout_s - 0.05 <= time.monotonic() - t <= timeout_s + slack
        lines = [r.getMessage() for r in caplog.records if "at the cap of 16" in r.getMessage()]
        assert len(lines) == 1 and "connections refused" in lines[0], lines  # in aggregate, not one per client
    finally:
        slow.close()
        view.close()
        eng.stop()


def test_a_request_body_that_does_not_arrive_is_a_408(views):
    eng, view = views["open"]
    timeout_s = view.server.cfg.request_timeout_s
    t = time.monotonic()
    status, headers, body = exchange(view.server.port, post(b'{"id": "x"').replace(
        b"Content-Length: 10", b"Content-Length: 500"), timeout=timeout_s + 30)
    assert status == 408 and "did not arrive within" in json.loads(body)["error"]
    assert timeout_s - 0.05 <= time.monotonic() - t


# -- the whole program under a low file descriptor limit -------------------------------------------------
FD_LIMIT = 88  # what the probe of issue 21 used: 300 slow clients then stopped the view and the control socket


def test_refused_connections_are_reported_at_most_every_report_interval(monkeypatch, caplog):
    """The aggregate line itself, on a fake clock: refusals every second for 35 s give one line per
    REPORT_EVERY_S (the flood test above lasts too little to see a second line), each with the count since
    the last; none while nothing changes."""
    from types import SimpleNamespace

    from engine.config import ViewConfig
    from engine.view import server as view_server

    clock = [1000.0]
    monkeypatch.setattr(view_server.time, "monotonic", lambda: clock[0])
    srv = view_server.ViewServer(SimpleNamespace(view=None), ViewConfig())
    refused = [0]
    monkeypatch.setattr(srv, "connection_counts", lambda: {"refused": refused[0], "timed_out": 0, "internal_errors": 0,
                                                            "http_errors": 0, "cap": 64, "open": 0})
    caplog.set_level(logging.INFO, "vidar.view")
    for _ in range(35):
        refused[0] += 3
        srv._report()
        clock[0] += 1.0
    for _ in range(30):  # quiet: nothing to say
        srv._report()
        clock[0] += 1.0
    lines = [r.getMessage() for r in caplog.records if "connections refused" in r.getMessage()]
    counts = [int(line.split("report: ")[1].split()[0]) for line in lines]
    # t=0 (the first), 10, 20, 30 (30 each: 10 s of refusals), then once at 40 for those of 31-34; never again
    assert REPORT_EVERY_S == 10 and counts == [3, 30, 30, 30, 12], lines
    assert sum(counts) == refused[0]  # nothing lost from the counts


def test_view_and_control_answer_through_a_flood_under_a_low_fd_limit(tmp_path):
    """`vidar run` (uvloop, the runtime's control socket) with RLIMIT_NOFILE at 88, then 300 clients that
    hold partial headers: the control socket answers throughout, the view answers once the cap's slow
    clients have timed out, every slow client is closed within the timeout, and the engine logs it in
    aggregate, no tracebacks, no descriptor errors; it exits 0 on Ctrl-C."""
    timeout_s, vport, ctl = 2.0, free_port(), f"tcp://127.0.0.1:{free_port()}"
    cfg = {"streams": [{"id": "cam1", "url": "synthetic://shapes?size=64x48&fps=5"}],
           "models": {"classify": {"name": "test_vit", "weights": "random", "max_batch": 1, "device": "cpu"}},
           "publish": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}, "metrics": {"enabled": False},
           "status": {"interval_s": 30}, "control": {"endpoint": ctl},
           "view": {"port": vport, "request_timeout_s": timeout_s}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))

    def low_fd_limit():  # in the child only: this process keeps its own limit. The hard limit too: `vidar run`
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))  # raises its soft limit to the hard one
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=low_fd_limit)
    slow = Slow()
    if not wait_for(lambda: _answers(ctl, 1.0), 60, step=0.2):
        proc.kill()
        pytest.fail(f"vidar run did not start under RLIMIT_NOFILE={FD_LIMIT}: {proc.communicate()[1][-3000:]}")
    try:
        base = statistics.median(_timed(lambda: request(ctl, {"op": "list"})) for _ in range(5))
        slack = max(1.0, 20 * base)
        socks = []
        for _ in range(2):  # the control socket answers at once, half-way through the flood and after it
            socks += slow.open(vport, 150)
            t = time.monotonic()
            assert request(ctl, {"op": "list"}, timeout=slack)["ok"]
            assert time.monotonic() - t < slack
        assert wait_for(lambda: _view_answers(vport), timeout_s + slack, step=0.1)  # the view: once slots free up
        slow.poll(timeout_s + 2 * slack)
        lived = slow.lived(socks)
        assert len(lived) == 300 and max(lived) <= timeout_s + 2 * slack, (len(lived), max(lived, default=None))
        assert request(ctl, {"op": "list"}, timeout=slack)["ok"]
    finally:
        slow.close()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "Too many open files" not in err, err[-3000:]
    assert "view: at most" in err and f"the file descriptor limit (RLIMIT_NOFILE) is {FD_LIMIT}" in err, err[-3000:]
    # in aggregate: one line per refused connection would be well over a hundred here; and the lines are
    # REPORT_EVERY_S apart at least, read from their own HH:MM:SS stamps (so 1 s less for the rounding)
    reports = [line for line in err.splitlines() if "connections refused at the cap of" in line]
    assert reports, err[-3000:]  # the refusals were reported
    refused = [int(line.split("since the last report: ")[1].split()[0]) for line in reports]
    assert sum(refused) > len(reports), (refused, err[-3000:])  # a line covers several refusals, not one each
    stamps = [line.split()[0] for line in reports]
    secs = [int(h) * 3600 + int(m) * 60 + int(x) for h, m, x in (t.split(":") for t in stamps)]
    gaps = [(b - a) % 86400 for a, b in zip(secs, secs[1:])]
    assert all(g >= REPORT_EVERY_S - 1 for g in gaps), (gaps, err[-3000:])


def _timed(fn) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def _answers(ctl: str, timeout: float) -> bool:
    try:
        return request(ctl, {"op": "list"}, timeout=timeout)["ok"]
    except TimeoutError:
        return False


def _view_answers(port: int) -> bool:
    try:
        return exchange(port, http_request("GET", "/api/streams", auth=False), timeout=5)[0] == 200
    except (OSError, IndexError, ValueError):  # refused at the cap: closed before a reply
        return False


# -- the control socket ---------------------------------------------------------------------------------
def test_a_slow_control_client_cannot_starve_another(endpoint):
    """ZeroMQ REP, served by `control.serve`: clients that send a request and never read the reply, one
    that queues 200 requests without reading, and TCP connections that never finish ZeroMQ's greeting;
    a well-behaved client is still answered within its measured time."""
    from tests.support.control import ControlServer, with_control
    cfg, ctl = with_control(engine_config([{"id": "cam1", "url": "synthetic://shapes?size=96x64&fps=30"}], endpoint))
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    server = ControlServer(eng)
    ctx, socks = zmq.Context.instance(), []
    host, port = ctl.rsplit("/", 1)[1].split(":")
    try:
        request(ctl, {"op": "list"})  # connected once: ZeroMQ's and the executor's threads exist
        # the op itself, measured off the socket: a budget measured through it would absorb a slow serve()
        base = statistics.median(_timed(lambda: eng.control({"op": "list"})) for _ in range(5))
        budget = max(0.5, 20 * base)
        for _ in range(5):  # a request each, replies never read
            s = ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ctl)
            s.send(msgpack.packb({"op": "list"}))
            socks.append(s)
        flood = ctx.socket(zmq.DEALER)  # 200 requests queued at once, replies never read
        flood.setsockopt(zmq.LINGER, 0)
        flood.connect(ctl)
        for _ in range(200):
            flood.send_multipart([b"", msgpack.packb({"op": "list"})])
        socks.append(flood)
        half_open = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]
        for s in half_open[:10]:
            s.sendall(b"\xff\x00\x00")  # the start of a ZMTP greeting, never finished
        for _ in range(5):
            t = time.monotonic()
            assert request(ctl, {"op": "list"}, timeout=10)["ok"]
            assert time.monotonic() - t < budget, (time.monotonic() - t, budget)
        for s in half_open:
            s.close()
    finally:
        for s in socks:
            s.close(0)
        server.close()
        eng.stop()
