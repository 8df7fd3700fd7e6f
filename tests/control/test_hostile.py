"""Hostile and malformed input against a running engine (issue 21): one request never silences the
engine, every long-lived thread and task is supervised (restarted, or engine death with exit 3), an add
is all or nothing, every listening socket is guarded, and frame memory has one engine-wide bound.
(Redaction, URL schemes and cancellable opens: tests/test_hostile_sources.py; the view's HTTP
hardening: tests/test_view_hostile.py.)"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from engine.config import ObjectConfig, build_config
from engine.core.engine import Engine
from engine.errors import ConfigError
from engine.control.runtime import EXIT_DEAD, EXIT_OK, run
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.collector import Collector
from tests.support.engines import engine_config
from tests.support.net import free_port

pytestmark = pytest.mark.timeout(180)


def _counts(eng, stream, pool="classify"):
    s = eng.pools[pool].acct.snapshot(stream)
    return s.published, dict(s.dropped), dict(s.failed), s.in_flight


class _SigintAfter:
    """`run()` must end by itself; if it does not within `seconds`, SIGINT ends it (exit 0), so a test
    of engine death fails instead of hanging until pytest's timeout."""

    def __init__(self, seconds: float):
        self._timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
        self._timer.daemon = True

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()


# -- 1. object ids, unencodable results, supervision ----------------------------------------------------
@pytest.mark.parametrize("oid, ok", [
    (0, True), (2**31 - 1, True),
    (10**30, False),  # answered 200, then killed the publisher (msgpack OverflowError)
    (2**31, False), (-1, False),
    (True, False),    # JSON true was taken as id 1
    (1.0, False), ("3", False), (None, False),
])
def test_object_ids_are_bounded_integers(oid, ok):
    req = {"stream": "cam1", "id": oid, "box": [10, 10, 20, 20]}
    if ok:
        assert ObjectConfig.model_validate(req).id == oid
    else:
        with pytest.raises(ValueError, match="id"):
            ObjectConfig.model_validate(req)


def test_a_huge_object_id_is_refused_and_every_subscriber_keeps_receiving(tmp_path, endpoint):
    """The probe's request, through the control path the view's API uses: refused with a reply naming the
    key; the SAM 2 stream's results keep coming, and a valid object is tracked after it."""
    from engine.testing.sam2_ref import CONFIG, SIZE, make_checkpoint
    ckpt = make_checkpoint(tmp_path / "c.pt")
    cfg = engine_config([{"id": "cam1", "url": "synthetic://shapes?size=160x120&fps=10"}], endpoint,
                        budget={"latency_ms": 3000},
                        models={"classify": None, "sam2": {"config": CONFIG, "checkpoint": str(ckpt), "image_size": SIZE,
                                                      "max_batch": 1}})
    eng = Engine(cfg)
    eng.start()
    col = Collector(endpoint, ["cam1"])
    import zmq
    col.sub._sock.setsockopt(zmq.SUBSCRIBE, b"sam2.")
    try:
        assert wait_for(lambda: eng.control({"op": "list"})["streams"]["cam1"].get("frame"), 60)
        for bad in (10**30, True, 2**31, -5, 2.0):
            reply = eng.control({"op": "add_object", "stream": "cam1", "id": bad, "box": [10, 10, 80, 60]})
            assert reply["ok"] is False and "add_object: id:" in reply["error"], (bad, reply)
        reply = eng.control({"op": "remove_object", "stream": "cam1", "id": 10**30})
        assert reply["ok"] is False and "'id' must be 0 <= id <= 2147483647" in reply["error"]
        assert eng.control({"op": "add_object", "stream": "cam1", "id": 2**31 - 1, "box": [10, 10, 80, 60]})["ok"]
        assert wait_for(lambda: any(m.get("objects") for m in list(col.msgs) if m["type"] == "sam2"), 60)
        assert eng.check_dead() is None and eng.publisher.health() is None
    finally:
        eng.stop()
    got = [m for m in col.wait(10) if m["type"] == "sam2" and m.get("objects")]
    assert got and got[-1]["objects"][0]["id"] == 2**31 - 1


class _Unencodable(NoopRunner):
    """Every 4th frame's result carries an integer msgpack cannot encode (a custom family's bug)."""

    def infer(self, inputs):
        out = super().infer(inputs)
        return [{"big": 10**30} if seq % 4 == 1 else f for seq, f in zip(inputs, out)]


