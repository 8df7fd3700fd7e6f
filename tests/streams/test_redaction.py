"""How a stream URL is shown (issue 31, item 3): an allow-list, on a table of real camera URL forms, the
issue's exact strings and FFmpeg's own error texts, and through a running engine: the `list` reply, the
view's API and websocket, every subscriber's events, refusals and the log never hold a credential, and
the harmless parts (host, port, channel) are still there. The rule itself: streams/urls.py's docstring.
The older cases (the last `@`, spaces, free text) are in tests/streams/test_hostile_sources.py."""

import asyncio
import json
import logging
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.core.engine import Engine
from engine.models.noop import NoopRunner
from engine.publish.client import Subscriber
from engine.testing.wait import wait_for
from engine.view.server import ViewThread
from streams import redact_url
from tests.support.engines import engine_config
from tests.support.net import free_port

pytestmark = pytest.mark.timeout(120)

#: Every secret in the tables below is spelled with one of these; none may ever be shown. A numeric password is
#: matched with the `:` or `=` written before it, so that a number in an event (a timestamp) cannot match it.
SECRETS = ("S3cret", "SECRET", "my pass", "ab//", "Xy7fA9bQz1", "admin:", "ROOT:", ":73519", ":99999", "=86420")

CAMERA_URLS = [
    # Hikvision
    ("rtsp://admin:S3cret@10.0.0.5:554/Streaming/Channels/101", "rtsp://***@10.0.0.5:554/Streaming/Channels/101"),
    ("rtsp://admin:S3cret@10.0.0.5/ISAPI/Streaming/channels/101?transportmode=unicast&profile=Profile_1",
     "rtsp://***@10.0.0.5/ISAPI/Streaming/channels/101?transportmode=***&profile=Profile_1"),
    # Dahua, Amcrest
    ("rtsp://admin:S3cret@10.0.0.6:554/cam/realmonitor?channel=1&subtype=0",
     "rtsp://***@10.0.0.6:554/cam/realmonitor?channel=1&subtype=0"),
    # Axis
    ("rtsp://root:S3cret@10.0.0.7/axis-media/media.amp?videocodec=h264&resolution=1280x720",
     "rtsp://***@10.0.0.7/axis-media/media.amp?videocodec=h264&resolution=1280x720"),
    ("http://10.0.0.7/axis-cgi/mjpg/video.cgi?camera=1&resolution=640x480",
     "http://10.0.0.7/axis-cgi/mjpg/video.cgi?camera=1&resolution=640x480"),
    # XMEye (and the many NVRs on its firmware): the credentials are path text
    ("rtsp://10.0.0.8:554/user=admin_password=S3cret_channel=1_stream=0.sdp",
     "rtsp://10.0.0.8:554/user=***_password=***_channel=1_stream=0.sdp"),
    ("rtsp://10.0.0.8:554/user=admin&password=S3cret&channel=1&stream=0.sdp?real_stream",
     "rtsp://10.0.0.8:554/user=***&password=***&channel=1&stream=0.sdp?***"),
    ("rtsp://h/user=admin_password=S3cret_channel=1_stream=0.sdp",
     "rtsp://h/user=***_password=***_channel=1_stream=0.sdp"),
    # Reolink (its RTMP-over-HTTP form carries the password as a query value)
    ("rtsp://admin:S3cret@10.0.0.9:554/h264Preview_01_main", "rtsp://***@10.0.0.9:554/h264Preview_01_main"),
    ("http://10.0.0.9/flv?port=1935&app=bcs&stream=channel0_main.bcs&user=admin&password=S3cret",
     "http://10.0.0.9/flv?port=***&app=***&stream=channel0_main.bcs&user=***&password=***"),
    # ONVIF `?user=&password=`
    ("rtsp://10.0.0.10/onvif1?user=admin&password=S3cret", "rtsp://10.0.0.10/onvif1?user=***&password=***"),
    ("rtsp://10.0.0.10:554/onvif/profile1/media.smp?user=&password=",
     "rtsp://10.0.0.10:554/onvif/profile1/media.smp?user=***&password=***"),
    # Uniview; UniFi Protect, whose path IS the access token; an RTMP stream key; a signed HLS path
    ("rtsp://admin:S3cret@10.0.0.11/unicast/c1/s0/live", "rtsp://***@10.0.0.11/unicast/c1/s0/live"),
    ("rtsps://10.0.0.12:7441/S3cretXy7fA9bQz1?enableSrtp", "rtsps://10.0.0.12:7441/***?***"),
    ("rtmp://10.0.0.13/live/S3cret-key-0001", "rtmp://10.0.0.13/live/***"),
    ("https://cdn.example.com/hls/eyJhbGciOiJIUzI1NiJ9.S3cret.c2ln/index.m3u8",
     "https://cdn.example.com/hls/***/index.m3u8"),
    ("srt://10.0.0.14:9000?passphrase=S3cret1234&latency=200", "srt://10.0.0.14:9000?passphrase=***&latency=200"),
    # the forms: query keys no deny-list had, userinfo with a space and `/`, with `//`, a user alone
    # with `/`, a bare value, an `@` in a query value, a password given where the host goes
    ("rtsp://h/x?pw=S3cret&p=S3cret&usr=S3cret&u=S3cret&jwt=S3cret&code=S3cret&pin=S3cret&channel=1",
     "rtsp://h/x?pw=***&p=***&usr=***&u=***&jwt=***&code=***&pin=***&channel=1"),
    ("rtsp://admin:my pass/S3cret@h/", "rtsp://***@h/"),
    ("rtsp://admin:ab//S3cret@h:554/x", "rtsp://***@h:554/x"),
    ("rtsp://S3cret/user@h/x", "rtsp://***@h/x"),
    ("rtsp://h/x?S3cret", "rtsp://h/x?***"),
    ("http://h/x?password=a@S3cret", "http://***@***"),
    ("rtsp://admin:S3cret/x", "rtsp://***/x"),
    ("rtsp://h/x?channel=1#S3cret", "rtsp://h/x?channel=1#***"),
    # issue 41 item 8: userinfo typed without `@host` reads as `host:port`. A port over 65535 is no port, and a
    # host that is a known user name with a `:` is userinfo: the whole host part is `***`
    ("rtsp://admin:73519/x", "rtsp://***/x"),
    ("rtsp://admin:4862/Streaming/Channels/101", "rtsp://***/Streaming/Channels/101"),
    ("rtsp://ROOT:554/live", "rtsp://***/live"),
    ("rtsp://admin:73519", "rtsp://***"),
    ("rtsp://Operator:1234?channel=1", "rtsp://***?channel=1"),
    ("rtsp://admin:/x", "rtsp://***/x"),
    ("rtsp://10.0.0.5:99999/x", "rtsp://***/x"),
    ("rtsp://[fe80::1]:73519/live", "rtsp://***/live"),
    ("rtsp://admin/x", "rtsp://admin/x"),  # a host named `admin` without `:`: nothing secret in it
    ("rtsp://cam-admin.local:65535/x", "rtsp://cam-admin.local:65535/x"),
    ("rtsp://admin:S3cret@operator:554/x", "rtsp://***@operator:554/x"),  # after `user:pw@`: a host, whatever its name
    # issue 41 item 8: servers that put the stream key in a stream selector. A selector's value is shown when it
    # is a short number or a known word (optionally with digits: `Profile_1`, `channel0_main.bcs`), else `***`
    ("rtsp://10.0.0.20:554/live?stream=Xy7fA9bQz1cD2eF3&channel=S3cretKey",
     "rtsp://10.0.0.20:554/live?stream=***&channel=***"),
    ("http://10.0.0.21/live?ch=86420&subtype=S3cret&streamtype=S3cret_main&camera=SECRET&profile=S3cret1",
     "http://10.0.0.21/live?ch=***&subtype=***&streamtype=***&camera=***&profile=***"),
    ("rtsp://h/user=admin_password=x_channel=S3cret_stream=Xy7fA9bQz1cD2eF3.sdp",
     "rtsp://h/user=***_password=***_channel=***_stream=***"),
    ("rtsp://h/x?stream=%53%33cret", "rtsp://h/x?stream=***"),
    ("rtsp://h/x?channel=101&subtype=1&stream=main&StreamType=Sub&camera=2&ch=0102&profile=profile1",
     "rtsp://h/x?channel=101&subtype=1&stream=main&StreamType=Sub&camera=2&ch=0102&profile=profile1"),
    ("rtsp://h/onvif?profile=Profile_2&stream=MainStream&channel=ch1&streamtype=hd-1",
     "rtsp://h/onvif?profile=Profile_2&stream=MainStream&channel=ch1&streamtype=hd-1"),
    # format parameters: shown when name-like (the path-segment rule), so no long random token passes
    ("rtsp://h/x?codec=Xy7fA9bQz1cD2eF3&fps=29.97&resolution=1280x720&buffer_size=1048576&rtsp_transport=tcp",
     "rtsp://h/x?codec=***&fps=29.97&resolution=1280x720&buffer_size=1048576&rtsp_transport=tcp"),
    ("srt://10.0.0.14:9000?latency=S3cretXy7fA9bQz1", "srt://10.0.0.14:9000?latency=***"),
    # nothing secret: shown as written (files are paths, not URLs)
    ("synthetic://shapes?size=640x360&fps=30&frames=10&seed=1",
     "synthetic://shapes?size=640x360&fps=30&frames=10&seed=1"),
    ("udp://@239.0.0.1:5000", "udp://@239.0.0.1:5000"),
    ("rtsp://[fe80::1%25eth0]:554/live", "rtsp://[fe80::1%25eth0]:554/live"),
    ("/videos/cam 1/a@b.mp4", "/videos/cam 1/a@b.mp4"),
    ("file:///videos/a@b.mp4", "file:///videos/a@b.mp4"),
]

