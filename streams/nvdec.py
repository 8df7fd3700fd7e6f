"""NVDEC decoding (NVIDIA's PyNvVideoCodec) of the packets PyAV demuxes, into NV12 frames in GPU memory.

PyAV keeps the demuxing, so every URL scheme, timeout, cancel, reconnect and the packets' arrival times
stay those of streams/pyav.py; only what happens to a packet after it arrived differs. PyNvVideoCodec's
own demuxer opens rtsp:// with no options and no timeouts, which is why it is not used.

What the decoder is fed and how it is driven (facts from PyNvVideoCodec 2.2.4, ../shared/gpu/README.md):
  * Annex-B bitstreams: H.264/HEVC from MP4/MKV (length-prefixed, avcC/hvcC extradata) go through FFmpeg's
    `*_mp4toannexb` filter; MPEG-TS, RTSP and raw .h264 are Annex-B already and are not filtered.
  * LOW latency and one picture per packet (ENDOFPICTURE): a frame comes out of the Decode call of its own
    packet. The default (NATIVE) holds 4 frames back: 133 ms at 30 fps that no deadline would see.
  * One CUDA stream per decoder (its own torch.cuda.Stream): with stream 0 the package synchronises the
    whole device after every frame, stalling every model on the GPU.
  * The next Decode call reuses the surfaces of the frames the last one returned, so every frame is copied
    out, on the decoder's stream, into a tensor the DecodedFrame owns before Decode is called again; a
    CUDA event recorded after the copy (DecodedFrame.ready) lets a reader on another stream wait for it.
  * A decoder that raised is never used again: it is discarded (counted in `decode_errors`) and a new
    one is built at the next keyframe, from which decoding resumes.
  * The package is imported lazily: on a machine without the NVIDIA driver `import PyNvVideoCodec`
    raises RuntimeError ("Failed to load NVENC library"), not ImportError; that reads as "unavailable".

`decode: auto | cpu | cuda` is resolved when a stream opens (the codec is known only then), before its
first packet: resolve_decode says where and why; the source shows it as `decode_device` / `decode_reason`.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, Callable, Iterator, Literal, Optional, Protocol

import av

from engine.errors import SourceOpenError
from streams.base import DecodedFrame
from streams.colour import UnsupportedColourError, colour_from_av
from streams.pyav import FileSource, NetworkSource, _Arrivals, _now, frame_pts

log = logging.getLogger("vidar.source")

Decode = Literal["auto", "cpu", "cuda"]
DECODE_CHOICES: tuple[str, ...] = ("auto", "cpu", "cuda")

#: PyAV codec name -> PyNvVideoCodec's cudaVideoCodec member: the codecs NVDEC decodes (cuviddec.h) whose
#: packets PyAV hands out in a form NVDEC parses (after Annex-B conversion for H.264/HEVC). MPEG-4 part 2
#: and VC-1 are left out: NVDEC wants their headers (container extradata) prepended, which is not done here.
NVDEC_CODECS: dict[str, str] = {
    "h264": "H264", "hevc": "HEVC", "av1": "AV1", "vp9": "VP9", "vp8": "VP8",
    "mpeg1video": "MPEG1", "mpeg2video": "MPEG2",
}
#: what the NV12 contract of DecodedFrame.nv12 covers: 8-bit 4:2:0 (NVDEC gives P016 for 10-bit, and
#: planar 4:4:4 for 4:4:4 streams)
NV12_PIX_FMTS = frozenset({"yuv420p", "yuvj420p", "nv12"})
_ANNEXB_FILTERS = {"h264": "h264_mp4toannexb", "hevc": "hevc_mp4toannexb"}
#: packets (tickets) whose frame has not come out yet: bounded as _Arrivals is (a packet NVDEC drops is forgotten)
_IN_FLIGHT = 64


# -- what runs where: the pure decision ------------------------------------------------------------------
def resolve_decode(requested: str, codec_name: Optional[str], *, cuda_available: bool,
                   nvdec_import: Callable[[], ModuleType], stream_id: str = "",
                   pix_fmt: Optional[str] = None) -> tuple[str, str]:
    """Where a stream's video is decoded: ("cpu" | "cuda", why).

    Args:
        requested: the stream's `decode` (auto | cpu | cuda).
        codec_name: PyAV's codec name ("h264", ...); None when not known yet (before the stream opens:
            only the machine is checked then).
        cuda_available: whether torch sees a CUDA device.
        nvdec_import: imports PyNvVideoCodec (called only when it matters); ImportError, RuntimeError
            (no NVIDIA driver) and OSError mean "unavailable here".
        stream_id: named in the error.
        pix_fmt: PyAV's pixel format when known; NVDEC frames are NV12, so only 8-bit 4:2:0 qualifies.

    Raises:
        ValueError: `requested` is not one of auto, cpu, cuda.
        SourceOpenError: decode: cuda, and NVDEC cannot decode this stream here (names the stream and the fix).

    Example:
        >>> resolve_decode("auto", "h264", cuda_available=False, nvdec_import=lambda: None)
        ('cpu', 'auto: no CUDA device (torch.cuda.is_available() is False)')
    """
    if requested not in DECODE_CHOICES:
        raise ValueError(f"decode={requested!r}: allowed: {', '.join(DECODE_CHOICES)}")
    if requested == "cpu":
        return "cpu", "decode: cpu"
    why = _why_not_nvdec(codec_name, pix_fmt, cuda_available, nvdec_import)
    if why is None:
        what = f"{codec_name} on NVDEC" if codec_name else "NVDEC"
        return "cuda", f"{requested}: {what}"
    if requested == "auto":
        return "cpu", f"auto: {why}"
    raise SourceOpenError(stream_id, f"decode: cuda, but {why}; install the gpu extra (pip install "
                                     "'vidar[gpu]') on a machine with an NVIDIA GPU and driver, or set "
                                     "decode: cpu (or auto) for this stream")


def _why_not_nvdec(codec_name: Optional[str], pix_fmt: Optional[str], cuda_available: bool,
                   nvdec_import: Callable[[], ModuleType]) -> Optional[str]:
    """Why NVDEC cannot decode this stream here (None: it can). Cheapest checks first: the import last."""
    if codec_name is not None and codec_name not in NVDEC_CODECS:
        return f"NVDEC does not decode {codec_name!r} here (it does: {', '.join(NVDEC_CODECS)})"
    if pix_fmt is not None and pix_fmt not in NV12_PIX_FMTS:
        return f"pixel format {pix_fmt!r} is not 8-bit 4:2:0 (NVDEC frames here are NV12 only)"
    if not cuda_available:
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        nvdec_import()
    except (ImportError, RuntimeError, OSError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]  # its import error runs to 30 lines of advice
        return f"PyNvVideoCodec is unavailable ({type(err).__name__}: {first})"
    return None


def annexb_filter(codec_name: str, extradata: Optional[bytes]) -> Optional[str]:
    """The bitstream filter a stream's packets need before NVDEC (None: none). H.264/HEVC in MP4/MKV are
    length-prefixed, announced by avcC/hvcC extradata; Annex-B extradata (raw .h264, MPEG-TS, RTSP) or none
    means the packets carry start codes already, and filtering them again would only cost a copy."""
    name = _ANNEXB_FILTERS.get(codec_name)
    if name is None or not extradata or extradata.startswith((b"\x00\x00\x01", b"\x00\x00\x00\x01")):
        return None
    return name


def tell_choice(stream_id: str, device: str, reason: str, *, cuda_available: bool) -> None:
    """Log where a stream is decoded. auto falling back to the CPU on a machine with CUDA is a warning (a
    GPU machine decoding on its CPU is slow for a reason someone should fix); without CUDA it is expected."""
    if device == "cuda":
        log.info("stream %s: decoding with NVDEC (%s)", stream_id, reason)
    else:
        log.log(logging.WARNING if cuda_available else logging.INFO, "stream %s: decoding on the CPU: %s",
                stream_id, reason)


# -- the two seams tests replace: the package's import and the CUDA calls --------------------------------
_import_lock = threading.Lock()
_imported: Optional[ModuleType] = None
_import_error: Optional[BaseException] = None


def load_pynvvideocodec() -> ModuleType:
    """`import PyNvVideoCodec`, once per process (a failed import is remembered too: it loads shared
    libraries, and would be retried at every reconnect otherwise). Raises what the import raised."""
    global _imported, _import_error
    with _import_lock:
        if _imported is None and _import_error is None:
            try:
                import PyNvVideoCodec  # the gpu extra; absent or unloadable on CPU machines
                _imported = PyNvVideoCodec
            except (ImportError, RuntimeError, OSError) as err:
                _import_error = err
        if _import_error is not None:
            raise _import_error.with_traceback(None)
        return _imported


class CudaOps(Protocol):
    """The torch.cuda calls this module makes, in one place, so tests run the adapter on the CPU."""

    def is_available(self) -> bool: ...
    def new_stream(self, gpu: int) -> Any: ...
    def new_event(self) -> Any: ...
    def stream_context(self, stream: Any) -> AbstractContextManager: ...


class TorchCuda:
    """CudaOps through torch (imported when first used: streams imports no torch otherwise)."""

    def is_available(self) -> bool:
        import torch
        return torch.cuda.is_available()

    def new_stream(self, gpu: int) -> Any:
        import torch
        return torch.cuda.Stream(device=gpu)  # its own stream: never 0, the legacy default stream

    def new_event(self) -> Any:
        import torch
        return torch.cuda.Event()

    def stream_context(self, stream: Any) -> AbstractContextManager:
        import torch
        return torch.cuda.stream(stream)


cuda_ops: CudaOps = TorchCuda()


class DecoderFailed(Exception):
    """A packet could not be decoded (internal: counted in decode_errors, as the CPU path counts corrupt
    packets). When the decoder itself raised, it has been discarded."""


class SessionOver(Exception):
    """NVDEC cannot go on with this session: a decoder could not be rebuilt, or its frames are not NV12
    (internal: ends the session with this reason, as a demuxer error does)."""


class _Tickets:
    """Packet -> ticket, the number NVDEC is given as the packet's timestamp and echoes on the frame it
    completes, and back to that packet's pts and arrival. A ticket, not the pts: a pts can be None (raw
    .h264, the first RTSP frames). Bounded as _Arrivals is (whose arrivals it keeps)."""

    def __init__(self) -> None:
        self._arrivals = _Arrivals(_IN_FLIGHT)
        self._pts: dict[int, Optional[int]] = {}
        self._last = 0

    def add(self, pts: Optional[int], arrival: tuple[float, float]) -> int:
        self._last += 1
        self._arrivals.add(self._last, arrival)
        self._pts[self._last] = pts
        if len(self._pts) > _IN_FLIGHT:
            del self._pts[next(iter(self._pts))]  # the oldest: its frame never came out
        return self._last

    def pop(self, ticket: Optional[int], last: tuple[float, float]) -> tuple[Optional[int], tuple[float, float]]:
        """(pts, arrival) of the ticket's packet; (None, last) for one not known (NVDEC gave none back)."""
        return self._pts.pop(ticket, None), self._arrivals.pop(ticket, last)


