"""The cameras of benchmarks/bench_peers.py: Debian's GStreamer RTSP server through Python GI, serving
pre-encoded H.264 clips without re-encoding, the same mounts for every system.

Run with Debian's /usr/bin/python3 (GI's bindings exist only there; scripts/install-rtsp-deps.sh):

    /usr/bin/python3 benchmarks/peers/rtsp_server.py --port 8554 --mount s240:48:clip240p60.mp4 \
        --mount s720:8:clip720p30.mp4

`--mount PREFIX:N:CLIP` serves /PREFIX_0 ... /PREFIX_<N-1>, each its own *shared* media factory over CLIP:
a mount's pipeline starts when its first client connects (the clip from 0, paced by GStreamer's clock, i.e.
in real time, as a camera), and is torn down when its last client leaves, so each run sees a fresh start.
No re-encode: what is measured is the reader, not the server (0.1-0.4 of a core for 48 mounts of 240p60).
Prints `READY <port>` once listening.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def launch_line(clip: str) -> str:
    """The media pipeline of one mount: demux the mp4 and packetize its H.264 as it is (SPS/PPS in-band each
    second, so a reader that joins late or loses its place can start decoding at the next keyframe)."""
    return (f'( filesrc location="{os.path.abspath(clip)}" ! qtdemux ! h264parse '
            f"! rtph264pay name=pay0 pt=96 config-interval=1 )")


def parse_mount(spec: str) -> tuple[str, int, str]:
    """'s240:48:clip.mp4' -> ('s240', 48, 'clip.mp4')."""
    prefix, n, clip = spec.split(":", 2)
    if not prefix.isidentifier() or not n.isdigit() or int(n) < 1:
        raise ValueError(f"--mount {spec!r}: expected PREFIX:N:CLIP with N >= 1")
    return prefix, int(n), clip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mount", action="append", type=parse_mount, required=True, help="PREFIX:N:CLIP")
    args = ap.parse_args()
    import gi  # here, not at the top: the launch line is tested from vidar's venv, which has no GI

    gi.require_version("Gst", "1.0")
    gi.require_version("GstRtspServer", "1.0")
    from gi.repository import GLib, Gst, GstRtspServer

    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    mounts = server.get_mount_points()
    for prefix, n, clip in args.mount:
        for i in range(n):
            factory = GstRtspServer.RTSPMediaFactory()
            factory.set_launch(launch_line(clip))
            factory.set_shared(True)  # one pipeline per mount, whoever reads it
            mounts.add_factory(f"/{prefix}_{i}", factory)
    try:
        attached = server.attach(None)
    except GLib.Error as err:  # some versions raise instead of returning 0
        attached, why = 0, str(err)
    else:
        why = "attach returned 0"
    if not attached:
        print(f"rtsp_server: cannot listen on 127.0.0.1:{args.port}: {why}", file=sys.stderr)
        sys.exit(2)
    loop = GLib.MainLoop()

    def on_signal(*_: object) -> bool:
        loop.quit()
        return GLib.SOURCE_REMOVE

    for sig in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, sig, on_signal)
    print(f"READY {args.port}", flush=True)
    loop.run()


if __name__ == "__main__":
    main()