def test_a_result_that_cannot_be_encoded_fails_that_frame_only(endpoint, caplog):
    n = 24
    cfg = engine_config([{"id": f"s{i}", "url": f"synthetic://shapes?size=64x64&fps=30&frames={n}",
                          "mode": "offline"} for i in range(2)], endpoint, publish={"min_subscribers": 1})
    col = Collector(endpoint, ["s0", "s1"])
    eng = Engine(cfg, models={"classify": [_Unencodable()]})
    with caplog.at_level(logging.ERROR, logger="vidar.publish"):
        eng.start()
        assert wait_for(eng.finished, 60)
        eng.stop()
    msgs = col.wait(10)
    bad = len([k for k in range(n) if k % 4 == 1])
    for s in ("s0", "s1"):
        published, dropped, failed, in_flight = _counts(eng, s)
        assert (published, failed, dropped, in_flight) == (n - bad, {"encode_error": bad}, {}, 0)
        seqs = [m["seq"] for m in msgs if m["type"] == "classify" and m["stream"] == s]
        assert seqs == [k for k in range(n) if k % 4 != 1]
        assert [m["kind"] for m in msgs if m["type"] == "event" and m["stream"] == s][-1] == "eos"
    assert eng.check_dead() is None
    # logged in aggregate (at most once per stream every LOG_EVERY_S), naming the stream and the error: fewer
    # lines than failed frames (one per frame would be `bad` lines a stream)
    from engine.publish.publisher import LOG_EVERY_S
    records = [r for r in caplog.records if "cannot be encoded" in r.getMessage()]
    lines = [r.getMessage() for r in records]
    for s in ("s0", "s1"):
        mine = [r for r in records if r.getMessage().startswith(f"stream {s}: ")]
        assert mine, lines  # the stream's failures are logged, naming it
        # in aggregate: each line counts the failures so far, and there are fewer lines than failures
        so_far = [int(r.getMessage().rsplit("(", 1)[1].split()[0]) for r in mine]
        assert so_far == sorted(set(so_far)) and so_far[-1] <= bad, (so_far, lines)
        assert len(mine) < bad, lines
        # the interval itself, from the records' own times (0.05 s for the wall clock against the monotonic one)
        gaps = [b.created - a.created for a, b in zip(mine, mine[1:])]
        assert all(g >= LOG_EVERY_S - 0.05 for g in gaps), (gaps, lines)
        assert "OverflowError" in mine[0].getMessage() and "(1 so far)" in mine[0].getMessage(), lines


def test_a_publisher_that_dies_is_engine_death_with_exit_3(endpoint, monkeypatch, caplog):
    from engine.publish.publisher import Publisher
    calls = []
    real = Publisher._serve_result

    def crash_on_the_fifth(self, box, item, now):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected publisher bug")
        return real(self, box, item, now)
    monkeypatch.setattr(Publisher, "_serve_result", crash_on_the_fifth)
    cfg = engine_config([{"id": "s0", "url": "synthetic://shapes?size=64x64&fps=30"}], endpoint,
                        budget={"latency_ms": 1000})
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    t0 = time.monotonic()
    with _SigintAfter(30), caplog.at_level(logging.ERROR):
        assert run(eng) == EXIT_DEAD
    assert time.monotonic() - t0 < 30
    assert "publisher thread crashed: RuntimeError: injected publisher bug" in eng.dead_reason
    assert "publisher thread crashed" in caplog.text
    published, dropped, failed, in_flight = _counts(eng, "s0")
    assert published <= 4 and in_flight == 0 and failed.get("engine_dead", 0) >= 1


def _crash_on_call(monkeypatch, cls, name: str, k: int, why: str) -> None:
    """cls.name raises RuntimeError(why) on its k-th call, and runs as it was otherwise."""
    real, calls = getattr(cls, name), []

    def patched(*args, **kwargs):
        calls.append(1)
        if len(calls) == k:
            raise RuntimeError(why)
        return real(*args, **kwargs)
    monkeypatch.setattr(cls, name, patched)


def _offline_run(endpoint, n: int, **engine_kwargs):
    """An engine over one offline stream of n frames (batches of 2 on one NoopRunner), run to the end."""
    cfg = engine_config([{"id": "s", "url": f"synthetic://shapes?size=64x64&fps=30&frames={n}", "mode": "offline"}],
                        endpoint, models={"classify": {"max_batch": 2}})
    eng = Engine(cfg, models={"classify": [NoopRunner()]}, **engine_kwargs)
    eng.start()
    try:
        assert wait_for(eng.finished, 60)
    finally:
        eng.stop()
    return eng


