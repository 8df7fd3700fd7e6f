"""Hostile stream URLs and sources (issue 21, items 2-4): credentials never shown, nothing FFmpeg would
read as a protocol gets past the allow-list, and sources that never open (a named pipe with no writer)
neither leak decoder threads nor hang a removal."""

import logging
import os
import re
import select
import socket
import threading
import time
from urllib.parse import urlsplit

import psutil
import pytest

from engine.config import StreamConfig
from engine.core.engine import Engine
from engine.errors import ConfigError, SourceOpenError
from engine.publish.client import Subscriber
from engine.models.noop import NoopRunner
from streams import open_source, redact_url
from streams.urls import scheme_error
from streams.pyav import FileSource
from streams.synthetic import SyntheticSource
from engine.testing.clips import decode_all, write_clip
from engine.testing.wait import wait_for
from tests.support.engines import engine_config
from tests.support.net import free_port

pytestmark = pytest.mark.timeout(120)


# -- A. credentials -------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, shown", [
    # userinfo runs to the LAST `@` of the authority (FFmpeg's password here is `pa@hunter2xyz`)
    ("rtsp://admin:pa@hunter2xyz@host/x", "rtsp://***@host/x"),
    ("rtsp://admin:pa ss@host/x", "rtsp://***@host/x"),                  # a space in the password
    ("rtsp://admin:p%40ss@host:554/x", "rtsp://***@host:554/x"),          # `@` percent-encoded
    ("rtsp://admin:pw@[fe80::1]:554/x", "rtsp://***@[fe80::1]:554/x"),    # IPv6 host
    ("rtsp://admin:pw@host", "rtsp://***@host"),                          # no path
    ("rtsp://admin:pw@host?x=1", "rtsp://***@host?x=***"),                # `x` is not a shown key
    ("RTSP://admin:pw@host/x", "RTSP://***@host/x"),
    # credentials in the query: the value hidden, the key kept, case-insensitive
    ("http://host/live.ts?user=admin&password=s3cret&ch=1", "http://host/live.ts?user=***&password=***&ch=1"),
    ("http://host/x?PWD=a&Passwd=b&pass=c#frag", "http://host/x?PWD=***&Passwd=***&pass=***#***"),
    ("https://h/x?token=t&access_token=u&api_key=k&key=v&secret=w&auth=z&signature=q&username=n",
     "https://h/x?token=***&access_token=***&api_key=***&key=***&secret=***&auth=***&signature=***&username=***"),
    ("rtsp://u:p@h/x?token=t", "rtsp://***@h/x?token=***"),
    # a password with `/`, `?` or `#` (urlsplit and FFmpeg end the authority there and fail, the text keeps it);
    # after a `?` or `#` the `@` may be in a query value (`?pw=a@b`), so what follows it is not shown either
    ("rtsp://admin:Pa#ss1@cam/x", "rtsp://***@***/x"),
    ("rtsp://admin:pa/ss@host/x", "rtsp://***@host/x"),
    ("rtsp://admin:pa?ss@host/x", "rtsp://***@***/x"),
    # keys that contain a credential word, %-encoded keys, a value with a space (a configured URL is one token)
    ("srt://h:9000?passphrase=abc&latency=20", "srt://h:9000?passphrase=***&latency=20"),
    ("http://h/x?api-key=1&auth_token=2&X_Token=3&credentials=4&pass%77ord=5&ch=6",
     "http://h/x?api-key=***&auth_token=***&X_Token=***&credentials=***&pass%77ord=***&ch=6"),
    ("http://h/x?password=sec ret&ch=1", "http://h/x?password=***&ch=1"),
    # nothing to hide: unchanged
    ("rtsp://cam.local:554/s1?channel=1&subtype=0", "rtsp://cam.local:554/s1?channel=1&subtype=0"),
    ("rtsp://[::1]:8554/x", "rtsp://[::1]:8554/x"),
    ("udp://@239.0.0.1:5000", "udp://@239.0.0.1:5000"),                  # multicast: an empty userinfo
    ("rtsp://cam/a@b", "rtsp://***@b"),   # `@` in the path, or a password with `/`: errs on hiding
    ("/videos/a@b.mp4", "/videos/a@b.mp4"),
    ("videos/a:b@c.mp4", "videos/a:b@c.mp4"),
    ("synthetic://shapes?size=64x48&seed=1", "synthetic://shapes?size=64x48&seed=1"),
])
def test_redact_url_table(url, shown):
    assert redact_url(url) == shown
    assert redact_url(shown) == shown  # idempotent: redacting twice shows the same
    if "***@" in shown and "@" in urlsplit(url).netloc:
        # the same split as urllib.parse's: what remains is exactly its host and port, no password
        assert urlsplit(shown).password is None and urlsplit(shown).username == "***"
        assert urlsplit(shown).netloc.split("@")[-1] == urlsplit(url).netloc.rpartition("@")[2]


