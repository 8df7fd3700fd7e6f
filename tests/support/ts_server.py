"""A live camera for tests: an H.264 clip served as MPEG-TS over plain TCP (tcp://127.0.0.1:PORT), in real time,
each frame's pts the moment it was sent.

Run as its own process (`python tests/support/ts_server.py CLIP FPS KEYINT`), so that the engine under test never
holds up its pacing (one GIL each). It prints one line, `PORT T0_MONO T0_WALL`, then serves until its stdin
closes (the test ends it by its handle; a test process that died closes the pipe too). Frame k of the camera's
timeline is due at T0 + k / FPS; each frame is stamped with pts = (the moment it is written to the socket) - T0,
so by the camera's clock a frame's age when it is read is read_time - (T0 + pts) (monotonic: the system-wide
clock on Linux, the same in every process). A client starts at the next keyframe, as a camera's new session does;
the clip (a multiple of KEYINT frames, starting with a keyframe) loops with its pts going on. Pixels are
pre-encoded: the server's own cost is a mux and a send a frame. What a client does not read waits in the
kernel's socket buffers, as from a camera whose reader is slow.
"""

from __future__ import annotations

import math
import socket
import sys
import threading
import time
from fractions import Fraction

import av

_TB = Fraction(1, 90000)  # MPEG-TS timestamps


class _Sock:
    """The socket as the file PyAV's muxer writes to: every write sent whole (sendall), nothing buffered here."""

    def __init__(self, conn: socket.socket):
        self._conn = conn

    def write(self, data) -> int:
        self._conn.sendall(data)
        return len(data)


def _packets(clip: str) -> list[tuple[bytes, bool]]:
    with av.open(clip) as c:
        return [(bytes(p), bool(p.is_keyframe)) for p in c.demux(video=0) if p.size]


def _serve(conn: socket.socket, packets: list[tuple[bytes, bool]], fps: float, keyint: int, t0: float,
           size: tuple[int, int]) -> None:
    try:
        out = av.open(_Sock(conn), "w", format="mpegts", options={"flush_packets": "1"})
        st = out.add_stream("h264", rate=round(fps))
        st.width, st.height, st.pix_fmt = size[0], size[1], "yuv420p"
        k = math.ceil((time.monotonic() - t0) * fps / keyint) * keyint  # the next keyframe of the timeline
        last = -1
        while True:
            wait = t0 + k / fps - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            data, key = packets[k % len(packets)]
            p = av.Packet(data)
            p.stream, p.time_base, p.is_keyframe = st, _TB, key
            # the moment it is written (a late send is stamped late: the frame is as old as it says)
            ts = max(round((time.monotonic() - t0) * 90000), last + 1)
            p.pts = p.dts = last = ts
            out.mux(p)
            k += 1
    except (OSError, av.error.FFmpegError):  # the client went away (a reconnect, the test's end)
        pass
    finally:
        conn.close()


def main() -> None:
    clip, fps, keyint = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    packets = _packets(clip)
    if len(packets) % keyint or not packets[0][1]:
        raise SystemExit(f"{clip}: {len(packets)} frames is not a whole number of GOPs of {keyint} from a keyframe")
    with av.open(clip) as c:
        cc = c.streams.video[0].codec_context
        size = (cc.width, cc.height)
    lst = socket.create_server(("127.0.0.1", 0))
    t0_mono, t0_wall = time.monotonic(), time.time()
    print(lst.getsockname()[1], repr(t0_mono), repr(t0_wall), flush=True)

    def accept() -> None:
        while True:
            try:
                conn, _ = lst.accept()
            except OSError:
                return
            threading.Thread(target=_serve, args=(conn, packets, fps, keyint, t0_mono, size), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()  # until the test closes it (or dies): the daemon threads end with the process
    lst.close()


if __name__ == "__main__":
    main()
