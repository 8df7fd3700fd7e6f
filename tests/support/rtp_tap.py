"""A TCP relay in front of an RTSP server that notes when each video frame's bytes crossed the wire.

Why: a latency test must not take the engine's word for when a frame arrived. RTSP over TCP
interleaves RTP packets as `$ channel length16 packet` (RFC 2326, 10.12); the packets of one
video frame share an RTP timestamp. The relay records, per RTP timestamp of the first video
channel, when its first packet passed (wall clock), before forwarding the bytes, so every time
it records is no later than when the client could read them. Standard library only.

    with RtpTap(server_port) as tap:
        url = f"rtsp://127.0.0.1:{tap.port}/test"; ...
        tap.sessions[0].first_seen[ts]
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from contextlib import suppress


class WireSession:
    """One client connection: RTP timestamp -> wall time its first packet passed, in wire order."""

    def __init__(self):
        self.first_seen: dict[int, float] = {}
        self.order: list[int] = []
        self._buf = bytearray()

    def feed(self, data: bytes, now: float) -> None:
        buf = self._buf
        buf += data
        while buf:
            if buf[0] == 0x24:  # '$': an interleaved RTP/RTCP packet
                if len(buf) < 4:
                    return
                channel, n = buf[1], struct.unpack(">H", buf[2:4])[0]
                if len(buf) < 4 + n:
                    return
                if channel == 0 and n >= 12:  # the first stream's RTP (RTCP is on channel 1)
                    ts = struct.unpack(">I", buf[8:12])[0]
                    if ts not in self.first_seen:
                        self.first_seen[ts] = now
                        self.order.append(ts)
                del buf[:4 + n]
            else:  # an RTSP response: headers, then Content-Length bytes of body
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                length = 0
                for line in bytes(buf[:end]).split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if len(buf) < end + 4 + length:
                    return
                del buf[:end + 4 + length]

    def released(self) -> dict[int, float]:
        """RTP timestamp -> when the next frame's first packet passed: the earliest moment a client
        can know the frame is complete without the RTP marker bit (FFmpeg's H.264 parser ends a
        frame when the next one starts). The last frame of the session has no entry."""
        return {ts: self.first_seen[nxt] for ts, nxt in zip(self.order, self.order[1:])}


class RtpTap:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.sessions: list[WireSession] = []
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self._lsock.settimeout(0.1)
        self.port: int = self._lsock.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="RtpTap", daemon=True)

    def __enter__(self) -> "RtpTap":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(1.0)
        for s in self._socks + [self._lsock]:
            with suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self._socks += [client, upstream]
            session = WireSession()
            self.sessions.append(session)
            threading.Thread(target=self._copy, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._copy, args=(upstream, client, session), daemon=True).start()

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket, session) -> None:
        with suppress(OSError):
            while data := src.recv(1 << 16):
                if session is not None:
                    session.feed(data, time.time())  # noted before the client can have it
                dst.sendall(data)
        for s in (src, dst):  # one side ended: end the other, as a plain TCP path would
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
