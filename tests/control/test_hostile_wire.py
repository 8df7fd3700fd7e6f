"""Hostile input round two, on the wire (issue 31 items 1, 2, 9): every ZeroMQ message shape a client can
send to a control socket is answered or counted and never crashes it; a raw TCP peer or a subscriber that
stops reading costs only itself; IPv6 endpoints bind or are refused clearly; an engine that dies says why in
every eos. Each against a running engine."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import msgpack
import psutil
import pytest
import zmq

from engine.config import build_config
from engine.control.control_socket import request
from engine.control.runtime import EXIT_DEAD, EXIT_OK, run
from engine.core.engine import Engine
from engine.errors import ConfigError
from engine.models.noop import NoopRunner
from engine.publish.client import Subscriber
from engine.security.keys import create_keys
from engine.testing.wait import wait_for
from tests.support.engines import engine_config
from tests.support.net import free_port

pytestmark = pytest.mark.timeout(120)

LIST = msgpack.packb({"op": "list"})


class _SigintAfter:
    """`run()` must end by itself or by the test's SIGINT; past `seconds`, SIGINT ends it (a hang fails, not
    pytest's timeout)."""

    def __init__(self, seconds: float):
        self._timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
        self._timer.daemon = True

    def __enter__(self):
        self._timer.start()

    def __exit__(self, *exc):
        self._timer.cancel()


@pytest.fixture
def curve_keys(tmp_path):
    create_keys(str(tmp_path / "k"))
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(tmp_path / "k" / "client.key", allowed / "client.key")
    return tmp_path


def _recv(sock, timeout_s: float):
    return sock.recv_multipart() if sock.poll(int(timeout_s * 1000)) else None


def _attacks(ctx, ctl, curve) -> dict[str, tuple]:
    """Every envelope shape of the report, each answered (or not) as it can be. name -> (socket, frames sent)."""
    def sock(kind):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            from engine.security.keys import client_socket
            client_socket(s, *curve)
        s.connect(ctl)
        return s
    out = {}
    s = sock(zmq.REQ)
    s.send_multipart([LIST] * 4)  # one REQ message of four parts: alone it killed the engine (exit 3)
    out["req_four_parts"] = s
    for name, frames in (("dealer_no_delimiter", [LIST]), ("dealer_empty_only", [b""]),
                         ("dealer_fifty_parts", [b""] + [LIST] * 49), ("dealer_no_delimiter_many", [LIST] * 3),
                         ("dealer_not_msgpack", [b"", b"\xc1"])):
        s = sock(zmq.DEALER)
        s.send_multipart(frames)
        out[name] = s
    return out


@pytest.mark.parametrize("with_curve", [False, True], ids=["plain", "curve"])
def test_no_message_shape_crashes_the_control_socket(endpoint, curve_keys, with_curve, caplog):
    """REQ with several parts, DEALER without the delimiter, with only the delimiter, with 50 parts, and a
    payload that is not msgpack: each gets an error reply, none crashes the control task (before the fix:
    EFSM, task restarted, three of them engine death, exit 3), each is counted and logged in aggregate,
    and a well-formed request is answered after them."""
    security, curve = {}, None
    if with_curve:
        k = curve_keys / "k"
        security = {"security": {"curve": True, "server_key": str(k / "server.key_secret"),
                                 "authorized_clients": str(curve_keys / "allowed")}, "view": {"enabled": False}}
        curve = (str(k / "client.key_secret"), str(k / "server.key"))
    ctl = f"tcp://127.0.0.1:{free_port()}"
    cfg = engine_config([{"id": "s0", "url": "synthetic://shapes?size=64x64&fps=30"}], endpoint,
                        budget={"latency_ms": 1000}, control={"enabled": True, "endpoint": ctl}, **security)
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    replies, problems = {}, []

    def client():
        ctx = zmq.Context.instance()
        try:
            assert wait_for(lambda: eng.state == "running", 30)
            socks = _attacks(ctx, ctl, curve)
            for name, s in socks.items():
                replies[name] = _recv(s, 10)
                s.close(0)
            for _ in range(3):  # the engine still answers, and would have died by now
                replies.setdefault("after", []).append(request(ctl, {"op": "list"}, timeout=10, curve=curve))
        except BaseException as err:  # noqa: BLE001 - reported by the test body
            problems.append(err)
        finally:
            os.kill(os.getpid(), signal.SIGINT)
    t = threading.Thread(target=client, daemon=True)
    t.start()
    with _SigintAfter(60), caplog.at_level(logging.WARNING):
        code = run(eng)
    t.join(10)
    assert not problems, problems
    assert code == EXIT_OK, caplog.text[-2000:]
    assert all(r["ok"] and "s0" in r["streams"] for r in replies["after"])
    unpack = lambda frames: msgpack.unpackb(frames[-1], raw=False)  # noqa: E731
    assert "has 4" in unpack(replies["req_four_parts"])["error"]  # the REQ client reads it as its reply
    assert replies["dealer_no_delimiter"][0] != b"" and "no delimiter" in unpack(replies["dealer_no_delimiter"])["error"]
    assert replies["dealer_empty_only"][0] == b"" and "has none" in unpack(replies["dealer_empty_only"])["error"]
    assert "has 49" in unpack(replies["dealer_fifty_parts"])["error"]
    assert "no delimiter" in unpack(replies["dealer_no_delimiter_many"])["error"]
    assert "not valid msgpack" in unpack(replies["dealer_not_msgpack"])["error"]
    assert eng.control_socket.malformed == 6
    assert "crashed" not in caplog.text and "restarted" not in caplog.text
    lines = [r for r in caplog.records if "refused a malformed request" in r.getMessage()]
    assert lines, "malformed requests were never logged"
    assert len(lines) < eng.control_socket.malformed  # counted every time, logged in aggregate (not once each)