def test_a_dead_output_thread_is_replaced_and_results_go_on(endpoint, monkeypatch):
    from engine.executor.output_stage import OutputStage
    _crash_on_call(monkeypatch, OutputStage, "_emit_events", 3, "injected output-stage bug")
    n = 30
    eng = _offline_run(endpoint, n)
    published, dropped, failed, in_flight = _counts(eng, "s")
    assert eng.pools["classify"].output.replacements == 1 and eng.check_dead() is None
    assert published + sum(failed.values()) == n and set(failed) <= {"output_error"} and in_flight == 0
    assert published >= n - 2  # at most the batch in hand when the thread died


def test_a_dead_worker_thread_is_replaced(endpoint, monkeypatch):
    from engine.executor.worker_slots import WorkerSlots
    # raised in the worker thread before the batch was handed on
    _crash_on_call(monkeypatch, WorkerSlots, "_completed", 2, "injected worker-thread bug")
    n = 30
    eng = _offline_run(endpoint, n, model_factories={"classify": NoopRunner})
    published, dropped, failed, in_flight = _counts(eng, "s")
    assert eng.pools["classify"].slots.rebuilds == 1 and eng.check_dead() is None
    assert set(failed) == {"model_error"} and 1 <= failed["model_error"] <= 2
    assert published + failed["model_error"] == n and in_flight == 0


def test_the_view_encoder_is_restarted_then_fatal(monkeypatch):
    from engine.config import ViewConfig
    from engine.view import hub as hub_module
    crashes = []

    def crash(self):
        crashes.append(1)
        raise RuntimeError("injected encoder bug")
    monkeypatch.setattr(hub_module.ViewHub, "_run", crash)
    hub = hub_module.ViewHub(ViewConfig())
    try:
        for k in range(1, hub_module.RESTARTS):
            assert wait_for(lambda: not hub._encoder.thread.is_alive(), 5)
            assert hub.health() is None  # restarted
            assert wait_for(lambda: len(crashes) == k + 1, 5)
        assert wait_for(lambda: not hub._encoder.thread.is_alive(), 5)
        why = hub.health()
        assert why and "live view encoder keeps crashing" in why and "injected encoder bug" in why
    finally:
        hub.close()


def _control_cfg(endpoint):
    cfg = engine_config([{"id": "s0", "url": "synthetic://shapes?size=64x64&fps=30"}], endpoint,
                        budget={"latency_ms": 1000}, control={"enabled": True,
                                                             "endpoint": f"tcp://127.0.0.1:{free_port()}"})
    return cfg


def test_a_control_socket_task_that_ends_is_restarted(endpoint, monkeypatch):
    from engine.control import control_socket as control
    from engine.control.control_socket import request
    real, calls = control.serve, []

    async def crash_first(engine, sock, stop):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected control-plane bug")
        await real(engine, sock, stop)
    monkeypatch.setattr(control, "serve", crash_first)
    cfg = _control_cfg(endpoint)
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    replies = []

    def client():
        replies.append(request(cfg.control.endpoint, {"op": "list"}, timeout=20))
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=client, daemon=True).start()
    with _SigintAfter(40):
        assert run(eng) == EXIT_OK
    assert len(calls) == 2 and replies and replies[0]["ok"] and "s0" in replies[0]["streams"]


def test_a_control_socket_that_keeps_crashing_is_engine_death(endpoint, monkeypatch, caplog):
    from engine.control import control_socket as control

    async def crash(engine, sock, stop):
        raise RuntimeError("injected control-plane bug")
    monkeypatch.setattr(control, "serve", crash)
    eng = Engine(_control_cfg(endpoint), models={"classify": [NoopRunner()]})
    with _SigintAfter(30), caplog.at_level(logging.ERROR):
        assert run(eng) == EXIT_DEAD
    assert re.search(r"control socket keeps crashing: control socket: 3 crashes within 60 s "
                     r"\(last: RuntimeError: injected control-plane bug\)", caplog.text)