@pytest.mark.parametrize("text, secrets, kept", [
    # what FFmpeg and PyAV put in exception messages: the URL quoted inside a sentence
    ("[Errno 111] Connection refused: 'rtsp://admin:pa@hunter2xyz@127.0.0.1:9/x'", ["pa@hunter2xyz", "admin"],
     "Connection refused: 'rtsp://***@127.0.0.1:9/x'"),
    ("cannot open 'rtsp://admin:pa ss@h:554': timed out", ["pa ss"], "'rtsp://***@h:554': timed out"),
    ("retry rtsp://a:one@h1/x then rtsp://b:two@h2/y", ["one", "two"], "rtsp://***@h1/x then rtsp://***@h2/y"),
    ("GET 'http://h/live.ts?user=me&password=s3cret' -> 401", ["me", "s3cret"],
     "'http://h/live.ts?user=***&password=***' -> 401"),
    ("KeyError: 'no such stream: rtsp://u:hunter2@cam/x'\nline two user@example", ["hunter2"],
     "rtsp://***@cam/x'\nline two user@example"),
    # issue 31: a password with a space and `/`, with `//`, XMEye's path, keys no deny-list had
    ("Invalid argument: 'rtsp://admin:my pass/S3cret@127.0.0.1:9/x' returned 22", ["S3cret", "my pass"],
     "Invalid argument: 'rtsp://***@127.0.0.1:9/x' returned 22"),
    ("[tcp @ 0x55d5c8] Connection to rtsp://admin:ab//S3cret@h:554/x failed: refused", ["S3cret", "ab//"],
     "[tcp @ 0x55d5c8] Connection to rtsp://***@h:554/x failed: refused"),
    ("Connection refused: 'rtsp://h/user=admin_password=S3cret_channel=1_stream=0.sdp?real_stream'", ["S3cret"],
     "'rtsp://h/user=***_password=***_channel=1_stream=0.sdp?***'"),
    ("401: 'http://h/x?pw=S3cret&u=S3cret&jwt=S3cret&pin=S3cret&channel=2'", ["S3cret"],
     "'http://h/x?pw=***&u=***&jwt=***&pin=***&channel=2'"),
])
def test_redact_url_in_free_text(text, secrets, kept):
    shown = redact_url(text)
    assert not [s for s in secrets if s in shown], shown
    assert kept in shown


def _refused_port() -> int:
    return free_port()  # nothing listens there once the probe socket is closed: connection refused in ~1 ms


def _secrets_url(port: int) -> tuple[str, list[str]]:
    url = f"rtsp://admin:pa@hunter2xyz@127.0.0.1:{port}/x?password=qsecret1&token=qsecret2"
    return url, ["hunter2xyz", "qsecret1", "qsecret2", "admin:"]


def _events(sub: Subscriber, until, timeout: float) -> list[dict]:
    """Messages until `until(messages)` is true or `timeout` seconds pass."""
    got, t_end = [], time.monotonic() + timeout
    while not until(got) and time.monotonic() < t_end:
        m = sub.recv(0.2)
        if m is not None:
            got.append(m)
    return got