def test_raw_peers_are_closed_on_every_socket_and_silent_clients_on_the_control_socket(endpoint, monkeypatch):
    """A raw peer sending a ZMTP 1.0 greeting (`01 00`) was a subscriber of everything that never read, and
    held a control-socket descriptor for ever: now both sockets close it at once. A client that completes
    ZeroMQ's handshake and never sends a request is closed after the handshake limit."""
    import engine.security.sockets as sockets
    monkeypatch.setattr(sockets, "ZMQ_HANDSHAKE_MS", 1500)  # the limit, shortened for the test
    ctl = f"tcp://127.0.0.1:{free_port()}"
    cfg = engine_config([{"id": "s0", "url": "synthetic://shapes?size=64x64&fps=30"}], endpoint,
                        control={"enabled": True, "endpoint": ctl})
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    eng.start()
    from tests.support.control import ControlServer
    server = ControlServer(eng)
    raws = []
    try:
        for ep in (endpoint, ctl):
            port = int(ep.rsplit(":", 1)[1])
            raw = socket.create_connection(("127.0.0.1", port), timeout=5)
            raw.sendall(b"\x01\x00")
            raws.append(raw)
        for raw in raws:
            t0 = time.monotonic()
            while (data := raw.recv(4096)) != b"":  # whatever ZeroMQ sends first, then the close
                pass
            assert time.monotonic() - t0 < 1.0
        # a ZeroMQ client that says nothing on the control socket: closed after the limit
        port = int(ctl.rsplit(":", 1)[1])
        me = psutil.Process()
        silent = zmq.Context.instance().socket(zmq.DEALER)
        silent.setsockopt(zmq.LINGER, 0)
        silent.setsockopt(zmq.RECONNECT_IVL, 60_000)  # so that a closed connection stays closed for the check
        silent.connect(ctl)
        connected = lambda: any(c.raddr and c.raddr.port == port and c.status == "ESTABLISHED"  # noqa: E731
                                for c in me.net_connections("tcp"))
        assert wait_for(connected, 5)
        t0 = time.monotonic()
        assert wait_for(lambda: not connected(), 10)
        assert eng.control_socket.watch.closed_idle >= 1
        silent.close(0)
        assert request(ctl, {"op": "list"})["ok"]  # a client that asks stays served
    finally:
        for raw in raws:
            raw.close()
        server.close()
        eng.stop()