#: Texts that quote a URL, as FFmpeg and PyAV write them (the `[tcp @ 0x..]` prefix holds an `@` itself).
FFMPEG_TEXTS = [
    "[Errno 111] Connection refused: '{}'",
    "Invalid argument: '{}' returned 22",
    "Error opening input '{}': Server returned 401 Unauthorized (authorization failed)",
    "[tcp @ 0x55d5c8a0] Connection to {} failed: Connection refused",
    "[rtsp @ 0x7f3c00] method DESCRIBE failed: 401 Unauthorized ({})",
]


@pytest.mark.parametrize("url, shown", CAMERA_URLS)
def test_camera_url_forms_show_their_harmless_parts_only(url, shown):
    assert redact_url(url) == shown
    assert redact_url(shown) == shown  # idempotent
    assert not [s for s in SECRETS if s in shown]


@pytest.mark.parametrize("template", FFMPEG_TEXTS)
@pytest.mark.parametrize("url, shown", CAMERA_URLS)
def test_camera_urls_inside_ffmpeg_texts_are_shown_by_the_same_rule(url, shown, template):
    """Inside a message the URL is shown exactly as alone, and every other character of it is kept."""
    assert redact_url(template.format(url)) == template.format(shown)


def test_a_refused_url_without_slashes_is_echoed_without_its_password():
    from streams.urls import scheme_error
    why = scheme_error("rtsp:admin:a b/SECRET@h/x")
    assert why.startswith("'rtsp:***@h/x' must be written rtsp://") and "SECRET" not in why and "a b" not in why