class NvdecSession:
    """One open stream's NVDEC decoder, the CUDA stream it runs on and its Annex-B filter.

    `decode(packet, ticket)` returns the frames that packet completed as (ticket, nv12, ready), each nv12
    copied out of the decoder's surface into its own tensor (the next Decode call overwrites the surfaces),
    on the decoder's stream, with an event recorded after the copy. Built when the stream opens.
    """

    def __init__(self, nvc: ModuleType, stream: Any, *, gpu: int = 0):
        cc = stream.codec_context
        self._nvc, self._gpu = nvc, gpu
        self._codec = getattr(nvc.cudaVideoCodec, NVDEC_CODECS[cc.name])
        self.filter_name = annexb_filter(cc.name, cc.extradata)
        self._filter = av.bitstream.BitStreamFilterContext(self.filter_name, stream) if self.filter_name else None
        self.cuda_stream = cuda_ops.new_stream(gpu)
        # pybind11's exceptions derive from Exception, not from each other: catch every one the package
        # names, and RuntimeError (a std::runtime_error out of the extension)
        named = (getattr(nvc, k) for k in dir(nvc) if k.startswith("PyNvVCException"))
        self._errors = tuple(v for v in named if isinstance(v, type) and issubclass(v, Exception)) + (RuntimeError,)
        self._decoder: Any = self._create()  # at open: a codec or size this GPU refuses shows before any packet

    def _create(self) -> Any:
        nvc = self._nvc
        return nvc.CreateDecoder(gpuid=self._gpu, codec=self._codec, cudacontext=0,
                                 cudastream=self.cuda_stream.cuda_stream, usedevicememory=True,
                                 latency=nvc.DisplayDecodeLatencyType.LOW)

    def decode(self, packet: av.Packet, ticket: int) -> list[tuple[Optional[int], Any, Any]]:
        """(ticket, nv12, ready) of each frame the packet completed; the empty packet flushes the decoder.

        Raises DecoderFailed when the decoder raised (it is discarded: packets are skipped until the next
        keyframe, where a new one is built), SessionOver when that rebuild fails or frames are not NV12.
        """
        if not packet.size:
            return self._call(self._packet_data(0, 0, 0)) if self._decoder is not None else []
        if self._decoder is None:
            if not packet.is_keyframe:
                return []  # a new decoder starts at a keyframe: what comes before it cannot be decoded
            try:
                self._decoder = self._create()
            except self._errors as err:
                raise SessionOver(f"the decoder could not be rebuilt ({type(err).__name__}: {err})") from err
        try:
            annexb = self._filter.filter(packet) if self._filter is not None else [packet]
        except av.error.FFmpegError as err:  # corrupt length prefixes: skipped, as the CPU path skips them
            raise DecoderFailed(f"{self.filter_name}: {err}") from err
        out = []
        for part in annexb:
            out += self._call(self._packet_data(part.buffer_ptr, part.size, ticket))
        return out

    def _packet_data(self, ptr: int, size: int, ticket: int) -> Any:
        pd = self._nvc.PacketData()
        pd.bsl_data, pd.bsl = ptr, size  # bsl 0: end of stream, the decoder hands out what it holds
        pd.pts = ticket
        if size:
            pd.decode_flag = self._nvc.VideoPacketFlag.ENDOFPICTURE  # one picture per packet: out at once
        return pd

    def _call(self, pd: Any) -> list[tuple[Optional[int], Any, Any]]:
        try:
            surfaces = self._decoder.Decode(pd)
        except self._errors as err:
            self._decoder = None  # never used again: its state after an error is undefined
            raise DecoderFailed(f"{type(err).__name__}: {err}") from err
        # every frame copied out before the next Decode call reuses the surfaces
        return [(getattr(s, "timestamp", None), *self._copy_out(s)) for s in surfaces]

    def _copy_out(self, surface: Any) -> tuple[Any, Any]:
        import torch
        with cuda_ops.stream_context(self.cuda_stream):  # torch hands this stream to the producer's __dlpack__
            src = torch.from_dlpack(surface)
            if src.dtype != torch.uint8 or src.dim() != 2 or src.shape[0] % 3:
                raise SessionOver(f"NVDEC gave {tuple(src.shape)} {src.dtype} frames, not NV12 "
                                  "(10-bit or 4:4:4 video?): set decode: cpu for this stream")
            nv12 = torch.empty(src.shape, dtype=src.dtype, device=src.device)  # contiguous, the frame's own
            nv12.copy_(src)
            ready = cuda_ops.new_event()
            ready.record(self.cuda_stream)
        return nv12, ready