_HUNG_SUB = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.SUB)
s.setsockopt(zmq.RCVHWM, 10)
s.setsockopt(zmq.RCVBUF, 4096)
s.connect(sys.argv[1])
s.setsockopt(zmq.SUBSCRIBE, b"")
s.recv_multipart()
print("subscribed", flush=True)
sys.stdin.read()  # then reads nothing more: SIGSTOP makes it a hung client
"""


def test_a_subscriber_that_stops_reading_costs_only_itself(endpoint, caplog):
    """Live streams, one good subscriber, a raw ZMTP 1.0 peer and a hung client (a subscriber process
    stopped with SIGSTOP): the good subscriber receives every result the engine published (before the fix,
    nothing for as long as the hung one was full), the hung one is named in the log with how long it has
    been full, and what it missed is counted."""
    streams = [{"id": f"s{i}", "url": "synthetic://shapes?size=32x32&fps=250"} for i in range(4)]
    cfg = engine_config(streams, endpoint, budget={"latency_ms": 2000},
                        publish={"hwm": 20, "min_subscribers": 1})
    ctx = zmq.Context()
    ctx.setsockopt(zmq.SNDBUF, 16384)  # the kernel buffers a hung peer fills before its queue does: small, fast
    eng = Engine(cfg, models={"classify": [NoopRunner()]}, ctx=ctx)
    good = Subscriber(endpoint, ["classify.", "event."])
    got: dict[str, list[int]] = {}
    stop = threading.Event()

    def read():  # until stopped and drained: the last results may still be in ZeroMQ's queues at the stop
        while True:
            msg = good.recv(0.5)
            if msg is None:
                if stop.is_set():
                    return
            elif msg["type"] == "classify":
                got.setdefault(msg["stream"], []).append(msg["seq"])
    reader = threading.Thread(target=read)
    starter = threading.Thread(target=eng.start)  # waits for the good subscriber (min_subscribers)
    starter.start()
    reader.start()
    starter.join(30)
    # after the start: the engine waited for the good subscriber alone (min_subscribers), so it has every result
    hung = subprocess.Popen([sys.executable, "-c", _HUNG_SUB, endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    raw = None
    try:
        assert eng.state == "running"
        assert hung.stdout.readline().strip() == "subscribed"
        port = next(c.laddr.port for c in psutil.Process(hung.pid).net_connections("tcp")
                    if c.raddr and c.raddr.port == int(endpoint.rsplit(":", 1)[1]))
        os.kill(hung.pid, signal.SIGSTOP)
        raw = socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
        raw.sendall(b"\x01\x00")
        with caplog.at_level(logging.WARNING, logger="vidar.publish"):
            assert wait_for(lambda: eng.publisher.slow_subscribers(), 30)  # it filled and is named
            time.sleep(3)  # the good subscriber must go on receiving meanwhile
            slow = eng.publisher.slow_subscribers()
    finally:
        if raw is not None:
            raw.close()
        eng.stop()
        stop.set()
        reader.join(10)
        good.close()
        os.kill(hung.pid, signal.SIGCONT)
        hung.kill()
        hung.communicate(timeout=10)
        ctx.term()
    assert slow and slow[0]["peer"] == f"127.0.0.1:{port}", slow
    assert re.search(rf"subscriber 127\.0\.0\.1:{port} is not reading: its queue has been full for \d+ s", caplog.text)
    missed = sum(eng.publisher.stats.missed.values())
    assert missed > 0
    for i in range(4):
        s = eng.pools["classify"].acct.snapshot(f"s{i}")
        seqs = got.get(f"s{i}", [])
        # every result the engine published reached the good subscriber, in order, none twice
        assert len(seqs) == s.published > 100 and seqs == sorted(set(seqs)), (i, len(seqs), s.published)


def test_ipv6_endpoints_bind_and_zone_ids_are_refused(tmp_path):
    """`tcp://[::1]:P` passed the bind rule and then failed to bind ("another vidar running?"): libzmq needs
    ZMQ_IPV6 for it. A zone id (`::1%lo`) passed the rule and failed to bind: refused when the config is read."""
    pub, ctl = f"tcp://[::1]:{free_port()}", f"tcp://[::1]:{free_port()}"
    cfg = engine_config([{"id": "s0", "url": "synthetic://shapes?size=64x64&fps=30"}], pub,
                        control={"enabled": True, "endpoint": ctl})
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    eng.start()
    from tests.support.control import ControlServer
    server = ControlServer(eng)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.IPV6, 1)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"classify.")
    try:
        assert sub.poll(10_000) and msgpack.unpackb(sub.recv_multipart()[1])["stream"] == "s0"
        req = zmq.Context.instance().socket(zmq.REQ)
        req.setsockopt(zmq.IPV6, 1)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(ctl)
        req.send(LIST)
        assert req.poll(10_000) and msgpack.unpackb(req.recv())["ok"]
        req.close(0)
    finally:
        sub.close(0)
        server.close()
        eng.stop()
    base = {"streams": [], "models": {"classify": {"name": "test_vit", "weights": "random", "device": "cpu"}}}
    for tree, key in ((dict(base, view={"host": "::1%lo"}), "view.host"),
                      (dict(base, metrics={"host": "::1%lo"}), "metrics.host"),
                      (dict(base, publish={"endpoint": "tcp://[::1%lo]:5556"}), "publish.endpoint")):
        with pytest.raises((ConfigError, ValueError), match=re.escape(key) + r".*zone ids"):
            build_config(tree, cuda_available=False)


def test_an_engine_that_dies_says_why_in_every_eos(endpoint, monkeypatch):
    """A control task that keeps crashing is engine death (exit 3); the streams' eos named `shutdown`, not
    the cause: now each eos says the engine died and why."""
    from engine.control import control_socket as control

    async def crash(engine, sock, stop):
        raise RuntimeError("injected control-plane bug")
    monkeypatch.setattr(control, "serve", crash)
    cfg = engine_config([{"id": "s0", "url": "synthetic://shapes?size=64x64&fps=30"}], endpoint,
                        budget={"latency_ms": 1000}, control={"enabled": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"},
                        publish={"min_subscribers": 1})
    eng = Engine(cfg, models={"classify": [NoopRunner()]})
    sub = Subscriber(endpoint, ["event."])
    try:
        with _SigintAfter(30):
            assert run(eng) == EXIT_DEAD
        eos = None
        while (msg := sub.recv(2)) is not None:
            if msg["kind"] == "eos":  # the one stream's one eos: nothing is awaited after it
                eos = msg
                break
    finally:
        sub.close()
    assert eos is not None and eos["reason"].startswith("engine dead: control socket keeps crashing"), eos


_COUNTING_SUB = """
import json, sys, msgpack, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.SUB)
s.setsockopt(zmq.RCVHWM, 10)
s.setsockopt(zmq.RCVBUF, 4096)
s.connect(sys.argv[1])
s.setsockopt(zmq.SUBSCRIBE, sys.argv[2].encode())
print("ready", flush=True)
seqs = []
while True:
    topic, payload = s.recv_multipart()
    msg = msgpack.unpackb(payload)
    if msg["stream"] != "off":
        continue
    if msg["type"] == "event" and msg["kind"] == "eos":
        break
    if msg["type"] == "classify":
        seqs.append(msg["seq"])
