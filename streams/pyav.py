"""Files and network streams (RTSP, HTTP, RTMP, UDP, SRT, TCP) through PyAV (FFmpeg).

Measured here (shared/STACK.md): when an RTSP server dies, PyAV's decode loop just ends as at
end of file, so for network sources an ended loop is a disconnect (the ingest thread reconnects),
never an eos. A hung server is noticed only after about twice the read timeout, so a
timeout is always passed. Corrupt packets are skipped and counted; FFmpeg resyncs at the
next keyframe. Files go to FFmpeg as `file:` + an absolute path (never read as another protocol);
named pipes and devices through a reader whose open and reads are bounded and cancellable (FileSource).

Latency truth: every frame carries the moment the packet that completed it came out of the
demuxer, and its decode time counts only packet -> rgb, never the wait for the next packet.
A live network stream's capture time is its packet's pts on the camera's clock (streams/clock.py),
never later than that arrival: a packet that waited in a socket buffer carries its real age, and a
stream too far behind skips packets, undecoded, to the next keyframe at the live edge.
Live network streams decode without frame threads: frame threading holds back one frame
per extra thread (measured: +67 ms at 30 fps on 2 cores), a delay no deadline would see.
"""

from __future__ import annotations

import os
import select
import stat
import threading
import time
from typing import Iterator, Optional, Union

import av

from engine.errors import SourceOpenError

from streams.base import DecodedFrame, Source
from streams.clock import LiveSession
from streams.convert import nv12_planes, to_rgb
from streams.urls import redact_url, url_scheme

_NOT_VIDEO_FORMATS = {"tty"}


class _Arrivals:
    """pts -> arrival of the packet that carried it, so a frame the decoder hands out later (B-frame
    reordering, frame threads) still gets its own packet's arrival. Bounded: packets whose frame
    never comes out (corrupt data) are forgotten."""

    def __init__(self, limit: int = 64):
        self._by_pts: dict[int, tuple[float, float]] = {}
        self._limit = limit

    def add(self, pts: Optional[int], when: tuple[float, float]) -> None:
        if pts is None:
            return
        self._by_pts[pts] = when
        if len(self._by_pts) > self._limit:
            del self._by_pts[next(iter(self._by_pts))]  # the oldest

    def pop(self, pts: Optional[int], default: tuple[float, float]) -> tuple[float, float]:
        return self._by_pts.pop(pts, default) if pts is not None else default


def _now() -> tuple[float, float]:
    return time.monotonic(), time.time()


def frame_pts(pts: Optional[int], time_base: float, index: int, fps: Optional[float]) -> float:
    """A frame's pts in seconds. The first RTSP frame (and every frame of a raw .h264 stream) can lack a
    pts: the frame's index over the rate stands in."""
    if pts is not None and time_base:
        return pts * time_base
    return index / fps if fps else 0.0