# -- 5. an add is all or nothing --------------------------------------------------------------------------
@pytest.mark.parametrize("url, error", [
    ("synthetic://shapes?size=64x64&fps=5&seed=-2", "synthetic parameter seed='-2'"),
    ("synthetic://shapes?size=64x64&fps=5&frames=-1", "synthetic parameter frames='-1'"),
    ("synthetic://shapes?size=99999x64", "synthetic parameter size='99999x64'"),
    ("tcp://0.0.0.0:9123?listen=1", "this URL makes the engine listen on '0.0.0.0'"),
])
def test_a_refused_add_leaves_nothing_behind(endpoint, url, error):
    cfg = engine_config([{"id": "s0", "url": "synthetic://shapes?size=64x64&fps=30"}], endpoint,
                        budget={"latency_ms": 1000}, view={"enabled": True, "port": 0})
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    eng.start()
    try:
        threads = threading.active_count()
        reply = eng.control({"op": "add_stream", "stream": {"id": "cam9", "url": url}})
        assert reply["ok"] is False and error in reply["error"] and "internal error" not in reply["error"]
        assert set(eng.control({"op": "list"})["streams"]) == {"s0"}  # not listed, nothing registered
        assert "cam9" not in eng.streams and not eng.view.known("cam9")
        assert eng.pools["classify"].acct.snapshot("cam9").ingested == 0
        assert threading.active_count() == threads  # no decoder thread was started
        ok = eng.control({"op": "add_stream", "stream": {"id": "cam9", "url": "synthetic://shapes?size=64x64&fps=30"}})
        assert ok["ok"], ok  # its id is free
        assert wait_for(lambda: eng.pools["classify"].acct.snapshot("cam9").published > 0, 20)
    finally:
        eng.stop()


def test_an_unexpected_error_while_adding_is_refused_and_leaves_nothing(endpoint, monkeypatch):
    import engine.core.stream_table as st

    def broken(*a, **k):
        raise ValueError("a source's own bug opening rtsp://u:hunter2@h/x?password=hunter3")
    monkeypatch.setattr(st, "open_source", broken)
    cfg = engine_config([], endpoint, control={"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"})
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    eng.start()
    try:
        reply = eng.control({"op": "add_stream", "stream": {"id": "cam9", "url": "synthetic://shapes"}})
        assert reply["ok"] is False and "internal error: ValueError" in reply["error"]
        assert "hunter2" not in reply["error"] and "hunter3" not in reply["error"]
        assert eng.control({"op": "list"})["streams"] == {} and eng.streams == {}
    finally:
        eng.stop()


def test_a_bad_stream_in_the_config_is_a_configuration_error(endpoint):
    cfg = engine_config([{"id": "s0", "url": "synthetic://shapes?seed=-2"}], endpoint)
    with pytest.raises(ConfigError, match=r"streams.0 \(s0\): stream.url: synthetic parameter seed='-2'"):
        Engine(cfg, models={"classify": [NoopRunner()]}).start()


# -- 8. one rule for every listening socket; strong tokens; /metrics guarded ------------------------------
STRONG = "Zq7FLTpC9xx693OuVaQ0SOYG_MG9O5_x"


@pytest.mark.parametrize("patch, error", [
    ({}, None),
    ({"control": {"endpoint": "tcp://0.0.0.0:5557"}}, r"control\.endpoint='tcp://0\.0\.0\.0:5557' \(set security\.curve"),
    ({"control": {"endpoint": "tcp://*:5557"}}, r"control\.endpoint='tcp://\*:5557'"),
    ({"control": {"endpoint": "tcp://eth0:5557"}}, r"control\.endpoint='tcp://eth0:5557'"),
    ({"control": {"endpoint": "tcp://0.0.0.0:5557", "enabled": False}}, None),
    ({"control": {"endpoint": "ipc:///tmp/vidar-ctl"}}, None),
    ({"control": {"endpoint": "tcp://[::1]:5557"}}, None),
    ({"publish": {"endpoint": "tcp://192.168.1.5:5556"}}, r"publish\.endpoint='tcp://192\.168\.1\.5:5556'"),
    ({"metrics": {"host": "0.0.0.0"}}, r"metrics\.host='0\.0\.0\.0' \(set metrics\.token"),
    ({"metrics": {"host": "0.0.0.0", "token": STRONG}}, None),
    ({"metrics": {"host": "0.0.0.0", "enabled": False}}, None),
    ({"view": {"enabled": True, "host": "0.0.0.0"}}, r"view\.host='0\.0\.0\.0' \(set view\.token"),
    ({"view": {"enabled": True, "host": "::"}}, r"view\.host='::'"),
    ({"view": {"enabled": True, "host": "0.0.0.0", "token": STRONG}}, None),
    ({"cluster": {"publish": {"endpoint": "tcp://0.0.0.0:5556"}}}, r"cluster\.publish\.endpoint='tcp://0\.0\.0\.0:5556'"),
    ({"control": {"endpoint": "tcp://0.0.0.0:5557"}, "metrics": {"host": "0.0.0.0"},
      "security": {"allow_insecure_bind": True}}, None),
    ({"view": {"token": " " * 16}}, r"view\.token: the token is too weak \(about 8 bits by zxcvbn's patterns, at least 64"),
    ({"view": {"token": "ab" * 12}}, r"view\.token: the token is too weak"),
    ({"metrics": {"token": "aaaaaaaaaaaaaaaaaaaaaaaa"}}, r"metrics\.token: the token is too weak"),
    ({"view": {"token": "a" * 96}}, r"view\.token: the token is too weak"),            # long, one character
    ({"view": {"token": "0123456789" * 3}}, r"view\.token: the token is too weak"),     # a sequence, repeated
    ({"view": {"token": "abcdefghijklmnopqrstuvwxyz0123"}}, r"view\.token: the token is too weak"),
    ({"view": {"token": "auto"}, "metrics": {"token": "auto"}}, None),
    # a stream URL that makes FFmpeg listen is a listening socket too
    ({"streams": [{"id": "a", "url": "tcp://0.0.0.0:9000?listen=1"}]}, r"streams\.0\.url: this URL makes the engine listen on '0\.0\.0\.0'"),
    ({"streams": [{"id": "a", "url": "srt://:9000?mode=listener"}]}, r"streams\.0\.url: this URL makes the engine listen on '\*'"),
    ({"streams": [{"id": "a", "url": "tcp://127.0.0.1:9000?listen=1"}]}, None),
    ({"streams": [{"id": "a", "url": "srt://cam:9000?mode=caller"}]}, None),
    ({"streams": [{"id": "a", "url": "tcp://0.0.0.0:9000?listen=1"}], "security": {"allow_insecure_bind": True}}, None),
], ids=lambda v: str(v)[:48])
def test_every_listening_socket_on_a_network_needs_its_guard(patch, error):
    tree = {"streams": [{"id": "a", "url": "synthetic://shapes"}], "view": {"enabled": False}, **patch}
    if error is None or "streams" in patch:  # and the same URL at run time, through add_stream
        for s in patch.get("streams", []):
            from engine.security.binds import stream_exposure_error
            assert (stream_exposure_error(s["url"], tree.get("security", {}).get("allow_insecure_bind", False))
                    is None) == (error is None)
    if error is None:
        build_config(tree, cuda_available=True)
    else:
        with pytest.raises(ConfigError, match=error):
            build_config(tree, cuda_available=True)