print(json.dumps(seqs), flush=True)
"""


def test_a_stalled_subscriber_misses_no_offline_result_and_a_live_only_one_holds_no_offline_stream(endpoint):
    """A live and an offline stream; subscriber B takes everything, C only the live stream's results; both are
    stopped (SIGSTOP) while the live stream fills their queues, so libzmq deactivates their pipes (a lossy send
    skips an inactive pipe without a word: delivery.py). The offline stream waits for B (it is a subscriber of its
    topic) and for nothing else: once B is resumed, B and the good subscriber A each have every offline result
    exactly once, in order, while C, stopped to the end, never held it back."""
    streams = [{"id": "live", "url": "synthetic://shapes?size=32x32&fps=250"},
               {"id": "off", "url": "synthetic://shapes?size=32x32&fps=30&frames=400", "mode": "offline"}]
    cfg = engine_config(streams, endpoint, budget={"latency_ms": 2000}, publish={"hwm": 200, "min_subscribers": 3})
    ctx = zmq.Context()
    ctx.setsockopt(zmq.SNDBUF, 16384)  # small kernel buffers: a stopped subscriber is full within a second
    eng = Engine(cfg, models={"classify": [NoopRunner()]}, ctx=ctx)
    a = Subscriber(endpoint, ["classify.", "event."])
    got: dict[str, list[int]] = {}
    stop = threading.Event()

    def read():
        while True:
            msg = a.recv(0.5)
            if msg is None:
                if stop.is_set():
                    return
            elif msg["type"] == "classify":
                got.setdefault(msg["stream"], []).append(msg["seq"])
    subs = {name: subprocess.Popen([sys.executable, "-c", _COUNTING_SUB, endpoint, topic], stdout=subprocess.PIPE,
                                   text=True) for name, topic in (("B", ""), ("C", "classify.live"))}
    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert all(p.stdout.readline().strip() == "ready" for p in subs.values())
        eng.start()  # waits for A, B and C (min_subscribers)
        for p in subs.values():
            os.kill(p.pid, signal.SIGSTOP)
        off = eng.pools["classify"].acct
        # the live stream fills B's and C's queues; the offline stream is held for B
        assert wait_for(lambda: eng.publisher._delivery.suspect, 20)
        time.sleep(1.5)
        assert off.snapshot("off").published < 400, "the offline stream was not held for a stopped subscriber of it"
        os.kill(subs["B"].pid, signal.SIGCONT)
        out, _ = subs["B"].communicate(timeout=60)
        assert wait_for(lambda: off.snapshot("off").published == 400, 30)  # C (live only) is still stopped
        assert os.waitpid(subs["C"].pid, os.WNOHANG) == (0, 0)
    finally:
        eng.stop()
        stop.set()
        reader.join(10)
        a.close()
        for p in subs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.communicate(timeout=10)
        ctx.term()
    import json
    assert json.loads(out.strip().splitlines()[-1]) == list(range(400))  # B: every offline result, once, in order
    assert got["off"] == list(range(400))
    live = eng.pools["classify"].acct.snapshot("live")
    assert got["live"] == sorted(set(got["live"])) and len(got["live"]) == live.published