class _PyAVSource(Source):
    #: where this source's video is decoded ("cpu": PyAV here; "cuda": NVDEC, streams/nvdec.py), and why;
    #: None while a choice waits for the stream's codec (decode: auto or cuda, before the first open)
    decode_device: Optional[str] = "cpu"
    decode_reason: str = "decode: cpu"
    host_formats = ("rgb24", "nv12")

    def __init__(self, stream_id: str, url: str, *, max_frame_pixels: int = 8192 * 8192):
        super().__init__(stream_id, url)
        self._container = None
        self._stream = None
        self.decode_errors = 0
        self.max_frame_pixels = max_frame_pixels

    def _open_options(self) -> dict:
        return {}

    def _target(self) -> Union[str, "_PipeReader"]:
        """What av.open is given."""
        return self.url

    def _thread_type(self) -> str:
        return "AUTO"  # frame+slice threads: ~1.5x faster decode on 2 cores

    def _thread_count(self, w: int, h: int) -> int:
        """The decoder's threads; 0: FFmpeg's default (one per core)."""
        return 0

    def open(self) -> None:
        self.close()
        try:
            self._container = av.open(self._target(), mode="r", **self._open_options())
        except SourceOpenError:
            self.close()
            raise
        except (av.error.FFmpegError, OSError) as err:
            error = self._open_error(err)
            self.close()
            raise error from None
        # FFmpeg probes any text file as ANSI-art "video" (format tty): that is not a video.
        if self._container.format.name in _NOT_VIDEO_FORMATS:
            self.close()
            raise SourceOpenError(self.stream_id, f"{self.display_url!r} is not a video FFmpeg can read "
                                                  "(it reads as text): check the path and the file")
        if not self._container.streams.video:
            self.close()
            raise SourceOpenError(self.stream_id, f"{self.display_url!r} has no video stream (audio only?)")
        self._stream = self._container.streams.video[0]
        w, h = self._stream.codec_context.width or 0, self._stream.codec_context.height or 0
        if w * h > self.max_frame_pixels:  # checked before a single frame is decoded or allocated
            self.close()
            raise SourceOpenError(self.stream_id, f"{self.display_url!r} claims {w}x{h} frames, over "
                                                  f"ring.max_frame_pixels={self.max_frame_pixels}; raise it if real")
        self._stream.thread_type = self._thread_type()
        count = self._thread_count(w, h)
        if count:  # 0: FFmpeg's default (one per core)
            self._stream.codec_context.thread_count = count
        rate = self._stream.average_rate or self._stream.guessed_rate
        self.fps = float(rate) if rate else None

    def _open_error(self, err: Exception) -> SourceOpenError:
        """The stream's error for an exception out of av.open."""
        if isinstance(err, FileNotFoundError):
            return SourceOpenError(self.stream_id, f"file {self.display_url!r} not found")
        if isinstance(err, av.error.InvalidDataError):
            return SourceOpenError(self.stream_id, f"{self.display_url!r} is not a video FFmpeg can read "
                                                   "(invalid data): check the path and the file")
        why = getattr(err, "strerror", None) or str(err)  # FFmpeg's message quotes the URL: redacted
        return SourceOpenError(self.stream_id, f"cannot open {self.display_url!r}: {redact_url(why)}")

    @property
    def total_frames(self) -> Optional[int]:
        if self._stream is None:
            return None
        if self._stream.frames:
            return int(self._stream.frames)
        if self._stream.duration and self._stream.time_base and self.fps:
            return int(round(float(self._stream.duration * self._stream.time_base) * self.fps))
        return None

    def frames(self) -> Iterator[DecodedFrame]:
        if self._container is None:
            self.open()
        self.session_error, self.fell_behind = "", False
        yield from self._decode(self._packets())

    def _packets(self) -> Iterator[tuple[av.Packet, tuple[float, float]]]:
        """The session's demuxed packets, each with the moment it came out of the demuxer (its arrival).

        Split from the decoding so another decoder (streams/nvdec.py) takes the same packets, timeouts
        and arrival times: only what happens to a packet after it arrived differs. A live network stream's
        packets go through its camera clock first, which may discard them to skip to the live edge
        (streams/clock.py): that too is the same for every decoder.
        """
        packets = self._container.demux(self._stream)
        live = self._live_session()
        while True:
            try:
                packet = next(packets)
            except StopIteration:
                return
            except (av.error.FFmpegError, OSError) as err:
                # A demuxer that raised is finished (a read timeout, a reset connection, a truncated
                # file): the session ends here, with its reason; the ingest thread decides what follows.
                self.session_error = redact_url(str(err))
                return
            got = _now()
            if live is not None and packet.size and not live.packet(packet.pts, packet.is_keyframe, got[0], packet.dts):
                if not self._skipped(live, got[0]):
                    return
                continue
            yield packet, got

    def _live_session(self) -> Optional[LiveSession]:
        """The camera clock of the session starting (live network streams: NetworkSource); None: a frame's
        capture time is its packet's arrival."""
        return None

    def _skipped(self, live: LiveSession, arrival: float) -> bool:
        """A packet discarded unseen to reach the live edge: one frame lost, counted by the ingest thread
        (on_skipped). False: the session ends here (NetworkSource: stopped, or it cannot get back to the live edge)."""
        if self.on_skipped is not None:
            self.on_skipped(1)
        return True

    def _decode(self, packets: Iterator[tuple[av.Packet, tuple[float, float]]]) -> Iterator[DecodedFrame]:
        """PyAV (FFmpeg) on the CPU: each packet decoded, each frame made the host array the ring takes: RGB, or
        NV12 unconverted when the stream's pool converts it or reads no pixels (`pixel_format`; streams/convert.py)."""
        tb = float(self._stream.time_base) if self._stream.time_base else 0.0
        nv12 = self.pixel_format == "nv12"
        n = 0
        arrivals = _Arrivals()
        last = _now()  # arrival of the last packet with data: what frames flushed at the end get
        wants = self.wants
        for packet, got in packets:
            if packet.size:  # the empty packet at the end only flushes the decoder
                last = got
                arrivals.add(packet.pts, got)
            try:
                decoded = packet.decode()
            except av.error.FFmpegError:
                self.decode_errors += 1  # corrupt data: the decoder resyncs at the next keyframe
                continue
            decode_s = time.monotonic() - got[0]
            for frame in decoded:
                if wants is not None and not wants(frame.height, frame.width):
                    # no slot free for it: dropped by the ingest thread, so not converted (an RGB conversion
                    # costs more than the decode at 240p, several times more at 720p)
                    t_mono, t_wall = arrivals.pop(frame.pts, last)
                    yield DecodedFrame(None, float(frame_pts(frame.pts, tb, n, self.fps)), decode_s, t_mono, t_wall,
                                       unconverted=True)
                    n += 1
                    continue
                c0 = time.monotonic()
                if nv12:  # written into its slot later, straight from the decoder's planes (convert.NV12Planes)
                    yuv, colour = nv12_planes(frame)
                    rgb = None
                else:
                    rgb, yuv, colour = to_rgb(frame), None, ("bt601", "limited")
                convert_s = time.monotonic() - c0
                pts = frame_pts(frame.pts, tb, n, self.fps)
                t_mono, t_wall = arrivals.pop(frame.pts, last)
                yield DecodedFrame(rgb, float(pts), decode_s + convert_s, t_mono, t_wall, nv12=yuv, colour=colour)
                n += 1

    def close(self) -> None:
        if self._container is not None:
            try:
                self._container.close()
            except av.error.FFmpegError:
                pass
        self._container = self._stream = None