def test_random_tokens_of_16_bytes_always_pass():
    """Real draws of `secrets` (a seeded 1,000-draw check, 12 bytes too: tests/security/test_hostile_input.py)."""
    import secrets

    from engine.security.binds import MIN_TOKEN_BITS, token_bits
    for make in (secrets.token_urlsafe, secrets.token_hex):
        assert min(token_bits(make(16)) for _ in range(300)) >= MIN_TOKEN_BITS


def test_an_allowed_insecure_bind_warns_at_every_start(endpoint, caplog):
    cfg = engine_config([{"id": "s0", "url": "synthetic://shapes?size=64x64&fps=30"}],
                        f"tcp://0.0.0.0:{free_port()}", security={"allow_insecure_bind": True})
    for _ in range(2):
        caplog.clear()
        eng = Engine(cfg, models={"classify": [NoopRunner()]})
        with caplog.at_level(logging.WARNING, logger="vidar.engine"):
            eng.start()
        eng.stop()
        assert "listening on the network WITHOUT authentication: publish.endpoint='tcp://0.0.0.0:" in caplog.text


def test_a_config_built_without_checks_is_refused_at_start(endpoint):
    """A cluster's engines are configured with model_copy (no pydantic checks): Engine.start checks again."""
    cfg = engine_config([], endpoint, control={"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"})
    cfg = cfg.model_copy(update={"publish": cfg.publish.model_copy(update={"endpoint": "tcp://0.0.0.0:0"})})
    with pytest.raises(ConfigError, match=r"publish\.endpoint='tcp://0\.0\.0\.0:0'"):
        Engine(cfg, models={"classify": [NoopRunner()]}).start()


def _get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.parametrize("token", [None, STRONG])
def test_metrics_check_the_host_or_the_token(endpoint, token):
    port = free_port()
    cfg = engine_config([{"id": "s0", "url": "synthetic://shapes?size=64x64&fps=30"}], endpoint,
                        metrics={"enabled": True, "port": port, "token": token})
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    eng.start()
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        status, body = _get(url, auth)
        assert status == 200 and "vidar_frames_ingested" in body
        # a DNS-rebinding page names its own host: refused without a token (with one, the token decides)
        status, body = _get(url, {"Host": "evil.example:80", **auth})
        assert (status, "loopback" in body) == ((200, False) if token else (403, True))
        if token:
            assert _get(url)[0] == 401
            assert _get(url, {"Authorization": f"Bearer {token}x"})[0] == 401
            assert _get(url, {"Authorization": "Bearer \xff\xfe"})[0] == 401
    finally:
        eng.stop()