def test_password_never_shown_in_replies_events_or_log(endpoint, caplog):
    """A stream whose URL carries credentials (userinfo with an `@`, and query keys) and cannot connect:
    the list reply, every event.* message, and the log show the host but never a secret."""
    cfg = engine_config([{"id": "cam1", "url": "synthetic://shapes?size=64x48&fps=10"}], endpoint,
                        source={"open_timeout_s": 0.5, "stall_timeout_s": 1, "reconnect_initial_s": 0.1,
                                "reconnect_max_s": 0.2})
    eng = Engine(cfg, models={"classify": NoopRunner()})
    url, secrets = _secrets_url(_refused_port())
    with caplog.at_level(logging.DEBUG), Subscriber(endpoint, ["event."]) as sub:
        eng.start()
        try:
            assert eng.publisher.wait_subscribers(1, 10)  # the subscription has reached the publisher
            reply = eng.control({"op": "add_stream", "stream": {"id": "cam2", "url": url}})
            assert reply == {"ok": True, "stream": "cam2"}, reply
            events = _events(sub, lambda ms: sum(m["stream"] == "cam2" for m in ms) >= 1, timeout=20)
            listed = eng.control({"op": "list"})
            assert eng.control({"op": "remove_stream", "stream": "cam2"}) == {"ok": True}
            events += _events(sub, lambda ms: any(m["kind"] == "eos" for m in ms), timeout=10)
        finally:
            eng.stop()
    cam2 = [m for m in events if m["stream"] == "cam2"]
    assert {"reconnecting", "eos"} <= {m["kind"] for m in cam2}, cam2
    assert any("rtsp://***@127.0.0.1" in m["reason"] for m in cam2), cam2  # the host is shown, so this checks something
    assert listed["streams"]["cam2"]["url"].startswith("rtsp://***@127.0.0.1:")
    assert "cam2" in caplog.text
    for where, text in [("list", repr(listed)), ("events", repr(cam2)), ("log", caplog.text)]:
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"{where} shows {leaked}: {text[:2000]}"


def test_exception_texts_quoting_the_url_are_redacted(endpoint, caplog, monkeypatch):
    """A source that crashes with the URL in its message (the ingest's internal-error reason and its
    logged traceback), and a control request that fails with one (control.py's internal-error reply)."""
    url, secrets = _secrets_url(_refused_port())

    gate = threading.Event()  # the crash waits for the subscription to be in place

    def crash(self):
        gate.wait(10)
        raise RuntimeError(f"could not parse {self.url}")

    monkeypatch.setattr("streams.pyav.NetworkSource.open", crash)
    cfg = engine_config([{"id": "cam", "url": url}], endpoint)
    eng = Engine(cfg, models={"classify": NoopRunner()})
    with caplog.at_level(logging.DEBUG), Subscriber(endpoint, ["event."]) as sub:
        eng.start()
        try:
            assert eng.publisher.wait_subscribers(1, 10)
            gate.set()
            assert wait_for(lambda: eng.streams["cam"].ingest.failed, 10)
            monkeypatch.setattr(eng, "describe", lambda: (_ for _ in ()).throw(ValueError(f"bad {url}")))
            reply = eng.control({"op": "list"})
            events = _events(sub, lambda ms: any(m["kind"] == "eos" for m in ms), timeout=10)
        finally:
            eng.stop()
    reason = eng.streams["cam"].ingest.end_reason
    assert reason.startswith("error: internal error: RuntimeError: could not parse rtsp://***@127.0.0.1"), reason
    assert reply["ok"] is False and "internal error: ValueError: bad rtsp://***@127.0.0.1" in reply["error"]
    assert "decoder thread crashed" in caplog.text and "Traceback" in caplog.text
    assert [m["reason"] for m in events if m["kind"] == "error"] == [reason[len("error: "):]]
    for where, text in [("reason", reason), ("reply", repr(reply)), ("events", repr(events)), ("log", caplog.text)]:
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"{where} shows {leaked}: {text[:2000]}"


