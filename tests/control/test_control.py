"""The control socket: every request gets a reply; streams and objects come and go at run time."""

import os
import threading
import time

import msgpack
import pytest
import zmq

from engine.control.control_socket import request
from engine.core.engine import Engine
from engine.models.noop import NoopRunner
from engine.testing.wait import wait_for
from tests.support.collector import Collector
from tests.support.control import ControlServer, with_control
from tests.support.engines import engine_config


@pytest.fixture
def running(endpoint):
    cfg, ctl = with_control(engine_config([{"id": "cam1", "url": "synthetic://shapes?size=96x64&fps=30"}], endpoint,
                                          budget={"latency_ms": 500}))
    eng = Engine(cfg, models={"classify": NoopRunner()})
    eng.start()
    server = ControlServer(eng)
    yield eng, ctl
    server.close()
    eng.stop()


@pytest.mark.parametrize("req, error", [
    ("not a map", "a request is a map with an 'op' key"),
    ({"op": "explode"}, r"unknown op 'explode'; allowed: \['list', 'add_stream'"),
    ({"op": "remove_stream"}, "remove_stream: missing key 'stream'"),
    ({"op": "remove_stream", "stream": 7}, "'stream' must be a str"),
    ({"op": "remove_stream", "stream": "ghost"}, r"unknown stream 'ghost'; streams: \['cam1'\]"),
    ({"op": "add_stream", "stream": {"id": "x"}}, "add_stream: stream.url: Field required"),
    ({"op": "add_stream", "stream": {"id": "cam1", "url": "synthetic://shapes"}}, "'cam1' is already running"),
    ({"op": "add_stream", "stream": {"id": "c", "url": "x", "color": 1}}, "stream.color: Extra inputs"),
    # refused in the reply, not accepted and failed later by the decoder; the password never echoed
    ({"op": "add_stream", "stream": {"id": "c", "url": "ftp://u:pw@h/a.mp4"}},
     r"stream.url: .*unsupported URL scheme 'ftp' in 'ftp://\*\*\*@h/a.mp4'; allowed: a file path"),
    ({"op": "add_object", "stream": "cam1", "id": 1, "box": [0, 0, 5, 5]}, "add_object needs the sam2 pool: configure models.sam2"),
])
def test_bad_requests_get_an_error_reply(running, req, error):
    eng, ctl = running
    reply = request(ctl, req)
    assert reply["ok"] is False and __import__("re").search(error, reply["error"]), reply
    assert eng.state == "running" and eng.pools["classify"].acct.snapshot("cam1").published > 0


def test_malformed_and_oversized_messages(running):
    eng, ctl = running
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ctl)
    sock.send(b"\xc1\xff garbage")
    assert sock.poll(5000)
    assert msgpack.unpackb(sock.recv()) == {"ok": False, "error": "request is not valid msgpack"}
    sock.close(0)
    big = zmq.Context.instance().socket(zmq.REQ)  # over max_message_bytes: ZeroMQ drops the peer, no reply
    big.setsockopt(zmq.LINGER, 0)
    big.connect(ctl)
    big.send(msgpack.packb({"op": "list", "pad": "x" * 100_000}))
    assert not big.poll(500)
    big.close(0)
    assert request(ctl, {"op": "list"})["ok"]  # still serving