def _metrics_engine(endpoint, monkeypatch, timeout_s: float):
    """A started engine with no stream, serving /metrics on a free port with this read deadline."""
    from engine.publish import metrics
    monkeypatch.setattr(metrics._Handler, "timeout", timeout_s)
    port = free_port()
    cfg = engine_config([], endpoint, metrics={"enabled": True, "port": port},
                        control={"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"})
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    eng.start()
    return eng, port


def test_slow_metrics_clients_are_cut_off_and_capped(endpoint, monkeypatch):
    from engine.publish import metrics
    eng, port = _metrics_engine(endpoint, monkeypatch, timeout_s=2.0)
    slow = []
    try:
        threads = threading.active_count()
        for _ in range(2 * metrics.MAX_CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            slow.append(s)
        time.sleep(0.2)
        assert threading.active_count() <= threads + metrics.MAX_CONNECTIONS  # one thread each, capped
        assert wait_for(lambda: eng.metrics._server.refused >= metrics.MAX_CONNECTIONS, 5)
        for s in slow:  # every slow client is closed: at once (over the cap) or after the read timeout
            s.settimeout(5)
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
        assert wait_for(lambda: _get(f"http://127.0.0.1:{port}/metrics")[0] == 200, 10)
        assert wait_for(lambda: threading.active_count() <= threads + 1, 10)
    finally:
        for s in slow:
            s.close()
        eng.stop()


# -- 9. frame memory: one engine-wide bound -------------------------------------------------------------
def test_frame_memory_is_capped_engine_wide(endpoint, clip48):
    # 640x360 frames: 0.66 MB; memory_mb 1 -> min_slots 4 -> 2.6 MB a stream; 6 MB fit two
    cfg = engine_config([], endpoint, budget={"latency_ms": 1000}, control={"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"},
                        ring={"memory_mb": 1, "min_slots": 4, "max_slots": 5, "total_memory_mb": 6},
                        models={"classify": {"max_batch": 2}})
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    eng.start()
    budget = eng.table.frame_budget
    try:
        add = lambda sid, url: eng.control({"op": "add_stream", "stream": {"id": sid, "url": url}})
        url = "synthetic://shapes?size=640x360&fps=30"
        assert add("a", url)["ok"] and add("b", url)["ok"]
        reply = add("c", url)
        assert reply["ok"] is False
        assert re.search(r"4 ring slots of 640x360 frames need 3 MB of ring memory; ring.total_memory_mb=6 has 1 MB "
                         r"left for it: .* raise ring.total_memory_mb", reply["error"]), reply
        assert set(eng.control({"op": "list"})["streams"]) == {"a", "b"}
        # a source whose size is known only once it opens (a file) fails at its first frame, alone
        col = Collector(endpoint, ["f"])
        assert eng.publisher.wait_subscribers(1, 10)
        assert add("f", str(clip48))["ok"]
        assert wait_for(lambda: any(m["type"] == "event" and m["stream"] == "f" and m["kind"] == "error"
                                    for m in list(col.msgs)), 20)
        err = next(m for m in col.msgs if m["type"] == "event" and m["stream"] == "f" and m["kind"] == "error")
        assert "ring.total_memory_mb" in err["reason"]
        a0 = eng.pools["classify"].acct.snapshot("a").published
        assert wait_for(lambda: eng.pools["classify"].acct.snapshot("a").published > a0 + 5, 20)  # the others run on
        used = budget.used_bytes()
        assert used <= 6 * 2**20 and set(budget.by_stream()) == {"a", "b"}
        # a removed stream gives its memory back: the refused one fits now
        assert eng.control({"op": "remove_stream", "stream": "b"})["ok"]
        assert wait_for(lambda: set(budget.by_stream()) == {"a"}, 10)
        assert add("c", url)["ok"]
    finally:
        eng.stop()


# -- 11. the documented CURVE snippet (docs/security.md) is a config that starts -----------------------------------------------
def test_the_readme_curve_snippet_starts(tmp_path, monkeypatch, endpoint):
    from engine.security.keys import create_keys
    readme = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    block = readme.split("CURVE, in short:", 1)[1]
    snippet = re.search(r"```yaml\n(.*?)```", block, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    create_keys("keys")  # `vidar keys keys/` and the snippet's mkdir + cp, as the README says
    (tmp_path / "keys" / "allowed").mkdir()
    (tmp_path / "keys" / "allowed" / "client.key").write_bytes((tmp_path / "keys" / "client.key").read_bytes())
    tree = yaml.safe_load(snippet)
    tree.update({"streams": [{"id": "cam1", "url": "synthetic://shapes?size=64x64&fps=30"}],
                 "publish": {"endpoint": endpoint}, "metrics": {"enabled": False},
                 "control": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}})
    tree.setdefault("view", {})["port"] = 0
    cfg, _ = build_config(tree, cuda_available=True)
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    eng.start()
    eng.stop()


# -- 7. the control socket under a flood of connections that never handshake --------------------------------
def _vidar_run(tmp_path, limits):
    """`vidar run` as a child with RLIMIT_NOFILE set to `limits`; (process, control endpoint)."""
    import resource
    import subprocess
    import sys
    ctl = f"tcp://127.0.0.1:{free_port()}"
    cfg = {"streams": [{"id": "cam1", "url": "synthetic://shapes?size=64x48&fps=5"}],
           "models": {"classify": {"name": "test_vit", "weights": "random", "max_batch": 1, "device": "cpu"}},
           "publish": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}, "metrics": {"enabled": False},
           "status": {"interval_s": 30}, "control": {"endpoint": ctl}, "view": {"enabled": False}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits))
    return proc, ctl


