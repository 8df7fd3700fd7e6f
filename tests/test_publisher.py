"""The publisher: schema, HWM drops counted (live), back-pressure without loss (offline), never late."""

import math
import threading
import time

import pytest
import zmq

from engine.accounting import Accounting
from engine.client import Subscriber
from engine.config import PublishConfig
from engine.frame import FrameMeta
from engine.publisher import Publisher
from engine.schema import SCHEMA_VERSION


def meta(seq, live=False, deadline=None):
    d = math.inf if not live else (deadline if deadline is not None else time.monotonic() + 60)
    return FrameMeta("cam1", seq, seq / 30, time.time(), deadline=d)


def connected(pub, sub_endpoint, topics=("",), n=1):
    sub = Subscriber(sub_endpoint, topics)
    assert pub.wait_subscribers(n, 5), "subscriber did not connect"
    return sub


def test_result_and_event_schema(endpoint):
    pub = Publisher(PublishConfig(endpoint=endpoint))
    acct = Accounting("vit")
    acct.ingest("cam1")
    with connected(pub, endpoint) as sub:
        pub.submit_result(acct, meta(0), "vit", "random", {"topk": [[1, "goldfish", 0.5]]})
        pub.submit_event("cam1", "eos", "end of stream")
        r, e = sub.recv(5), sub.recv(5)
    pub.close()
    assert r["v"] == SCHEMA_VERSION and r["type"] == "vit" and r["stream"] == "cam1" and r["seq"] == 0
    assert set(r) >= {"pts", "t_capture", "t_publish", "latency_ms", "weights", "topk"}
    assert r["latency_ms"] == pytest.approx((r["t_publish"] - r["t_capture"]) * 1e3)
    assert e == {"v": SCHEMA_VERSION, "type": "event", "stream": "cam1", "kind": "eos",
                 "reason": "end of stream", "t": e["t"]}
    assert acct.snapshot("cam1").published == 1


def test_offline_back_pressure_loses_nothing_to_a_slow_subscriber(endpoint):
    n = 20_000
    pub = Publisher(PublishConfig(endpoint=endpoint, hwm=50, queue_size=64))
    acct = Accounting("vit")
    sub = connected(pub, endpoint)
    sub._sock.setsockopt(zmq.RCVHWM, 50)
    got = []

    def slow_reader():
        while len(got) < n:
            m = sub.recv(10)
            if m is None:
                return
            got.append(m["seq"])
            if len(got) % 1000 == 0:
                time.sleep(0.05)  # a slow subscriber

    t = threading.Thread(target=slow_reader)
    t.start()
    for i in range(n):
        acct.ingest("cam1")
        pub.submit_result(acct, meta(i), "vit", "random", {})
    t.join(60)
    pub.close()
    sub.close()
    assert got == list(range(n))
    s = acct.snapshot("cam1")
    assert s.published == n and s.dropped == {}


def test_live_hwm_drops_are_counted_not_silent(endpoint):
    n = 20_000
    pub = Publisher(PublishConfig(endpoint=endpoint, hwm=10, queue_size=n))
    acct = Accounting("vit")
    sub = connected(pub, endpoint)
    sub._sock.setsockopt(zmq.RCVHWM, 10)
    for i in range(n):
        acct.ingest("cam1")
        pub.submit_result(acct, meta(i, live=True), "vit", "random", {"pad": b"x" * 1000})
    pub.close(timeout=10)
    received = 0
    while sub.recv(0.5) is not None:
        received += 1
    sub.close()
    s = acct.snapshot("cam1")
    assert s.dropped.get("publish_hwm", 0) > 0
    assert s.published + sum(s.dropped.values()) == n and s.in_flight == 0
    assert received == s.published


def test_a_late_result_is_never_published(endpoint):
    pub = Publisher(PublishConfig(endpoint=endpoint))
    acct = Accounting("vit")
    acct.ingest("cam1")
    with connected(pub, endpoint) as sub:
        pub.submit_result(acct, meta(0, live=True, deadline=time.monotonic() - 0.001), "vit", "random", {})
        assert sub.recv(0.5) is None
    pub.close()
    assert acct.snapshot("cam1").dropped == {"late": 1}


def test_bind_conflict_is_a_clear_error(endpoint):
    from engine.errors import ConfigError
    first = Publisher(PublishConfig(endpoint=endpoint))
    try:
        with pytest.raises(ConfigError, match=r"publish.endpoint: cannot bind"):
            Publisher(PublishConfig(endpoint=endpoint))
    finally:
        first.close()