def test_synthetic_url_with_userinfo_is_refused_without_echoing_it():
    with pytest.raises(SourceOpenError, match=r"unknown synthetic pattern '\*\*\*@shapes'") as info:
        SyntheticSource("s", "synthetic://u:hunter2@shapes")
    assert "hunter2" not in str(info.value)


# -- B. what FFmpeg would read as a protocol --------------------------------------------------------------
_ALLOWED = r"allowed: a file path \(or file:PATH, file://PATH\), synthetic://, or a network URL: rtsp://"


@pytest.mark.parametrize("url, refused", [
    # FFmpeg protocols written without `//` (FFmpeg opens them itself, with no timeout): refused
    ("http:127.0.0.1:8080/x.ts", r"'http:127.0.0.1:8080/x.ts' must be written http://\.\.\. .*no.* timeouts"),
    ("HTTP:127.0.0.1:8080/x.ts", r"must be written http://"),
    ("rtsp:/cam/x", r"must be written rtsp://"),
    ("http:admin:hunter2@h/x", r"'http:\*\*\*@h/x' must be written http://"),  # and no password echoed
    ("synthetic:shapes", r"must be written synthetic://"),
    # protocols vidar does not give its timeouts to: refused, naming the scheme and what is allowed
    ("ftp:127.0.0.1:21/x", r"unsupported URL scheme 'ftp' in 'ftp:127.0.0.1:21/x'; " + _ALLOWED),
    ("ftp://u:hunter2@h/x", r"unsupported URL scheme 'ftp' in 'ftp://\*\*\*@h/x'"),
    ("concat:a.mp4|b.mp4", "unsupported URL scheme 'concat'"),
    ("subfile,,start,0,end,100,,:/etc/passwd", "unsupported URL scheme 'subfile'"),
    ("subfile:/etc/passwd", "unsupported URL scheme 'subfile'"),
    ("crypto:/x.enc", "unsupported URL scheme 'crypto'"),
    ("crypto+http://h/x", r"unsupported URL scheme 'crypto\+http'"),
    ("data:video/mp4;base64,AAAA", "unsupported URL scheme 'data'"),
    ("pipe:0", "unsupported URL scheme 'pipe'"),
    ("fd:3", "unsupported URL scheme 'fd'"),
    ("cache:http://h/x.ts", "unsupported URL scheme 'cache'"),
    ("async:http://h/x.ts", "unsupported URL scheme 'async'"),
    ("gopher://h/x", "unsupported URL scheme 'gopher'"),
    ("2024:clip.mp4", r"unsupported URL scheme '2024'.*write it as file:NAME"),  # FFmpeg: digits count too
    (":clip.mp4", "unsupported URL scheme ''"),
    ("C:\\videos\\a.mp4", "unsupported URL scheme 'c'"),  # a DOS path: not one on Linux, and no crash
    ("", "empty URL"),
    # accepted: known schemes with `//`, file: / file://, and plain paths (a colon after a `/` is a path)
    ("rtsp://cam/x", None),
    ("http://127.0.0.1:8080/x.ts", None),
    ("synthetic://shapes", None),
    ("file:/abs/path.mp4", None),
    ("file:///abs/path.mp4", None),
    ("file:a:b.mp4", None),
    ("clips/a:b.mp4", None),
    ("./http:x.mp4", None),
    ("/videos/missing.mp4", None),  # whether a file exists is checked when it opens: a per-stream error
])
def test_protocol_table(url, refused):
    why = scheme_error(url)
    if refused is None:
        assert why is None
        assert StreamConfig(id="s", url=url).url == url
        return
    assert why is not None and re.search(refused, why), why
    assert "hunter2" not in why
    with pytest.raises(SourceOpenError, match="stream 's': "):
        open_source("s", url)
    with pytest.raises(ValueError, match="stream|URL|url"):
        StreamConfig(id="s", url=url)


def test_config_refuses_a_protocol_without_slashes(endpoint):
    with pytest.raises(ConfigError, match="must be written http://"):
        engine_config([{"id": "c", "url": "http:127.0.0.1:1/x.ts"}], endpoint)