def test_add_and_remove_streams_at_run_time(running, endpoint):
    eng, ctl = running
    col = Collector(endpoint, ["cam2"])
    request(ctl, {"op": "list"})  # the test's own sockets and threads exist before the baseline is taken
    time.sleep(0.3)
    threads_before = {t.name for t in threading.enumerate()}
    fds_before = len(os.listdir("/proc/self/fd"))
    reply = request(ctl, {"op": "add_stream", "stream": {"id": "cam2", "url": "synthetic://shapes?size=64x64&fps=30"}})
    assert reply == {"ok": True, "stream": "cam2"}
    wait_for(lambda: eng.pools["classify"].acct.snapshot("cam2").published >= 10, 10)
    listed = request(ctl, {"op": "list"})["streams"]
    assert set(listed) == {"cam1", "cam2"} and listed["cam2"]["state"] == "running"
    assert listed["cam2"]["decode"] == {"device": "cpu", "reason": "synthetic"}  # where, and why
    cam1_before = eng.pools["classify"].acct.snapshot("cam1").published
    t0 = time.monotonic()
    assert request(ctl, {"op": "remove_stream", "stream": "cam2"}) == {"ok": True}
    assert time.monotonic() - t0 < 1.0
    col._t.join(5)  # returns at the eos; the subscriber stays open for the fd count below
    msgs = col.msgs
    assert msgs[-1]["kind"] == "eos" and msgs[-1]["reason"] == "removed"
    assert "source-cam2" not in {t.name for t in threading.enumerate()}
    assert {t.name for t in threading.enumerate()} - threads_before == set()
    time.sleep(0.5)  # ZeroMQ closes request sockets on its I/O thread
    assert len(os.listdir("/proc/self/fd")) <= fds_before  # the stream's sockets and files are released
    col.sub.close()
    s2 = eng.pools["classify"].acct.snapshot("cam2")
    assert s2.in_flight == 0 and s2.balanced()
    time.sleep(0.3)
    assert eng.pools["classify"].acct.snapshot("cam1").published > cam1_before  # cam1 never stopped
    assert set(request(ctl, {"op": "list"})["streams"]) == {"cam1"}


def test_sam2_objects_through_the_control_socket(tmp_path, endpoint):
    from engine.testing.sam2_ref import CONFIG, SIZE, make_checkpoint
    ckpt = make_checkpoint(tmp_path / "c.pt")
    cfg = engine_config([{"id": "cam1", "url": "synthetic://shapes?size=160x120&fps=10"}], endpoint,
                        budget={"latency_ms": 2000},
                        models={"classify": None, "sam2": {"config": CONFIG, "checkpoint": str(ckpt), "image_size": SIZE,
                                                      "max_batch": 1}})
    cfg, ctl = with_control(cfg)
    eng = Engine(cfg)
    eng.start()
    server = ControlServer(eng)
    try:
        col = Collector(endpoint, ["cam1"])
        col.sub._sock.setsockopt(zmq.SUBSCRIBE, b"sam2.")
        # the first processed frame sets the stream's size (however slow SAM 2 is here)
        wait_for(lambda: request(ctl, {"op": "list"})["streams"]["cam1"].get("frame"), 60)
        bad = request(ctl, {"op": "add_object", "stream": "cam1", "id": 4, "box": [10, 10, 500, 100]})
        assert bad["ok"] is False and "(500.0, 100.0) lies outside the 160x120 frame" in bad["error"]
        assert request(ctl, {"op": "add_object", "stream": "cam1", "id": 4, "box": [10, 10, 80, 60]})["ok"]
        wait_for(lambda: any(m.get("objects") for m in col.msgs if m["type"] == "sam2"), 20, 0.1)
        assert request(ctl, {"op": "list"})["streams"]["cam1"]["objects"] == [4]
        assert request(ctl, {"op": "remove_object", "stream": "cam1", "id": 4})["ok"]
        assert request(ctl, {"op": "remove_object", "stream": "cam1", "id": 4})["ok"] is False
        assert request(ctl, {"op": "reset_stream", "stream": "cam1"})["ok"]
    finally:
        server.close()
        eng.stop()
    got = [m for m in col.wait(5) if m["type"] == "sam2" and m["objects"]]
    assert got and got[0]["objects"][0]["id"] == 4


def test_vidar_control_command_line(running, capsys):
    from engine.cli import main
    eng, ctl = running
    assert main(["control", "--endpoint", ctl, "list"]) == 0
    assert '"cam1"' in capsys.readouterr().out
    assert main(["control", "--endpoint", ctl, "add_stream", "stream={id: cam3, url: 'synthetic://shapes?size=64x64'}"]) == 0
    assert main(["control", "--endpoint", ctl, "remove_stream", "stream=cam3"]) == 0
    assert main(["control", "--endpoint", ctl, "remove_stream", "stream=cam3"]) == 1
    assert "unknown stream 'cam3'" in capsys.readouterr().out
    assert main(["control", "--endpoint", ctl, "list", "oops"]) == 2
