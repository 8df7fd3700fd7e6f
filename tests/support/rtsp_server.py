"""Minimal standalone RTSP server used by vidar's tests.

Runs under Debian's system interpreter (/usr/bin/python3), NOT the project
venv: the GStreamer introspection bindings (``gi`` + GstRtspServer typelibs)
are installed by apt (see scripts/install-rtsp-deps.sh) and only exist for
the system python.  Tests start it as a subprocess and wait for the line
``READY rtsp://127.0.0.1:PORT/MOUNT`` on stdout.

  /usr/bin/python3 tests/rtsp_server.py --port 8554 [--mount /test]
      [--file clip.mp4 | --pattern] [--fps 30] [--size 320x240] [--config-interval 1]
"""
import argparse
import signal
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


def build_launch(args):
    if args.file:
        # H.264 mp4 served as-is (no re-encode); one pass, no looping.
        return (f'( filesrc location="{args.file}" ! qtdemux ! h264parse '
                f"! rtph264pay name=pay0 pt=96 config-interval={args.config_interval} )")
    w, h = args.size.lower().split("x")
    return ("( videotestsrc is-live=true pattern=ball "
            f"! video/x-raw,width={int(w)},height={int(h)},framerate={args.fps}/1 "
            "! x264enc tune=zerolatency speed-preset=ultrafast key-int-max=30 "
            f"! rtph264pay name=pay0 pt=96 config-interval={args.config_interval} )")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mount", default="/test")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--file", help="H.264 mp4 to serve without re-encoding")
    src.add_argument("--pattern", action="store_true", help="live test pattern (default)")
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--size", default="320x240")
    # rtph264pay's SPS/PPS in-band every N s; 0 (GStreamer's default): only in the SDP (sprop-parameter-sets)
    p.add_argument("--config-interval", type=int, default=1)
    args = p.parse_args()
    mount = args.mount if args.mount.startswith("/") else "/" + args.mount

    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(build_launch(args))
    factory.set_shared(False)  # every client gets its own pipeline, from the start
    server.get_mount_points().add_factory(mount, factory)

    try:
        source_id = server.attach(None)
    except GLib.Error as e:  # some versions raise instead of returning 0
        source_id, err = 0, e
    else:
        err = "attach returned 0"
    if not source_id:
        print(f"rtsp_server: cannot listen on 127.0.0.1:{args.port}: {err}", file=sys.stderr)
        sys.exit(2)

    loop = GLib.MainLoop()

    def on_signal(*_):
        loop.quit()
        return GLib.SOURCE_REMOVE

    for sig in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, sig, on_signal)
    print(f"READY rtsp://127.0.0.1:{args.port}{mount}", flush=True)
    loop.run()


if __name__ == "__main__":
    main()