def test_paths_are_given_to_ffmpeg_as_files(tmp_path, monkeypatch, clip48):
    """A path whose name FFmpeg could read as a protocol decodes as the file it is: FFmpeg is given
    file: + the absolute path."""
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a:b.mp4").write_bytes(clip48.read_bytes())
    (tmp_path / "http:x.mp4").write_bytes(clip48.read_bytes())
    monkeypatch.chdir(tmp_path)
    ref = len(decode_all(clip48))
    for url in ("clips/a:b.mp4", "file:http:x.mp4", f"file://{tmp_path}/http:x.mp4", "./http:x.mp4"):
        src = open_source("f", url)
        assert isinstance(src, FileSource)
        src.open()
        assert sum(1 for _ in src.frames()) == ref, url
        src.close()


def test_missing_file_names_the_stream_and_the_path(tmp_path):
    with pytest.raises(SourceOpenError, match=r"stream 'cam4': file '.*/nope:1.mp4' not found"):
        open_source("cam4", f"file:{tmp_path}/nope:1.mp4").open()


def test_protocol_without_slashes_is_refused_at_once_against_a_silent_server(endpoint):
    """`http:127.0.0.1:PORT/x.ts` used to be opened by FFmpeg's own http protocol, with no timeout: 33 s in
    "starting" against a server that accepts and never answers. Now add_stream refuses it in its reply,
    and nothing ever connects to the server."""
    cfg = engine_config([{"id": "cam1", "url": "synthetic://shapes?size=64x48&fps=10"}], endpoint)
    eng = Engine(cfg, models={"classify": NoopRunner()})
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # accepts connections (the kernel does) and never answers
        port = server.getsockname()[1]
        eng.start()
        try:
            t0 = time.monotonic()
            eng.control({"op": "list"})
            list_s = time.monotonic() - t0  # what any request costs on this machine now
            t0 = time.monotonic()
            reply = eng.control({"op": "add_stream", "stream": {"id": "h", "url": f"http:127.0.0.1:{port}/x.ts"}})
            add_s = time.monotonic() - t0
            assert reply["ok"] is False and "must be written http://" in reply["error"], reply
            assert add_s < 20 * list_s + 0.5, (add_s, list_s)
            assert "h" not in eng.control({"op": "list"})["streams"]
            time.sleep(0.3)
            assert not select.select([server], [], [], 0)[0], "something connected to the silent server"
        finally:
            eng.stop()


# -- C. sources that never open -----------------------------------------------------------------------------
def _counts() -> tuple[int, int, int]:
    proc = psutil.Process()
    return threading.active_count(), proc.num_threads(), proc.num_fds()


def _fifo_engine(endpoint, open_timeout_s=60.0, stall_timeout_s=60.0, mode="live"):
    """An engine with one synthetic stream; FIFO streams are added at run time. Long timeouts by default: a
    decoder thread that a removal does not cancel stays blocked for the whole test."""
    cfg = engine_config([{"id": "base", "url": "synthetic://shapes?size=64x48&fps=10"}], endpoint,
                        source={"open_timeout_s": open_timeout_s, "stall_timeout_s": stall_timeout_s})
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    return eng


def _add_remove(eng, sid: str, url: str) -> None:
    assert eng.control({"op": "add_stream", "stream": {"id": sid, "url": url}}) == {"ok": True, "stream": sid}
    assert eng.control({"op": "remove_stream", "stream": sid}) == {"ok": True}


def _settled(eng, base: tuple[int, int, int], tolerance=(1, 2, 2)) -> bool:
    now = _counts()
    return (all(n <= b + t for n, b, t in zip(now, base, tolerance))
            and not any(e.id.startswith("fifo") for e in eng.table.snapshot()))