@pytest.mark.parametrize("url, shown", [
    ("://admin:S3cret@h/x", "'://***@h/x'"),           # a pasted URL missing its scheme
    ("2rtsp://admin:S3cret@h/x", "'2rtsp://***@h/x'"),  # a scheme that free text's URL pattern does not see
    (".rtsp://admin:S3cret@h/x", "'.rtsp://***@h/x'"),
])
def test_a_refused_url_with_a_mangled_scheme_is_echoed_without_its_password(url, shown):
    """From the review of issue 31: these were echoed whole in the refusal (config error, control reply, log)."""
    from streams.urls import scheme_error
    why = scheme_error(url)
    assert shown in why and "S3cret" not in why


# -- through a running engine ----------------------------------------------------------------------------
class _ClipServer:
    """An HTTP server that answers every GET with one mp4 clip, whatever the path, query or credentials:
    a camera the engine really connects to, so its `started` event (which quotes the URL) is sent."""

    def __init__(self, clip: bytes):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "video/mp4")
                self.send_header("Content-Length", str(len(clip)))
                self.end_headers()
                self.wfile.write(clip)

            def log_message(self, *args):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def _http(url, body=None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _ws_state(view_url: str, ids: set, timeout: float) -> str:
    """The view's websocket state (raw JSON text) once it lists every stream in `ids`."""
    import aiohttp

    async def run():
        async with aiohttp.ClientSession() as s, s.ws_connect(view_url + "ws") as ws:
            t_end, text = time.monotonic() + timeout, ""
            while time.monotonic() < t_end:
                m = await ws.receive(timeout=max(0.1, t_end - time.monotonic()))
                if m.type == aiohttp.WSMsgType.TEXT and json.loads(m.data).get("type") == "state":
                    text = m.data
                    if ids <= set(json.loads(text)["streams"]):
                        return text
            return text
    return asyncio.run(run())


def _events(sub: Subscriber, until, timeout: float) -> list[dict]:
    got, t_end = [], time.monotonic() + timeout
    while not until(got) and time.monotonic() < t_end:
        m = sub.recv(0.2)
        if m is not None:
            got.append(m)
    return got


@pytest.mark.timeout(180)
def test_camera_credentials_never_reach_list_view_websocket_events_or_log(endpoint, caplog, clip48):
    """Streams added through the control API with the issue's URL forms (refused port: `reconnecting`
    events quoting the URL; a served clip: a `started` event quoting it), and a refused `rtsp:` URL without
    `//`: no secret in the list reply, the view's API and websocket, the events, the refusals or the log."""
    refused = free_port()  # nothing listens there once the probe socket is closed: refused in about 1 ms
    server = _ClipServer(clip48.read_bytes())
    urls = {
        "xmeye": f"rtsp://127.0.0.1:{refused}/user=admin_password=S3cret_channel=1_stream=0.sdp",
        "keys": f"rtsp://127.0.0.1:{refused}/x?pw=S3cret&p=S3cret&usr=S3cret&u=S3cret&jwt=S3cret&code=S3cret"
                "&pin=S3cret&channel=1",
        "space": f"rtsp://admin:my pass/S3cret@127.0.0.1:{refused}/",
        "dslash": f"rtsp://admin:ab//S3cret@127.0.0.1:{refused}/x",
        "useronly": f"rtsp://S3cret/user@127.0.0.1:{refused}/x",
        "onvif": f"rtsp://127.0.0.1:{refused}/onvif1?user=admin&password=S3cret",
        "served": f"http://admin:S3cret@127.0.0.1:{server.port}/user=admin_password=S3cret_channel=1_stream=0.mp4"
                  "?pw=S3cret&channel=1",
    }
    cfg = engine_config([{"id": "cam0", "url": "synthetic://shapes?size=64x48&fps=10"}], endpoint,
                        source={"open_timeout_s": 2, "stall_timeout_s": 2, "reconnect_initial_s": 0.2,
                                "reconnect_max_s": 0.5},
                        view={"enabled": True, "port": 0})
    eng = Engine(cfg, models={"classify": NoopRunner()})
    view = None
    with caplog.at_level(logging.DEBUG), Subscriber(endpoint, ["event."]) as sub:
        eng.start()
        try:
            view = ViewThread(eng)
            assert eng.publisher.wait_subscribers(1, 10)
            for sid, url in urls.items():
                reply = eng.control({"op": "add_stream", "stream": {"id": sid, "url": url}})
                assert reply == {"ok": True, "stream": sid}, reply
            bad = "rtsp:admin:a b/SECRET@h/x"
            refusals = [eng.control({"op": "add_stream", "stream": {"id": "bad", "url": bad}}),
                        _http(view.url + "api/streams", {"id": "bad", "url": bad})]
            events = _events(sub, lambda ms: set(urls) <= {m["stream"] for m in ms}
                             and any(m["stream"] == "served" and m["kind"] == "started" for m in ms), timeout=30)
            listed = eng.control({"op": "list"})
            api = _http(view.url + "api/streams")
            ws = _ws_state(view.url, set(urls), timeout=20)
            for sid in urls:
                assert eng.control({"op": "remove_stream", "stream": sid}) == {"ok": True}
            events += _events(sub, lambda ms: set(urls) <= {m["stream"] for m in ms if m["kind"] == "eos"}, timeout=20)
        finally:
            if view is not None:
                view.close()
            eng.stop()
            server.close()
    ours = [m for m in events if m["stream"] in urls]
    for where, text in [("list", repr(listed)), ("view API", api[1]), ("websocket", ws), ("events", repr(ours)),
                        ("refusals", repr(refusals)), ("log", caplog.text)]:
        leaked = [s for s in SECRETS if s in text]
        assert not leaked, f"{where} shows {leaked}: {text[:3000]}"
    # the engine really said something about every stream, with the harmless parts of its URL
    assert set(urls) <= {m["stream"] for m in ours if m["kind"] == "reconnecting" or m["stream"] == "served"}, ours
    started = [m["reason"] for m in ours if m["stream"] == "served" and m["kind"] == "started"]
    assert started == [f"connected to http://***@127.0.0.1:{server.port}/user=***_password=***_channel=1_stream=0.mp4"
                       "?pw=***&channel=1"], started
    shown = {sid: s["url"] for sid, s in listed["streams"].items() if sid in urls}
    assert shown == {sid: redact_url(url) for sid, url in urls.items()}, shown
    assert shown["xmeye"] == f"rtsp://127.0.0.1:{refused}/user=***_password=***_channel=1_stream=0.sdp"
    assert shown["space"] == f"rtsp://***@127.0.0.1:{refused}/"
    assert refusals[0]["ok"] is False and "'rtsp:***@h/x' must be written rtsp://" in refusals[0]["error"], refusals
    assert refusals[1][0] == 400 and "must be written rtsp://" in refusals[1][1], refusals
    assert api[0] == 200 and f"127.0.0.1:{refused}/user=***_password=***_channel=1" in api[1], api
    assert all(sid in json.loads(ws)["streams"] for sid in urls), ws[:2000]
    assert "stream served added (http://***@127.0.0.1" in caplog.text



# -- issue 41 item 8: `vidar run`, its ingest processes' logs included ---------------------------------------
#: A stream key as servers hand them out (random letters and digits): never shown, in `stream=` nor `channel=`.
KEY = "Xy7fA9bQz1cD2eF3"


def _vidar_run(tmp_path, streams: list[dict]):
    """`vidar run` as a child, its stdout and stderr in files: the engine's log and its ingest processes' (they
    inherit its stderr through the forkserver), which caplog cannot see. (process, control, publisher, view URL,
    stdout path, stderr path)."""
    import sys

    import yaml
    ctl, pub, vport = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port()
    cfg = {"streams": streams,
           "models": {"classify": {"name": "test_vit", "weights": "random", "max_batch": 1, "device": "cpu"}},
           "publish": {"endpoint": pub}, "metrics": {"enabled": False}, "status": {"interval_s": 1},
           "control": {"endpoint": ctl}, "view": {"enabled": True, "port": vport},
           "ingest": {"processes": 2, "nice": 0},
           # decode on the CPU: a stream that may use NVDEC stays a thread in the engine process (stream_table.py)
           "source": {"decode": "cpu", "open_timeout_s": 2, "stall_timeout_s": 2, "reconnect_initial_s": 0.2,
                      "reconnect_max_s": 0.5}}
    path = tmp_path / "vidar.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", str(path)], stdout=fo, stderr=fe)
    return proc, ctl, pub, f"http://127.0.0.1:{vport}/", out, err