class FileSource(_PyAVSource):
    """Any container PyAV opens, from a path. End of file ends the stream (or loops, if configured).

    A regular file goes to FFmpeg as `file:` + its absolute path, so no part of a path (`a:b.mp4`) can
    be read as another protocol. A path that is not a regular file (a named pipe, a character device)
    is read through _PipeReader, so its open and every read are bounded and a removal cancels them:
    FFmpeg's own open(2) of a FIFO with no writer blocks for ever, and so would its reads of a writer
    that went quiet (a decoder thread nothing can end). Options weighed: refusing such paths breaks
    named pipes as live feeds; unblocking a stuck open by opening the FIFO for writing at removal
    still leaves reads unbounded. Regular-file reads on a hung network filesystem cannot be
    interrupted either way; that case is not handled (the ingest thread's reaping logs such a thread).
    """

    def __init__(self, stream_id: str, path: str, *, open_timeout_s: float = 5.0, read_timeout_s: float = 2.5,
                 max_frame_pixels: int = 8192 * 8192):
        super().__init__(stream_id, path, max_frame_pixels=max_frame_pixels)
        self.open_timeout_s, self.read_timeout_s = open_timeout_s, read_timeout_s
        self._cancelled = threading.Event()
        self._pipe: Optional[_PipeReader] = None

    def _target(self) -> Union[str, "_PipeReader"]:
        path = os.path.abspath(self.url)
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise SourceOpenError(self.stream_id, f"file {self.display_url!r} not found") from None
        except OSError as err:
            raise SourceOpenError(self.stream_id, f"cannot open {self.display_url!r}: {err.strerror}") from None
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):  # a directory: FFmpeg says so
            return "file:" + path
        self._pipe = _PipeReader(path, self.open_timeout_s, self.read_timeout_s, self._cancelled)
        return self._pipe

    def _open_error(self, err: Exception) -> SourceOpenError:
        if self._pipe is not None and self._pipe.why:  # no data in time, or stopped: say that, not "invalid data"
            return SourceOpenError(self.stream_id, f"cannot open {self.display_url!r}: {self._pipe.why}")
        return super()._open_error(err)

    def frames(self) -> Iterator[DecodedFrame]:
        yield from super().frames()
        pipe = self._pipe
        if pipe is not None and pipe.why and not self._cancelled.is_set():
            self.session_error = pipe.why  # the writer went quiet: the stream ends early, and says why

    def cancel(self) -> None:
        self._cancelled.set()

    def close(self) -> None:
        super().close()  # the container first: it reads through the pipe
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None


