"""In-process TCP proxy for network fault injection in tests (loopback only).

Why: vidar's RTSP ingest must survive cameras that misbehave on the wire: the
server dies (connection refused), hangs (TCP stays up, nothing arrives), resets
(RST), trickles (bandwidth collapse) or ends the stream cleanly (FIN).  Tests
put a FaultProxy between the client (PyAV/FFmpeg) and tests/rtsp_server.py and
flip its mode while frames flow:

    with FaultProxy("127.0.0.1", server_port) as p:
        url = f"rtsp://127.0.0.1:{p.port}/test"
        ...; p.set_mode("blackhole"); ...; p.set_mode("pass")

Modes:  "pass"      forward both ways.
        "blackhole" keep connections open and accept new ones, but read and
                    discard everything, both ways (new connections do not reach
                    the server until forwarding resumes).
        "reset"     close every connection with RST (SO_LINGER 0); new ones are
                    accepted and reset at once.
        "slow"      forward at most rate_bytes_s bytes/s per direction per
                    connection.
        "cut"       close the existing connections once with FIN, then "pass".
close_listener()/reopen_listener() stop/resume listening on the same port, so a
client sees "connection refused" in between.  If the target refuses, the
client connection is reset.

One daemon thread runs a select loop (20 ms tick) over non-blocking sockets;
all socket work happens on it.  set_mode() and the listener calls hand it a
command and wait until it has run (one tick), and close() joins it (< 0.1 s).
Standard library only.
"""
from __future__ import annotations

import errno
import selectors
import socket
import struct
import threading
import time

MODES = ("pass", "blackhole", "reset", "slow", "cut")
_TICK, _BUF = 0.02, 1 << 16
_R, _W = selectors.EVENT_READ, selectors.EVENT_WRITE


def _close(sock, rst=False):
    """Close with RST (SO_LINGER 0), or drain-then-FIN (unread data would make Linux send RST)."""
    if sock is None:
        return
    try:
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            sock.setblocking(False)
            for _ in range(64):
                if not sock.recv(_BUF):
                    break
    except OSError:
        pass
    if not rst:
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    sock.close()


class _Conn:
    """Index 0 = client side, 1 = upstream side; buf[k] waits to be written to s[k], eof[k]: s[k] sent FIN."""

    def __init__(self, client):
        self.s = [client, None]
        self.connecting = False
        self.buf = [bytearray(), bytearray()]
        self.eof, self.shut, self.tokens = [False, False], [False, False], [0.0, 0.0]


class FaultProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.rate_bytes_s = 50_000.0
        self.connections = 0
        self._mode = "pass"
        self._conns: list[_Conn] = []
        self._cmds: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._lsock = self._listen(0)
        self.port: int = self._lsock.getsockname()[1]

    # ---- public API -------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str):
        self.set_mode(value)

    @property
    def active(self) -> int:
        return len(self._conns)

    def start(self) -> "FaultProxy":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"FaultProxy-{self.port}", daemon=True)
            self._thread.start()
        return self

    def set_mode(self, mode: str, **kw):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if set(kw) - {"rate_bytes_s"}:
            raise TypeError(f"unknown options {sorted(set(kw) - {'rate_bytes_s'})}")
        rate = float(kw.get("rate_bytes_s", self.rate_bytes_s))
        if rate <= 0:
            raise ValueError("rate_bytes_s must be > 0")

        def apply():
            self.rate_bytes_s, self._mode = rate, mode
            if mode in ("cut", "reset"):
                for conn in list(self._conns):
                    self._drop(conn, rst=mode == "reset")
        self._call(apply)

    def close_listener(self):
        def apply():
            _close(self._lsock, rst=True)
            self._lsock = None
        self._call(apply)

    def reopen_listener(self):
        def apply():
            if self._lsock is None:
                self._lsock = self._listen(self.port)
        self._call(apply)

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        self._run_cmds()
        for conn in list(self._conns):
            self._drop(conn)
        _close(self._lsock, rst=True)
        self._lsock = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ---- internals (run on the proxy thread) ------------------------------------------------
    @staticmethod
    def _listen(port):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(128)
        s.setblocking(False)
        return s

    def _call(self, fn):
        t = self._thread
        if t is None or not t.is_alive() or t is threading.current_thread():
            return fn()
        done = threading.Event()
        with self._lock:
            self._cmds.append((fn, done))
        if not done.wait(1.0):
            raise TimeoutError("FaultProxy thread did not run the command within 1 s")

    def _run_cmds(self):
        with self._lock:
            cmds, self._cmds = self._cmds, []
        for fn, done in cmds:
            try:
                fn()
            finally:
                done.set()

    def _drop(self, conn, rst=False):
        if conn in self._conns:
            self._conns.remove(conn)
        for s in conn.s:
            _close(s, rst)

    def _interest(self, conn):
        fwd, slow = self._mode != "blackhole", self._mode == "slow"
        if conn.connecting:  # only wait for the connect to finish
            yield conn.s[1], _W
            return
        for k, s in enumerate(conn.s):
            if s is None:
                continue
            ev = _R if not conn.eof[k] and (not fwd or len(conn.buf[1 - k]) < _BUF) else 0
            if fwd and conn.buf[k] and (not slow or conn.tokens[k] >= 1):
                ev |= _W
            if ev:
                yield s, ev

    def _loop(self):
        last = time.monotonic()
        while not self._stop.is_set():
            self._run_cmds()
            sel = selectors.DefaultSelector()
            try:
                if self._lsock is not None:
                    sel.register(self._lsock, _R)
                for conn in self._conns:
                    for s, ev in self._interest(conn):
                        sel.register(s, ev)
                ready = {key.fileobj: ev for key, ev in sel.select(_TICK)}
            finally:
                sel.close()
            now = time.monotonic()
            dt, last = now - last, now
            if self._lsock is not None and self._lsock in ready:
                self._accept()
            for conn in list(self._conns):
                self._pump(conn, ready, dt)

    def _accept(self):
        for _ in range(64):
            try:
                c, _ = self._lsock.accept()
            except OSError:  # BlockingIOError: backlog empty
                return
            self.connections += 1
            if self._mode == "reset":
                _close(c, rst=True)
            else:
                c.setblocking(False)
                self._conns.append(_Conn(c))

    def _pump(self, conn, ready, dt):
        mode, s = self._mode, conn.s
        fwd = mode != "blackhole"
        if mode == "reset":
            return self._drop(conn, rst=True)
        if s[1] is None and fwd:  # upstream connect (deferred while blackholed)
            s[1] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s[1].setblocking(False)
            if s[1].connect_ex(self.target) not in (0, errno.EINPROGRESS):
                return self._drop(conn, rst=True)
            conn.connecting = True
        if conn.connecting:
            if not ready.get(s[1], 0) & _W:
                return
            if s[1].getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                return self._drop(conn, rst=True)  # target refused: reset the client
            conn.connecting = False
        if mode == "slow":
            cap = max(self.rate_bytes_s * 2.5 * _TICK, 1.0)
            conn.tokens = [min(t + self.rate_bytes_s * dt, cap) for t in conn.tokens]
        for k in (0, 1):
            if s[k] is None:
                continue
            try:
                if not conn.eof[k] and (not fwd or len(conn.buf[1 - k]) < _BUF):
                    data = s[k].recv(_BUF)
                    if not data:
                        conn.eof[k] = True
                    elif fwd:
                        conn.buf[1 - k] += data
            except BlockingIOError:
                pass
            except OSError:
                return self._drop(conn, rst=True)  # peer reset: pass the reset on
        if not fwd:
            if conn.eof[0]:  # client hung up on a blackholed connection
                self._drop(conn)
            return
        for k in (0, 1):
            n = len(conn.buf[k]) if mode != "slow" else min(len(conn.buf[k]), int(conn.tokens[k]))
            try:
                if n:
                    sent = s[k].send(conn.buf[k][:n])
                    del conn.buf[k][:sent]
                    if mode == "slow":
                        conn.tokens[k] -= sent
                if conn.eof[1 - k] and not conn.buf[k] and not conn.shut[k]:
                    s[k].shutdown(socket.SHUT_WR)  # pass the half-close on
                    conn.shut[k] = True
            except BlockingIOError:
                pass
            except OSError:
                return self._drop(conn, rst=True)
        if all(conn.eof) and all(conn.shut):
            self._drop(conn)
