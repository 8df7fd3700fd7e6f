"""In-process TCP proxy for network fault injection in tests (loopback only, standard library only).

Why: vidar's RTSP ingest must survive cameras that misbehave on the wire: the server dies
(connection refused), hangs (TCP stays up, nothing arrives), resets (RST), trickles (bandwidth
collapse) or ends the session cleanly (FIN). Tests put a FaultProxy between PyAV and
tests/rtsp_server.py and flip its mode while frames flow:

    with FaultProxy("127.0.0.1", server_port) as p:
        url = f"rtsp://127.0.0.1:{p.port}/test"; ...; p.set_mode("blackhole"); ...

Modes: "pass" forwards both ways. "blackhole" keeps connections open and accepts new ones but
reads and discards everything both ways (a new connection reaches the server only once forwarding
resumes). "reset" closes every connection, live or new, with RST (SO_LINGER 0). "slow" forwards
at most rate_bytes_s bytes/s per direction per connection. "cut" closes the live connections once
with FIN, then acts as "pass". close_listener()/reopen_listener(): connection refused, then back,
on the same port. A target that refuses gets the client connection reset.

One daemon thread runs a select loop (20 ms tick) over non-blocking sockets and does all socket
work; set_mode() and the listener calls queue a command and wait for it (one tick), so changes
reach live connections at once; close() joins the thread in well under 1 s.
"""
from __future__ import annotations

import errno
import selectors
import socket
import struct
import threading
import time
from contextlib import suppress

MODES = ("pass", "blackhole", "reset", "slow", "cut")
_TICK, _BUF = 0.02, 1 << 16
_R, _W = selectors.EVENT_READ, selectors.EVENT_WRITE


def _close(sock, rst=False):
    """RST (SO_LINGER 0), or drain then FIN (unread data at close() would make Linux send RST)."""
    if sock is None:
        return
    with suppress(OSError):  # BlockingIOError ends the drain
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            sock.setblocking(False)
            for _ in range(64):
                if not sock.recv(_BUF):
                    break
    with suppress(OSError):
        if not rst:
            sock.shutdown(socket.SHUT_WR)
    sock.close()


class _Conn:
    """Side 0 = client, 1 = upstream: buf[k] waits to be sent to s[k]; eof[k]: s[k] sent FIN."""

    def __init__(self, client):
        self.s, self.connecting = [client, None], False
        self.buf = [bytearray(), bytearray()]
        self.eof, self.shut, self.tokens = [False, False], [False, False], [0.0, 0.0]


class FaultProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.rate_bytes_s, self.connections, self._mode = 50_000.0, 0, "pass"
        self._conns: list[_Conn] = []
        self._cmds: list = []
        self._lock, self._stop, self._thread = threading.Lock(), threading.Event(), None
        self._lsock = self._listen(0)
        self.port: int = self._lsock.getsockname()[1]

    mode = property(lambda self: self._mode, lambda self, m: self.set_mode(m))
    active = property(lambda self: len(self._conns), doc="connections open now")

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
            for conn in list(self._conns) if mode in ("cut", "reset") else ():
                self._drop(conn, rst=mode == "reset")
        self._call(apply)

    def close_listener(self):
        def apply():
            _close(self._lsock, rst=True)
            self._lsock = None
        self._call(apply)

    def reopen_listener(self):
        def apply():
            self._lsock = self._lsock or self._listen(self.port)
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

    @staticmethod
    def _listen(port):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(128)
        s.setblocking(False)
        return s

    def _call(self, fn):
        """Run fn on the proxy thread (or here, if it is not running) and wait for it."""
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
        if conn.connecting:  # only wait for the upstream connect to finish
            yield conn.s[1], _W
            return
        fwd, slow = self._mode != "blackhole", self._mode == "slow"
        for k, s in enumerate(conn.s):
            ev = _R if not conn.eof[k] and (not fwd or len(conn.buf[1 - k]) < _BUF) else 0
            if fwd and conn.buf[k] and (not slow or conn.tokens[k] >= 1):
                ev |= _W
            if s is not None and ev:
                yield s, ev

    def _loop(self):
        last = time.monotonic()
        while not self._stop.is_set():
            self._run_cmds()
            with selectors.DefaultSelector() as sel:
                if self._lsock is not None:
                    sel.register(self._lsock, _R)
                for conn in self._conns:
                    for s, ev in self._interest(conn):
                        sel.register(s, ev)
                ready = {key.fileobj: ev for key, ev in sel.select(_TICK)}
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
            except OSError:  # BlockingIOError: nothing left in the backlog
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
        if s[1] is None and fwd:  # connect upstream (deferred while blackholed)
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
        for k in (0, 1):  # read (blackhole: read and discard)
            try:
                if s[k] is not None and not conn.eof[k] and (not fwd or len(conn.buf[1 - k]) < _BUF):
                    data = s[k].recv(_BUF)
                    conn.eof[k] = not data
                    conn.buf[1 - k] += data if fwd else b""
            except BlockingIOError:
                pass
            except OSError:
                return self._drop(conn, rst=True)  # a peer reset: pass the reset on
        if not fwd:
            return self._drop(conn) if conn.eof[0] else None  # the client hung up
        for k in (0, 1):  # write, then pass a half-close on
            n = len(conn.buf[k]) if mode != "slow" else min(len(conn.buf[k]), int(conn.tokens[k]))
            try:
                if n:
                    sent = s[k].send(conn.buf[k][:n])
                    del conn.buf[k][:sent]
                    conn.tokens[k] -= sent if mode == "slow" else 0
                if conn.eof[1 - k] and not conn.buf[k] and not conn.shut[k]:
                    s[k].shutdown(socket.SHUT_WR)
                    conn.shut[k] = True
            except BlockingIOError:
                pass
            except OSError:
                return self._drop(conn, rst=True)
        if all(conn.eof) and all(conn.shut):
            self._drop(conn)
