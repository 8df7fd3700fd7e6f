"""Tests for tests/tcp_proxy.py (FaultProxy) against a tiny in-test echo server."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from engine.testing.wait import wait_for
from tests.support.tcp_proxy import FaultProxy


class Echo:
    """Threaded echo server on 127.0.0.1:<ephemeral>; counts bytes and connections it receives."""

    def __init__(self):
        self.received = 0
        self.connections = 0
        self._stop = threading.Event()
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self._lsock.settimeout(0.1)
        self.port = self._lsock.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, name="echo-accept", daemon=True)]
        self._threads[0].start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                c, _ = self._lsock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(c,), name="echo-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, c):
        with c:
            while not self._stop.is_set():
                c.settimeout(0.1)
                try:
                    data = c.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                self.received += len(data)
                c.settimeout(10)
                try:
                    c.sendall(data)
                except OSError:
                    return

    def close(self):
        self._stop.set()
        for t in list(self._threads):
            t.join(1)
        self._lsock.close()


@pytest.fixture
def echo():
    e = Echo()
    yield e
    e.close()


@pytest.fixture
def proxy(echo):
    with FaultProxy("127.0.0.1", echo.port) as p:
        yield p


def connect(proxy, timeout=2.0):
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)


def recv_exactly(sock, n):
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"EOF after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def roundtrip(sock, payload=b"hello"):
    sock.sendall(payload)
    assert recv_exactly(sock, len(payload)) == payload


@pytest.mark.timeout(30)
def test_pass_echoes(proxy, echo):
    assert proxy.mode == "pass" and proxy.port != echo.port
    with connect(proxy) as c:
        roundtrip(c)
        payload = os.urandom(1 << 20)
        threading.Thread(target=c.sendall, args=(payload,), daemon=True).start()
        assert recv_exactly(c, len(payload)) == payload
        assert proxy.connections == 1 and proxy.active == 1
    assert wait_for(lambda: proxy.active == 0, 1.0, 0.01)
    assert echo.received == 5 + (1 << 20)


@pytest.mark.timeout(30)
def test_half_close_is_forwarded(proxy):
    with connect(proxy) as c:
        c.sendall(b"bye")
        c.shutdown(socket.SHUT_WR)
        assert recv_exactly(c, 3) == b"bye"
        assert c.recv(10) == b""  # the server saw our FIN, closed, and its FIN came back
    assert wait_for(lambda: proxy.active == 0, 1.0, 0.01)


@pytest.mark.timeout(30)
def test_blackhole_forwards_nothing_then_recovers(proxy, echo):
    with connect(proxy) as c:
        roundtrip(c)
        before = echo.received
        proxy.set_mode("blackhole")
        c.sendall(b"ping")
        c.settimeout(0.5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            c.recv(10)
        assert time.monotonic() - t0 >= 0.45
        # new connections are accepted but never reach the server
        with connect(proxy) as c2:
            c2.sendall(b"ping2")
            c2.settimeout(0.5)
            with pytest.raises(TimeoutError):
                c2.recv(10)
        time.sleep(0.1)
        assert echo.received == before and echo.connections == 1
        assert proxy.connections == 2
        proxy.set_mode("pass")  # the existing connection forwards again (what was sent meanwhile is lost)
        c.settimeout(2)
        roundtrip(c, b"again")


@pytest.mark.timeout(30)
def test_reset_resets_existing_and_new_connections(proxy):
    with connect(proxy) as c:
        roundtrip(c)
        t0 = time.monotonic()
        proxy.set_mode("reset")
        with pytest.raises(ConnectionResetError):
            c.recv(10)
        assert time.monotonic() - t0 < 0.5
    assert proxy.active == 0
    for _ in range(5):  # the kernel completes the handshake, then the proxy resets it: the RST
        try:            # lands during connect() or on the first recv, depending on scheduling
            with connect(proxy) as c2:
                assert c2.recv(10) == b""
        except ConnectionResetError:
            pass
    assert proxy.connections == 6 and proxy.active == 0
    proxy.set_mode("pass")
    with connect(proxy) as c3:
        roundtrip(c3)


@pytest.mark.timeout(30)
def test_slow_limits_rate(proxy):
    proxy.set_mode("slow", rate_bytes_s=50_000)
    assert proxy.mode == "slow" and proxy.rate_bytes_s == 50_000
    payload = os.urandom(100_000)
    with connect(proxy, timeout=10) as c:
        t0 = time.monotonic()
        threading.Thread(target=c.sendall, args=(payload,), daemon=True).start()
        assert recv_exactly(c, len(payload)) == payload
        elapsed = time.monotonic() - t0
    assert elapsed >= 1.5 and elapsed <= 4.0, elapsed


@pytest.mark.timeout(30)
def test_slow_applies_to_live_connection(proxy):
    with connect(proxy, timeout=10) as c:
        roundtrip(c)
        proxy.set_mode("slow", rate_bytes_s=20_000)
        t0 = time.monotonic()
        payload = os.urandom(30_000)
        threading.Thread(target=c.sendall, args=(payload,), daemon=True).start()
        assert recv_exactly(c, len(payload)) == payload
        elapsed = time.monotonic() - t0
        assert elapsed >= 1.0 and elapsed <= 3.0, elapsed
        proxy.set_mode("pass")
        t0 = time.monotonic()
        roundtrip(c, payload)
        assert time.monotonic() - t0 < 0.5


@pytest.mark.timeout(30)
def test_cut_sends_fin_then_passes(proxy):
    with connect(proxy) as c:
        roundtrip(c)
        t0 = time.monotonic()
        proxy.set_mode("cut")
        assert c.recv(10) == b""  # EOF, not a reset
        assert time.monotonic() - t0 < 0.5
    assert proxy.active == 0
    with connect(proxy) as c2:
        roundtrip(c2)
        assert proxy.active == 1


@pytest.mark.timeout(30)
def test_close_and_reopen_listener(proxy):
    port = proxy.port
    with connect(proxy) as c:
        roundtrip(c)
        proxy.close_listener()
        with pytest.raises(ConnectionRefusedError):
            connect(proxy)
        roundtrip(c, b"still up")  # established connections are unaffected
        proxy.reopen_listener()
        assert proxy.port == port
        with connect(proxy) as c2:
            roundtrip(c2)


@pytest.mark.timeout(30)
def test_target_down_resets_client(echo):
    port = echo.port
    echo.close()
    with FaultProxy("127.0.0.1", port) as p:
        try:
            with connect(p) as c:
                assert c.recv(10) == b""  # closed, not left hanging (a hang times out the recv)
        except ConnectionResetError:
            pass  # the reset may reach the client before its connect() has returned (seen once in CI)


@pytest.mark.timeout(30)
def test_bad_mode_rejected(proxy):
    with pytest.raises(ValueError):
        proxy.set_mode("flaky")
    with pytest.raises(TypeError):
        proxy.set_mode("slow", rate=1)
    proxy.mode = "blackhole"
    assert proxy.mode == "blackhole"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["pass", "blackhole", "slow"])
def test_close_is_prompt_and_leaves_no_threads(echo, mode):
    before = set(threading.enumerate())
    p = FaultProxy("127.0.0.1", echo.port).start()
    socks = [connect(p) for _ in range(3)]
    roundtrip(socks[0])
    p.set_mode(mode, rate_bytes_s=1000)
    for s in socks:
        s.sendall(b"x" * 10_000)
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 1.0
    leftover = [t for t in set(threading.enumerate()) - before if not t.name.startswith("echo")]
    assert leftover == []
    assert not any(t.name.startswith("FaultProxy") for t in threading.enumerate())
    for s in socks:  # the proxy closed its ends
        s.settimeout(2)
        try:
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass
        s.close()
    with pytest.raises(ConnectionRefusedError):
        connect(p)
    p.close()  # idempotent