def _answers(ctl, timeout):
    from engine.control.control_socket import request
    try:
        return request(ctl, {"op": "list"}, timeout=timeout)["ok"]
    except TimeoutError:
        return False


def test_vidar_run_raises_its_descriptor_limit_to_the_hard_one(tmp_path):
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 88:
        pytest.skip(f"the hard descriptor limit here is {hard}")
    proc, ctl = _vidar_run(tmp_path, (88, hard))
    try:
        assert wait_for(lambda: _answers(ctl, 1.0), 60, step=0.2)
        line = next(x for x in Path(f"/proc/{proc.pid}/limits").read_text().splitlines() if "open files" in x)
        soft = line.split()[3]
        assert soft == (str(hard) if hard != resource.RLIM_INFINITY else str(1 << 20)), line
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_connections_that_never_handshake_cannot_starve_the_control_socket(tmp_path):
    """Raw TCP connections to the control port that never speak ZeroMQ, enough to take every descriptor
    under a limit of 88 (soft and hard: nothing to raise): the control socket answers again once ZeroMQ
    has closed them (binds.ZMQ_HANDSHAKE_MS), the engine runs on and exits 0 on Ctrl-C."""
    from engine.security.binds import ZMQ_HANDSHAKE_MS as HANDSHAKE_MS
    proc, ctl = _vidar_run(tmp_path, (88, 88))
    socks = []
    try:
        assert wait_for(lambda: _answers(ctl, 1.0), 60, step=0.2), proc.stderr.read() if proc.poll() else ""
        port = int(ctl.rsplit(":", 1)[1])
        for _ in range(200):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:  # the engine has no descriptor left to accept with: the flood is at its worst
                break
        t0 = time.monotonic()
        assert wait_for(lambda: _answers(ctl, 1.0), HANDSHAKE_MS / 1e3 + 10, step=0.1)
        assert time.monotonic() - t0 < HANDSHAKE_MS / 1e3 + 10 and proc.poll() is None
    finally:
        for s in socks:
            s.close()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]


def test_ring_memory_stays_within_its_reservation_across_size_changes():
    """One huge frame, then small ones (a source that changes resolution): what the ring holds never
    exceeds what it reserved in the engine's budget, and the reservation follows it down."""
    import numpy as np

    from engine.frames.accounting import Accounting
    from engine.frames.lifecycle import FrameMeta
    from engine.frames.budget import MB, FrameMemoryBudget
    from engine.frames.ring import FrameRing
    budget = FrameMemoryBudget(64 * MB)
    ring = FrameRing("s", live=True, accounting=Accounting("p"), memory_bytes=4 * MB, min_slots=4, max_slots=8,
                     max_frame_pixels=2048 * 2048, budget=budget)

    def write(h, w, seq):
        assert ring.write(FrameMeta("s", seq, seq / 30, time.time()), np.zeros((h, w, 3), np.uint8))
        assert ring.allocated_bytes() <= budget.used_bytes(), (seq, ring.allocated_bytes(), budget.used_bytes())
    write(1024, 1024, 0)
    held = ring.take_ready()  # the huge frame stays claimed (a worker has it)
    for seq in range(1, 40):
        write(64, 64, seq)
        for fv in ring.take_ready():
            fv.release()
    assert budget.used_bytes() >= 1024 * 1024 * 3  # the claimed huge frame is still covered
    for fv in held:
        fv.release()
    assert ring.allocated_bytes() <= 4 * 64 * 64 * 3 and budget.used_bytes() == 4 * 64 * 64 * 3
    ring.close()
    assert budget.used_bytes() == 0