class _PipeReader:
    """A named pipe or character device as a non-seekable file object for PyAV, with bounded reads.

    Opened with O_NONBLOCK (a FIFO's open then returns at once, writer or not); each read waits in
    poll() slices of at most SLICE_S, so a cancel is seen within one slice. A read returns EOF (b"")
    when the writer closed, when no data came for the open timeout (before the first byte) or the read
    timeout (after it), or when cancelled; `why` says which of the last two. On Linux a FIFO that never
    had a writer does not poll readable, so no writer is a wait, not an EOF.
    """

    SLICE_S = 0.1

    def __init__(self, path: str, open_timeout_s: float, read_timeout_s: float, cancelled: threading.Event):
        self._fd: Optional[int] = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self.open_timeout_s, self.read_timeout_s = open_timeout_s, read_timeout_s
        self._cancelled = cancelled
        self._got_data = False
        self.why = ""

    def readable(self) -> bool:
        return True

    def read(self, size: int = 65536) -> bytes:
        wait_s = self.read_timeout_s if self._got_data else self.open_timeout_s
        deadline = time.monotonic() + wait_s
        while self._fd is not None and not self.why:  # once timed out or stopped, EOF at once (FFmpeg retries)
            if self._cancelled.is_set():
                self.why = "stopped"
                return b""
            left = deadline - time.monotonic()
            if left <= 0:
                self.why = (f"no data from the pipe for {wait_s:g} s" if self._got_data else
                            f"no data from the pipe within {wait_s:g} s (no writer?)")
                return b""
            if not self._poll.poll(min(self.SLICE_S, left) * 1000):  # poll, not select: fds above 1024
                continue
            try:
                data = os.read(self._fd, size)
            except BlockingIOError:  # another reader took it (a FIFO can have several)
                continue
            self._got_data = self._got_data or bool(data)
            return data  # b"": the writer closed the pipe (end of stream)
        return b""

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class NetworkSource(_PyAVSource):
    """A network URL (rtsp, rtsps, http(s), rtmp, udp, srt, tcp): open and read timeouts always set.

    When its session ends the ingest thread reconnects. RTSP goes over TCP (no UDP loss).
    """

    network = True

    def __init__(self, stream_id: str, url: str, *, open_timeout_s: float = 5.0, read_timeout_s: float = 2.5,
                 max_frame_pixels: int = 8192 * 8192):
        super().__init__(stream_id, url, max_frame_pixels=max_frame_pixels)
        self.open_timeout_s, self.read_timeout_s = open_timeout_s, read_timeout_s
        self._camera: Optional[LiveSession] = None  # the last live session's camera clock (streams/clock.py)
        self._cancelled = False

    # -- the camera's clock (live only; streams/clock.py) ----------------------------------------------------
    def _live_session(self) -> Optional[LiveSession]:
        if not self.live:  # offline: every frame is wanted, however late; its arrival is its capture time
            return None
        tb = float(self._stream.time_base) if self._stream.time_base else 0.0
        self._camera = LiveSession(self.budget_s, tb)  # a new session, a new anchor: its pts start anew
        return self._camera

    def _skipped(self, live: LiveSession, arrival: float) -> bool:
        super()._skipped(live, arrival)
        if self._cancelled:  # a skipping session yields no frame, so the ingest thread's stop is seen here
            return False
        if live.gave_up(arrival):
            # Skipping (demux only) has not reached the live edge through two keyframes: the demuxer itself
            # cannot keep up, or the clock was misled (a pts jump too small to see). A reconnect drops the
            # whole socket backlog at once and starts a new anchor; the ingest thread reconnects with backoff.
            self.session_error = (f"{live.lag_s:.1f} s behind the live edge while skipping to it: "
                                  "reconnecting to start at the live edge")
            self.fell_behind = True
            return False
        return True

    def capture_time(self, frame: DecodedFrame) -> tuple[float, float]:
        if self._camera is None:
            return frame.t_arrival, frame.t_arrival_wall
        return self._camera.capture(frame.pts, frame.t_arrival, frame.t_arrival_wall)

    @property
    def lag_s(self) -> Optional[float]:
        return self._camera.lag_s if self._camera is not None else None

    def cancel(self) -> None:
        self._cancelled = True

    def _target(self) -> str:
        # vidar reads schemes case-insensitively (RTSP://cam is allowed); FFmpeg matches protocol names
        # case-sensitively, so it is handed the scheme in lower case
        scheme, sep, rest = self.url.partition("://")
        return scheme.lower() + sep + rest

    def _open_options(self) -> dict:
        options = {}
        if url_scheme(self.url) in ("rtsp", "rtsps"):
            options["rtsp_transport"] = "tcp"
        if self.live:
            # FFmpeg keeps the packets it reads while probing the stream at open (measured: ~1 s of
            # RTSP at 30 fps) and hands them out in a burst, stale but looking fresh. Live, they are
            # dropped: the first frame comes from the first keyframe after open (up to a GOP later).
            options["fflags"] = "nobuffer"
        return {"options": options, "timeout": (self.open_timeout_s, self.read_timeout_s)}

    def _thread_type(self) -> str:
        return "SLICE" if self.live else "AUTO"  # frame threads delay every live frame (module docstring)

    def _thread_count(self, w: int, h: int) -> int:
        # A small live frame decodes on one thread: at 320x240 slice threads cost more CPU than they save time
        # (measured, 2 cores: 0.25 -> 0.19 ms a frame with one thread) and made two threads per camera that
        # wake for every frame; from 640x480 up, slices decoded side by side shorten each frame's wait.
        return 1 if self.live and 0 < w * h < 640 * 480 else 0