class _NvdecDecoding:
    """Mixed into FileSource / NetworkSource: at each open, `decode` is resolved against the stream's codec;
    on "cuda" the packets go to an NvdecSession, else to PyAV exactly as before."""

    def __init__(self, *args: Any, decode: Decode = "auto", gpu: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if decode not in ("auto", "cuda"):
            raise ValueError(f"decode={decode!r}: an NVDEC source takes auto or cuda (cpu: streams.pyav)")
        self.decode, self.gpu = decode, gpu
        self.decode_device: Optional[str] = None
        self.decode_reason = f"{decode}: decided when the stream opens (its codec)"
        self.filter_name: Optional[str] = None  # the Annex-B filter this session's packets go through
        self._session: Optional[NvdecSession] = None
        self._told: Optional[tuple[str, str]] = None  # the choice last logged: a reconnect does not repeat it

    def open(self) -> None:
        super().open()
        try:
            self._choose()
        except SourceOpenError:
            self.close()
            raise

    def _choose(self) -> None:
        cc, cuda = self._stream.codec_context, cuda_ops.is_available()
        # The first open decides for the stream's life: its ring's slots were made for that decoder's frames
        # (NV12 in GPU memory, or RGB on the host), so a reopen (a reconnect, a looping file) keeps it.
        requested = self.decode if self._told is None else self._told[0]
        device, reason = resolve_decode(requested, cc.name, cuda_available=cuda,
                                        nvdec_import=load_pynvvideocodec, stream_id=self.stream_id,
                                        pix_fmt=cc.pix_fmt)
        if self._told is not None:
            reason = self._told[1]
        self._session = None
        if device == "cuda":
            try:  # NVDEC's NV12 goes through our conversion: a matrix it does not know is decoded on the CPU
                colour_from_av(cc.colorspace, cc.color_range, cc.pix_fmt)
            except UnsupportedColourError as err:
                if requested == "cuda":
                    raise SourceOpenError(self.stream_id, f"decode: cuda, but {err}") from None
                device, reason = "cpu", f"auto: {err}"
        if device == "cuda":
            try:
                self._session = NvdecSession(load_pynvvideocodec(), self._stream, gpu=self.gpu)
            except Exception as err:  # CreateDecoder refusing the stream (size, profile): pybind11's errors
                why = f"NVDEC refused the stream ({type(err).__name__}: {str(err)[:200]})"
                if requested == "cuda":
                    raise SourceOpenError(self.stream_id, f"decode: cuda, but {why}; set decode: cpu "
                                                          "(or auto) for this stream") from None
                device, reason = "cpu", f"auto: {why}"
        self.filter_name = self._session.filter_name if self._session else None
        self.decode_device, self.decode_reason = device, reason
        if self._told != (device, reason):  # once per stream while the choice holds, not at every reconnect
            self._told = (device, reason)
            tell_choice(self.stream_id, device, reason, cuda_available=cuda)

    def _decode(self, packets: Iterator[tuple[av.Packet, tuple[float, float]]]) -> Iterator[DecodedFrame]:
        session = self._session
        if session is None:  # decode resolved to the CPU: PyAV, exactly as a plain PyAV source
            yield from super()._decode(packets)
            return
        cc = self._stream.codec_context
        colour = colour_from_av(cc.colorspace, cc.color_range, cc.pix_fmt)  # checked in _choose: supported
        tb = float(self._stream.time_base) if self._stream.time_base else 0.0
        tickets, last, n = _Tickets(), _now(), 0
        for packet, got in packets:
            ticket = 0
            if packet.size:  # the empty packet at the end only flushes the decoder
                last = got
                ticket = tickets.add(packet.pts, got)  # read before the filter: it consumes the packet
            try:
                decoded = session.decode(packet, ticket)
            except DecoderFailed:
                self.decode_errors += 1  # decoding resumes at the next keyframe, with a new decoder
                continue
            except SessionOver as err:
                self.session_error = f"NVDEC: {err}"
                return
            decode_s = time.monotonic() - got[0]  # packet -> frames copied out, never the wait for packets
            for echoed, nv12, ready in decoded:
                pts, (t_mono, t_wall) = tickets.pop(echoed, last)
                yield DecodedFrame(None, float(frame_pts(pts, tb, n, self.fps)), decode_s, t_mono, t_wall,
                                   nv12=nv12, ready=ready, colour=colour)
                n += 1

    def close(self) -> None:
        self._session = None  # the decoder and its surfaces go; frames handed out own their copies
        super().close()


class NvdecFileSource(_NvdecDecoding, FileSource):
    """A file (or named pipe) demuxed by PyAV, decoded by NVDEC when `decode` resolves to cuda."""


class NvdecNetworkSource(_NvdecDecoding, NetworkSource):
    """A network stream demuxed by PyAV (its timeouts, reconnects), decoded by NVDEC when `decode` resolves to cuda."""