def test_fifo_churn_leaks_no_threads_or_fds(tmp_path, endpoint, caplog):
    """50 streams on named pipes that never get a writer, each added then removed: the decoder threads
    (blocked waiting for the first byte) end and their entries go; threads and fds are back at baseline.
    A removal is not a failure: no stream logs an error."""
    eng = _fifo_engine(endpoint)
    try:
        fifos = []
        for i in range(51):
            os.mkfifo(tmp_path / f"p{i}")
            fifos.append(str(tmp_path / f"p{i}"))
        t0 = time.monotonic()  # warm-up: one cycle creates whatever is created once; and it times a cycle
        _add_remove(eng, "fifo-warm", fifos[0])
        assert wait_for(lambda: "fifo-warm" not in eng.streams, 30)
        cycle_s = time.monotonic() - t0
        time.sleep(0.5)
        base = _counts()
        for i, path in enumerate(fifos[1:]):
            _add_remove(eng, f"fifo{i}", path)
        # each thread ends within one poll slice of its removal; the budget is 50 measured cycles, x3
        assert wait_for(lambda: _settled(eng, base), max(10.0, 3 * 50 * cycle_s)), (base, _counts())
        assert eng.table.stuck_decoders == 0
        assert not [t.name for t in threading.enumerate() if t.name.startswith("source-fifo")]
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        eng.stop()


def test_removed_stream_is_forgotten_only_once_its_decoder_thread_ended(tmp_path, endpoint, monkeypatch, caplog):
    """A source that ignores the cancel (blocked in a read nothing interrupts): the removal is answered,
    the stream is kept (state removing) while its decoder thread runs, and forgotten when it ends; one
    that outlives the table's bound is logged and counted, not silently leaked."""
    monkeypatch.setattr(FileSource, "cancel", lambda self: None)
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    eng = _fifo_engine(endpoint, open_timeout_s=1.5)  # the pipe's open gives up by itself after 1.5 s
    try:
        t0 = time.monotonic()
        _add_remove(eng, "fifo", str(fifo))
        entry = eng.table.get("fifo")
        assert entry is not None and entry.ingest.alive and entry.state == "removing"
        assert wait_for(lambda: entry.eos_sent, 5)
        time.sleep(0.3)
        assert entry.ingest.alive and eng.table.get("fifo") is entry  # eos out, thread alive: still held
        assert wait_for(lambda: eng.table.get("fifo") is None, 10)
        assert not entry.ingest.alive and time.monotonic() - t0 >= 1.4
        assert eng.table.stuck_decoders == 0

        eng.table.reap_bound_s = 0.3  # now one that outlives the bound
        eng.cfg.source.open_timeout_s = 3.0
        with caplog.at_level(logging.ERROR, logger="vidar.engine"):
            _add_remove(eng, "fifo", str(fifo))
            entry = eng.table.get("fifo")
            assert wait_for(lambda: eng.table.get("fifo") is None, 5)
        assert entry.ingest.alive and eng.table.stuck_decoders == 1
        assert "stream fifo: decoder thread still running" in caplog.text
        from prometheus_client import generate_latest
        assert "vidar_decoder_threads_stuck_total 1.0" in generate_latest(eng.metrics.registry).decode()
        assert entry.ingest.join(10)  # it ends by itself (its open timeout)
    finally:
        eng.stop()


def _feed(fifo, data: bytes, *, stall_after: int | None = None, stalled: threading.Event | None = None,
          release: threading.Event | None = None) -> threading.Thread:
    """Write `data` into the pipe from a thread (opening it blocks until the reader is there); with
    `stall_after`, write that many bytes, then keep the pipe open without writing until `release`."""
    def run():
        with open(fifo, "wb", buffering=0) as f:
            f.write(data if stall_after is None else data[:stall_after])
            if stall_after is not None:
                stalled.set()
                release.wait(60)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("fmt", ["h264", "mpegts"])