def test_an_add_whose_decoder_thread_cannot_start_is_undone(endpoint, monkeypatch):
    """Out of threads (RuntimeError: can't start new thread) after the stream was registered: the add is
    refused and undone (no entry, ring, view slot or reservation), and the id can be added again."""
    from engine.frames.ingest import IngestThread
    cfg = engine_config([], endpoint, view={"enabled": True, "port": 0},
                        control={"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"})
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    eng.start()
    try:
        real = IngestThread.start

        def no_thread(self):
            raise RuntimeError("can't start new thread")
        monkeypatch.setattr(IngestThread, "start", no_thread)
        url = "synthetic://shapes?size=64x64&fps=30"
        reply = eng.control({"op": "add_stream", "stream": {"id": "cam9", "url": url}})
        assert reply["ok"] is False and "could not be started: RuntimeError: can't start new thread" in reply["error"]
        assert eng.streams == {} and eng.control({"op": "list"})["streams"] == {}
        assert "cam9" not in eng.pools["classify"].rings and not eng.view.known("cam9")
        assert eng.table.frame_budget.used_bytes() == 0
        monkeypatch.setattr(IngestThread, "start", real)
        assert eng.control({"op": "add_stream", "stream": {"id": "cam9", "url": url}})["ok"]
        assert wait_for(lambda: eng.pools["classify"].acct.snapshot("cam9").published > 0, 20)
    finally:
        eng.stop()


def test_a_metrics_client_that_trickles_is_cut_at_the_deadline(endpoint, monkeypatch):
    """One header byte at a time, each well within a per-read timeout: the connection is still closed at
    the deadline, so 32 such clients cannot hold /metrics for ever. `Host: [` is a 400, not a traceback."""
    eng, port = _metrics_engine(endpoint, monkeypatch, timeout_s=2.0)
    try:
        s = socket.create_connection(("127.0.0.1", port))
        t0, closed = time.monotonic(), False
        for ch in b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200:
            try:
                s.sendall(bytes([ch]))
            except OSError:
                closed = True
                break
            s.settimeout(0.4)
            try:
                if s.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
            if time.monotonic() - t0 > 20:
                break
        assert closed and time.monotonic() - t0 < 2.0 + 5, time.monotonic() - t0
        s.close()
        status, body = _get(f"http://127.0.0.1:{port}/metrics", {"Host": "["})
        assert status == 400 and "not a host name" in body
    finally:
        eng.stop()


def test_a_control_task_that_died_mid_request_answers_it_when_restarted(endpoint, monkeypatch):
    """The task dies between a request's recv and its reply: restarted, it answers that request with an
    error, and the next one normally."""
    from engine.control import control_socket as control
    from engine.control.control_socket import request
    real, calls = control.encode_reply, []

    def crash_once(reply):
        calls.append(1)
        if len(calls) == 1:  # the first real reply
            raise RuntimeError("injected bug while replying")
        return real(reply)
    monkeypatch.setattr(control, "encode_reply", crash_once)
    cfg = _control_cfg(endpoint)
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    replies = []

    def client():
        try:
            replies.append(request(cfg.control.endpoint, {"op": "list"}, timeout=20))
            replies.append(request(cfg.control.endpoint, {"op": "list"}, timeout=20))
        finally:
            os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=client, daemon=True).start()
    with _SigintAfter(60):
        assert run(eng) == EXIT_OK
    assert len(replies) == 2, replies
    assert replies[0]["ok"] is False and "the control socket restarted" in replies[0]["error"]
    assert replies[1]["ok"] and "s0" in replies[1]["streams"]


@pytest.mark.parametrize("token, printed", [("auto", True), (STRONG, False)])
def test_only_a_generated_metrics_token_is_printed(tmp_path, token, printed):
    import subprocess
    import sys
    cfg = {"streams": [{"id": "s", "url": "synthetic://shapes?size=64x48&fps=30&frames=3", "mode": "offline"}],
           "models": {"classify": {"name": "test_vit", "weights": "random", "max_batch": 1, "device": "cpu"}},
           "publish": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}, "control": {"enabled": False},
           "metrics": {"port": free_port(), "token": token}, "view": {"enabled": False}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "engine.cli", "run", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("Authorization: Bearer" in r.stdout) is printed
    assert STRONG not in r.stdout + r.stderr