@pytest.mark.timeout(180)
def test_stream_keys_and_userinfo_typed_as_a_host_never_leave_vidar_run(tmp_path, clip48):
    """Issue 41 item 8 against `vidar run` with ingest processes: a stream key in `stream=` and `channel=`
    (a refused port: the ingest process logs the failed open and a `reconnecting` event quotes the URL; a served
    clip: a `started` event quotes it) and `rtsp://admin:73519/x` (a numeric password typed without `@host`),
    given in the config file and added through the control socket. None of the secrets is in the `list` reply,
    the view's API and websocket, the events, or the stdout and stderr of the engine
    and its ingest processes; the ingest processes did log the (redacted) URL, and decoded every stream."""
    from engine.control.control_socket import request
    refused = free_port()  # nothing listens there once the probe socket is closed: refused in about 1 ms
    server = _ClipServer(clip48.read_bytes())
    urls = {"key": f"rtsp://127.0.0.1:{refused}/live?stream={KEY}&channel=S3cretKey",
            "userhost": "rtsp://admin:73519/x",  # FFmpeg refuses the port at once (tcp.c: 0 < port < 65536)
            "served": f"http://127.0.0.1:{server.port}/clip.mp4?stream={KEY}&channel=1"}
    in_config = {"cfgkey": f"rtsp://127.0.0.1:{refused}/cam/realmonitor?channel={KEY}&subtype=0"}
    proc, ctl, pub, view_url, out, err = _vidar_run(
        tmp_path, [{"id": "cam0", "url": "synthetic://shapes?size=64x48&fps=10"}]
        + [{"id": sid, "url": url} for sid, url in in_config.items()])
    try:
        with Subscriber(pub, ["classify.cam0", "event."]) as sub:
            # a result of cam0 received: the subscription is live, so no event of the streams added next is lost
            assert _events(sub, lambda ms: any(m["type"] != "event" for m in ms), timeout=60), open(err).read()
            for sid, url in urls.items():
                reply = request(ctl, {"op": "add_stream", "stream": {"id": sid, "url": url}}, timeout=15)
                assert reply == {"ok": True, "stream": sid}, reply
            events = _events(sub, lambda ms: set(urls) <= {m["stream"] for m in ms if m["type"] == "event"}
                             and any(m["stream"] == "served" and m["kind"] == "started" for m in ms), timeout=30)
            listed = request(ctl, {"op": "list"}, timeout=15)
            api = _http(view_url + "api/streams")
            ws = _ws_state(view_url, set(urls) | set(in_config), timeout=20)
            for sid in [*urls, *in_config]:
                assert request(ctl, {"op": "remove_stream", "stream": sid}, timeout=15) == {"ok": True}
            events += _events(sub, lambda ms: set(urls) <= {m["stream"] for m in ms if m.get("kind") == "eos"},
                              timeout=20)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        server.close()
    stdout, stderr = out.read_text(), err.read_text()
    ours = [m for m in events if m["type"] == "event" and m["stream"] in urls]
    for where, text in [("list", repr(listed)), ("view API", api[1]), ("websocket", ws),
                        ("events", repr(ours)), ("stdout", stdout), ("stderr", stderr)]:
        leaked = [s for s in SECRETS if s in text]
        assert not leaked, f"{where} shows {leaked}: {text[:3000]}"
    every = {**urls, **in_config}
    shown = {sid: s["url"] for sid, s in listed["streams"].items() if sid in every}
    assert shown == {sid: redact_url(url) for sid, url in every.items()}, shown
    assert shown["key"] == f"rtsp://127.0.0.1:{refused}/live?stream=***&channel=***"
    assert shown["userhost"] == "rtsp://***/x"
    assert all(listed["streams"][sid]["process"].startswith("ingest-") for sid in every), listed
    # the engine said something about every stream, quoting the harmless parts of its URL
    reasons = {sid: " ".join(m["reason"] for m in ours if m["stream"] == sid) for sid in urls}
    assert f"'rtsp://127.0.0.1:{refused}/live?stream=***&channel=***'" in reasons["key"], reasons
    assert "'rtsp://***/x'" in reasons["userhost"], reasons
    assert f"connected to http://127.0.0.1:{server.port}/clip.mp4?stream=***&channel=1" in reasons["served"], reasons
    assert api[0] == 200 and "stream=***&channel=***" in api[1], api
    assert set(every) <= set(json.loads(ws)["streams"]), ws[:2000]
    # the ingest processes' own log lines (`ingest-N` in their format) named the streams' URLs, redacted
    ingest_lines = [line for line in stderr.splitlines() if re.search(r" ingest-\d+ ", line)]
    for sid, url in [("key", urls["key"]), ("cfgkey", in_config["cfgkey"]), ("userhost", urls["userhost"])]:
        assert any(f"stream {sid}:" in line and redact_url(url) in line for line in ingest_lines), stderr[-3000:]
    assert f"stream key added (rtsp://127.0.0.1:{refused}/live?stream=***&channel=***)" in stderr, stderr[-3000:]