def test_fifo_with_a_writer_is_decoded(tmp_path, endpoint, fmt):
    """A named pipe stays usable as a feed: every frame written into it is decoded, then its eos."""
    n = 40
    clip = write_clip(tmp_path / f"c.{fmt}", n, fmt=fmt)
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    eng = _fifo_engine(endpoint, open_timeout_s=10, stall_timeout_s=10)
    try:
        writer = _feed(fifo, clip.read_bytes())
        reply = eng.control({"op": "add_stream", "stream": {"id": "fifo", "url": str(fifo), "mode": "offline"}})
        assert reply == {"ok": True, "stream": "fifo"}
        assert wait_for(lambda: eng.table.get("fifo").eos_queued, 30)
        writer.join(5)
        snap = eng.pools["classify"].acct.snapshot("fifo")
        assert snap.published == n and snap.ingested == n
        assert eng.streams["fifo"].ingest.end_reason == "end of stream"
    finally:
        eng.stop()


def test_fifo_whose_writer_stalls_is_removed_at_once(tmp_path, endpoint):
    """The writer sends part of a clip and then holds the pipe open without writing: the decoder thread
    waits in a read (its read timeout is 30 s here); a removal ends it within a poll slice, not 30 s."""
    # FFmpeg probes a raw H.264 pipe for up to 5 s of stream before open returns: write more than that
    clip = write_clip(tmp_path / "c.h264", 300, size=(96, 64), fmt="h264")
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    stalled, release = threading.Event(), threading.Event()
    eng = _fifo_engine(endpoint, open_timeout_s=60, stall_timeout_s=60)
    try:
        data = clip.read_bytes()
        _feed(fifo, data, stall_after=len(data) * 9 // 10, stalled=stalled, release=release)
        reply = eng.control({"op": "add_stream", "stream": {"id": "fifo", "url": str(fifo), "mode": "offline"}})
        assert reply["ok"] and stalled.wait(10)
        published = lambda: eng.pools["classify"].acct.snapshot("fifo").published  # noqa: E731
        assert wait_for(lambda: published() > 0, 10)
        seen = []  # offline: no pacing; once the count stops moving, the decoder waits in a read of the pipe
        assert wait_for(lambda: seen.append(published()) or len(seen) > 5 and seen[-1] == seen[-6], 10)
        ingest = eng.streams["fifo"].ingest
        assert ingest.alive and 0 < published() < 300
        t0 = time.monotonic()
        assert eng.control({"op": "remove_stream", "stream": "fifo"}) == {"ok": True}
        assert ingest.join(5)  # removal cancels the read: not the 30 s read timeout
        assert wait_for(lambda: eng.table.get("fifo") is None, 5)
        assert time.monotonic() - t0 < 10
    finally:
        release.set()
        eng.stop()


def test_fifo_whose_writer_stalls_ends_after_the_read_timeout(tmp_path, endpoint):
    """Left alone, a stalled pipe ends the stream after the read timeout (stall_timeout_s / 2), and says why."""
    clip = write_clip(tmp_path / "c.h264", 60, fmt="h264")
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    stalled, release = threading.Event(), threading.Event()
    eng = _fifo_engine(endpoint, open_timeout_s=10, stall_timeout_s=1.0)
    try:
        _feed(fifo, clip.read_bytes(), stall_after=len(clip.read_bytes()) // 2, stalled=stalled, release=release)
        assert eng.control({"op": "add_stream", "stream": {"id": "fifo", "url": str(fifo)}})["ok"]
        assert wait_for(lambda: eng.table.get("fifo").eos_queued, 20)
        ingest = eng.streams["fifo"].ingest
        assert ingest.end_reason == "ended early: no data from the pipe for 0.5 s", ingest.end_reason
        assert eng.pools["classify"].acct.snapshot("fifo").published > 0
    finally:
        release.set()
        eng.stop()


def test_fifo_with_no_writer_fails_after_the_open_timeout(tmp_path, endpoint):
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    eng = _fifo_engine(endpoint, open_timeout_s=0.5)
    try:
        assert eng.control({"op": "add_stream", "stream": {"id": "fifo", "url": str(fifo)}})["ok"]
        assert wait_for(lambda: eng.table.get("fifo").eos_queued, 10)
        reason = eng.streams["fifo"].ingest.end_reason
        assert re.fullmatch(r"error: cannot open '.*/p': no data from the pipe within 0.5 s \(no writer\?\)", reason)
    finally:
        eng.stop()
