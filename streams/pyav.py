"""Files and network streams (RTSP, HTTP, RTMP, UDP, SRT, TCP) through PyAV (FFmpeg).

Measured here (shared/STACK.md): when an RTSP server dies, PyAV's decode loop just ends as at
end of file, so for network sources an ended loop is a disconnect (the runner reconnects),
never an eos. A hung server is noticed only after about twice the read timeout, so a
timeout is always passed. Corrupt packets are skipped and counted; FFmpeg resyncs at the
next keyframe.

Latency truth: every frame carries the moment the packet that completed it came out of the
demuxer, and its decode time counts only packet -> rgb, never the wait for the next packet.
Live network streams decode without frame threads: frame threading holds back one frame
per extra thread (measured: +67 ms at 30 fps on 2 cores), a delay no deadline would see.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional

import av

from engine.errors import SourceOpenError

from .base import DecodedFrame, Source, redact_url, url_scheme

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


class _PyAVSource(Source):
    def __init__(self, stream_id: str, url: str, *, max_frame_pixels: int = 8192 * 8192):
        super().__init__(stream_id, url)
        self._container = None
        self._stream = None
        self.decode_errors = 0
        self.max_frame_pixels = max_frame_pixels

    def _open_options(self) -> dict:
        return {}

    def _thread_type(self) -> str:
        return "AUTO"  # frame+slice threads: ~1.5x faster decode on 2 cores

    def open(self) -> None:
        self.close()
        try:
            self._container = av.open(self.url, mode="r", **self._open_options())
        except FileNotFoundError:
            raise SourceOpenError(self.stream_id, f"file {self.display_url!r} not found") from None
        except av.error.InvalidDataError:
            raise SourceOpenError(self.stream_id, f"{self.display_url!r} is not a video FFmpeg can read "
                                                  "(invalid data): check the path and the file") from None
        except (av.error.FFmpegError, OSError) as err:  # FFmpeg's message quotes the URL: redact it
            why = getattr(err, "strerror", None) or redact_url(str(err))
            raise SourceOpenError(self.stream_id, f"cannot open {self.display_url!r}: {why}") from None
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
        rate = self._stream.average_rate or self._stream.guessed_rate
        self.fps = float(rate) if rate else None

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
        tb = float(self._stream.time_base) if self._stream.time_base else 0.0
        n = 0
        self.session_error = ""
        arrivals = _Arrivals()
        last = _now()  # arrival of the last packet with data: what frames flushed at the end get
        packets = self._container.demux(self._stream)
        while True:
            try:
                packet = next(packets)
            except StopIteration:
                break
            except (av.error.FFmpegError, OSError) as err:
                # A demuxer that raised is finished (a read timeout, a reset connection, a truncated
                # file): the session ends here, with its reason; the runner decides what follows.
                self.session_error = redact_url(str(err))
                break
            got = _now()
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
                c0 = time.monotonic()
                rgb = frame.to_ndarray(format="rgb24")
                convert_s = time.monotonic() - c0
                # The first RTSP frame can lack a pts: fall back to the frame index.
                pts = frame.pts * tb if frame.pts is not None and tb else (n / self.fps if self.fps else 0.0)
                t_mono, t_wall = arrivals.pop(frame.pts, last)
                yield DecodedFrame(rgb, float(pts), decode_s + convert_s, t_mono, t_wall)
                n += 1

    def close(self) -> None:
        if self._container is not None:
            try:
                self._container.close()
            except av.error.FFmpegError:
                pass
        self._container = self._stream = None


class FileSource(_PyAVSource):
    """Any container PyAV opens. End of file ends the stream (or loops, if configured)."""


class NetworkSource(_PyAVSource):
    """A network URL (rtsp, rtsps, http(s), rtmp, udp, srt, tcp): open and read timeouts always set.

    When its session ends the runner reconnects. RTSP goes over TCP (no UDP loss).
    """

    network = True

    def __init__(self, stream_id: str, url: str, *, open_timeout_s: float = 5.0, read_timeout_s: float = 2.5,
                 max_frame_pixels: int = 8192 * 8192):
        super().__init__(stream_id, url, max_frame_pixels=max_frame_pixels)
        self.open_timeout_s, self.read_timeout_s = open_timeout_s, read_timeout_s

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

