"""NVDEC decoding (NVIDIA's PyNvVideoCodec) of the packets PyAV demuxes, into NV12 frames in GPU memory.

PyAV keeps the demuxing, so every URL scheme, timeout, cancel, reconnect and the packets' arrival times
stay those of streams/pyav.py; only what happens to a packet after it arrived differs. PyNvVideoCodec's
own demuxer opens rtsp:// with no options and no timeouts, which is why it is not used.

What the decoder is fed and how it is driven (facts from PyNvVideoCodec 2.2.4, ../shared/gpu/README.md):
  * Annex-B bitstreams with their parameter sets before the first slice of every decoder: H.264/HEVC from
    MP4/MKV (length-prefixed, avcC/hvcC extradata) go through FFmpeg's `*_mp4toannexb` filter (which also
    puts SPS/PPS before each IDR); RTSP and raw .h264 are Annex-B already, but a camera may send its
    parameter sets only in the SDP (FFmpeg puts them in the extradata, not in the packets), so those go
    through FFmpeg's `dump_extra`, which puts the extradata before every keyframe (packet_filter).
  * LOW latency and one picture per packet (ENDOFPICTURE): a frame comes out of the Decode call of its own
    packet. The default (NATIVE) holds 4 frames back: 133 ms at 30 fps that no deadline would see.
  * One CUDA stream per decoder (its own torch.cuda.Stream): with stream 0 the package synchronises the
    whole device after every frame, stalling every model on the GPU.
  * The next Decode call reuses the surfaces of the frames the last one returned, so every frame is copied
    out, on the decoder's stream, into a tensor the DecodedFrame owns before Decode is called again; a
    CUDA event recorded after the copy (DecodedFrame.ready) lets a reader on another stream wait for it.
  * A decoder that raised is never used again: it is discarded (counted in `decode_errors`) and a new
    one is built at the next keyframe, from which decoding resumes. A failure before the stream's first
    NVDEC frame is NVDEC refusing the stream (its capability check runs in the first Decode): `auto` goes
    on on the CPU from that packet, with the reason; `cuda` fails the stream with it.
  * The package is imported lazily: on a machine without the NVIDIA driver `import PyNvVideoCodec`
    raises RuntimeError ("Failed to load NVENC library"), not ImportError; that reads as "unavailable".

`decode: auto | cpu | cuda` is resolved when a stream opens (the codec and size are known only then), before
its first packet, against this GPU's NVDEC capabilities (streams/nvdec_caps.py): resolve_decode says where and
why; the source shows it as `decode_device` / `decode_reason`.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, Callable, Iterator, Literal, Mapping, Optional, Protocol, Union

import av

from engine.errors import SourceOpenError
from streams.base import DecodedFrame
from streams.colour import UnsupportedColourError, colour_from_av
from engine.errors import SourceError
from streams.nvdec_caps import NVDEC_CODECS, caps_refusal, decoder_caps, odd_size
from streams.pyav import FileSource, NetworkSource, _Arrivals, _now, frame_pts

log = logging.getLogger("vidar.source")

Decode = Literal["auto", "cpu", "cuda"]
DECODE_CHOICES: tuple[str, ...] = ("auto", "cpu", "cuda")

#: what the NV12 contract of DecodedFrame.nv12 covers: 8-bit 4:2:0 (NVDEC gives P016 for 10-bit, and
#: planar 4:4:4 for 4:4:4 streams)
NV12_PIX_FMTS = frozenset({"yuv420p", "yuvj420p", "nv12"})
_ANNEXB_FILTERS = {"h264": "h264_mp4toannexb", "hevc": "hevc_mp4toannexb"}
_ANNEXB_START = (b"\x00\x00\x01", b"\x00\x00\x00\x01")
#: the fixes a refusal names: the machine cannot decode with NVDEC at all, or this stream cannot be
_MACHINE_FIX = ("install the gpu extra (pip install 'vidar[gpu]') on a machine with an NVIDIA GPU and driver, "
                "or set decode: cpu (or auto) for this stream")
_STREAM_FIX = "set decode: cpu (or auto) for this stream"
#: packets (tickets) whose frame has not come out yet: bounded as _Arrivals is (a packet NVDEC drops is forgotten)
_IN_FLIGHT = 64


# -- what runs where: the pure decision ------------------------------------------------------------------
#: GetDecoderCaps asked for (module, codec name): a Mapping, or a str saying why the query failed
CapsQuery = Callable[[ModuleType, str], Union[Mapping, str]]


def resolve_decode(requested: str, codec_name: Optional[str], *, cuda_available: bool,
                   nvdec_import: Callable[[], ModuleType], stream_id: str = "",
                   pix_fmt: Optional[str] = None, size: Optional[tuple[int, int]] = None,
                   caps: Optional[CapsQuery] = None) -> tuple[str, str]:
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
        size: (width, height) when known: an odd one is decoded on the CPU, and the caps are checked against it.
        caps: asks this GPU's NVDEC capabilities for a codec (streams/nvdec_caps.py decoder_caps), called
            last, with the imported module; None: not asked.

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
    refused = _why_not_nvdec(codec_name, pix_fmt, size, cuda_available, nvdec_import, caps)
    if refused is None:
        what = f"{codec_name} on NVDEC" if codec_name else "NVDEC"
        return "cuda", f"{requested}: {what}"
    why, fix = refused
    if requested == "auto":
        return "cpu", f"auto: {why}"
    raise SourceOpenError(stream_id, f"decode: cuda, but {why}; {fix}")


def _why_not_nvdec(codec_name: Optional[str], pix_fmt: Optional[str], size: Optional[tuple[int, int]],
                   cuda_available: bool, nvdec_import: Callable[[], ModuleType],
                   caps: Optional[CapsQuery]) -> Optional[tuple[str, str]]:
    """(why, the fix) NVDEC cannot decode this stream here (None: it can). Cheapest checks first: the
    import, then the GPU's capabilities (a CUDA context each, once per codec) last."""
    if codec_name is not None and codec_name not in NVDEC_CODECS:
        return f"NVDEC does not decode {codec_name!r} here (it does: {', '.join(NVDEC_CODECS)})", _STREAM_FIX
    if pix_fmt is not None and pix_fmt not in NV12_PIX_FMTS:
        return f"pixel format {pix_fmt!r} is not 8-bit 4:2:0 (NVDEC frames here are NV12 only)", _STREAM_FIX
    odd = odd_size(size)
    if odd:
        return odd, _STREAM_FIX
    if not cuda_available:
        return "no CUDA device (torch.cuda.is_available() is False)", _MACHINE_FIX
    try:
        module = nvdec_import()
    except (ImportError, RuntimeError, OSError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]  # its import error runs to 30 lines of advice
        return f"PyNvVideoCodec is unavailable ({type(err).__name__}: {first})", _MACHINE_FIX
    if caps is None or codec_name is None:
        return None
    known = caps(module, codec_name)
    if isinstance(known, str):
        return f"NVDEC's capabilities could not be read (GetDecoderCaps: {known})", _MACHINE_FIX
    why = caps_refusal(known, codec_name, size)
    return (why, _STREAM_FIX) if why else None


def packet_filter(codec_name: str, extradata: Optional[bytes]) -> Optional[str]:
    """The bitstream filter a stream's packets go through before NVDEC (None: none).

    H.264/HEVC in MP4/MKV are length-prefixed, announced by avcC/hvcC extradata: `*_mp4toannexb`, which
    also puts the parameter sets before each IDR. With Annex-B extradata (RTSP's sprop-parameter-sets, raw
    .h264) the packets carry start codes, but the parameter sets may be in the extradata only (GStreamer's
    rtph264pay with its default config-interval 0, `ffmpeg -c copy -f rtsp`): FFmpeg's `dump_extra` puts
    the extradata before every keyframe packet that does not start with it, so every decoder, a session's
    first and each one rebuilt (at a keyframe), has them before its first slice; NVDEC's parser drops
    slices it has no parameter sets for, and such a stream would decode nothing. It copies keyframe packets
    only (others pass by reference); parameter sets sent in-band as well arrive twice, which a parser reads
    as the same sets again. No extradata, or other codecs: none.
    """
    name = _ANNEXB_FILTERS.get(codec_name)
    if name is None or not extradata:
        return None
    return "dump_extra" if extradata.startswith(_ANNEXB_START) else name


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
    def initialized(self) -> bool: ...


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

    def initialized(self) -> bool:
        """Whether this process made its CUDA context (held until it exits): never imports torch to answer."""
        torch = sys.modules.get("torch")
        return torch is not None and torch.cuda.is_initialized()


cuda_ops: CudaOps = TorchCuda()


class DecoderFailed(Exception):
    """A packet could not be decoded (internal: counted in decode_errors, as the CPU path counts corrupt
    packets). When the decoder itself raised (`decoder_raised`), it has been discarded; else the packet's
    bitstream filter refused it (corrupt data)."""

    def __init__(self, message: str, *, decoder_raised: bool):
        super().__init__(message)
        self.decoder_raised = decoder_raised


class SessionOver(Exception):
    """NVDEC cannot go on decoding this connection: a decoder could not be rebuilt, or its frames are not NV12
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
    """One open stream's NVDEC decoder, the CUDA stream it runs on and its bitstream filter (packet_filter).

    `decode(packet, ticket)` returns the frames that packet completed as (ticket, nv12, ready), each nv12
    copied out of the decoder's surface into its own tensor (the next Decode call overwrites the surfaces),
    on the decoder's stream, with an event recorded after the copy. Built when the stream opens.

    The events are the session's own, re-recorded, not made per frame (torch's CUDAEventPool: concurrent
    cudaEventCreate calls "can incur significant cost on some device/driver combinations", and 48 decoder
    threads would make 2,880 a second): the i-th frame of a decode() call gets the i-th event, so a `ready` is
    valid until the next decode() call. What makes that enough: whoever takes a frame queues its wait on `ready`
    (a GPU stream's wait_event, which waits for the record made before it) or syncs on it before it asks for the
    next frame (streams.nvdec._NvdecDecoding yields each frame before the next packet is decoded).
    """

    def __init__(self, nvc: ModuleType, stream: Any, *, gpu: int = 0):
        cc = stream.codec_context
        self._nvc, self._gpu = nvc, gpu
        self._codec = getattr(nvc.cudaVideoCodec, NVDEC_CODECS[cc.name])
        self.filter_name = packet_filter(cc.name, cc.extradata)
        self._filter = av.bitstream.BitStreamFilterContext(self.filter_name, stream) if self.filter_name else None
        self.cuda_stream = cuda_ops.new_stream(gpu)
        # pybind11's exceptions derive from Exception, not from each other: catch every one the package
        # names, and RuntimeError (a std::runtime_error out of the extension)
        named = (getattr(nvc, k) for k in dir(nvc) if k.startswith("PyNvVCException"))
        self._errors = tuple(v for v in named if isinstance(v, type) and issubclass(v, Exception)) + (RuntimeError,)
        # CreateDecoder only makes NVIDIA's parser: a codec or size this GPU refuses shows in the first Decode
        # (resolve_decode checked the caps before this; _NvdecDecoding handles a first Decode that raises)
        self._decoder: Any = self._create()
        self._events: list[Any] = []  # the frames' ready events, re-recorded (class docstring)
        self._next_event = 0          # the next one a frame of this decode() call takes

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
        self._next_event = 0  # the frames of the last call were taken (their waits queued) before this one
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
            raise DecoderFailed(f"{self.filter_name}: {err}", decoder_raised=False) from err
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
            raise DecoderFailed(f"{type(err).__name__}: {err}", decoder_raised=True) from err
        # every frame copied out before the next Decode call reuses the surfaces
        return [(getattr(s, "timestamp", None), *self._copy_out(s)) for s in surfaces]

    def _copy_out(self, surface: Any) -> tuple[Any, Any]:
        import torch
        with cuda_ops.stream_context(self.cuda_stream):  # torch hands this stream to the producer's __dlpack__
            src = torch.from_dlpack(surface)
            if src.dtype != torch.uint8 or src.dim() != 2 or src.shape[0] % 3:
                # not NV12's (H * 3/2, W) uint8: 10-bit (P016) or 4:4:4 planes, or a size that turned odd
                # mid-stream (an odd size at open is decoded on the CPU: nvdec_caps.odd_size)
                raise SessionOver(f"NVDEC gave {tuple(src.shape)} {src.dtype} frames, not NV12 (H * 3/2, W) "
                                  "uint8 (10-bit or 4:4:4 video, or an odd frame size?): set decode: cpu for "
                                  "this stream")
            nv12 = torch.empty(src.shape, dtype=src.dtype, device=src.device)  # contiguous, the frame's own
            nv12.copy_(src)
            ready = self._event()
            ready.record(self.cuda_stream)
        return nv12, ready

    def _event(self) -> Any:
        """The next ready event of this decode() call: made the first time a call hands out that many frames."""
        if self._next_event == len(self._events):
            self._events.append(cuda_ops.new_event())
        self._next_event += 1
        return self._events[self._next_event - 1]


class _NvdecDecoding:
    """Mixed into FileSource / NetworkSource: at each open, `decode` is resolved against the stream's codec,
    size and this GPU's NVDEC caps; on "cuda" the packets go to an NvdecSession, else to PyAV exactly as before."""

    def __init__(self, *args: Any, decode: Decode = "auto", gpu: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if decode not in ("auto", "cuda"):
            raise ValueError(f"decode={decode!r}: an NVDEC source takes auto or cuda (cpu: streams.pyav)")
        self.decode, self.gpu = decode, gpu
        self.decode_device: Optional[str] = None
        self.decode_reason = f"{decode}: decided when the stream opens (its codec)"
        self.filter_name: Optional[str] = None  # the bitstream filter this connection's packets go through
        self._session: Optional[NvdecSession] = None
        self._told: Optional[tuple[str, str]] = None  # the choice last logged: a reconnect does not repeat it
        self.nvdec_frames = 0  # NVDEC frames handed out over the stream's life: once one is, its ring holds NV12

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
                                        pix_fmt=cc.pix_fmt, size=(cc.width or 0, cc.height or 0),
                                        caps=lambda nvc, codec: decoder_caps(nvc, self.gpu, codec))
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
            except Exception as err:  # CreateDecoder refusing its arguments: pybind11's errors
                why = f"NVDEC refused the stream ({type(err).__name__}: {str(err)[:200]})"
                if requested == "cuda":
                    raise SourceOpenError(self.stream_id, f"decode: cuda, but {why}; {_STREAM_FIX}") from None
                device, reason = "cpu", f"auto: {why}"
        self.filter_name = self._session.filter_name if self._session else None
        self._chosen(device, reason, cuda)

    def _chosen(self, device: str, reason: str, cuda: bool) -> None:
        self.decode_reason, self.decode_device = reason, device  # the reason first: cpu_fallback reads the device
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
            # until NVDEC's first frame, the packet is kept (the filter consumes it): if NVDEC refuses the
            # stream in this Decode, the CPU decodes it instead (a keyframe: the first one NVDEC parsed)
            kept = _copy(packet) if not self.nvdec_frames and packet.size else None
            if packet.size:  # the empty packet at the end only flushes the decoder
                last = got
                ticket = tickets.add(packet.pts, got)  # read before the filter: it consumes the packet
            try:
                decoded = session.decode(packet, ticket)
            except (DecoderFailed, SessionOver) as err:
                if n == 0 and not (isinstance(err, DecoderFailed) and not err.decoder_raised):
                    yield from self._failed_before_first_frame(err, kept, got, packets)
                    return
                if isinstance(err, SessionOver):
                    self.session_error = f"NVDEC: {err}"
                    return
                self.decode_errors += 1  # decoding resumes at the next keyframe, with a new decoder
                continue
            decode_s = time.monotonic() - got[0]  # packet -> frames copied out, never the wait for packets
            for echoed, nv12, ready in decoded:
                pts, (t_mono, t_wall) = tickets.pop(echoed, last)
                self.nvdec_frames += 1
                yield DecodedFrame(None, float(frame_pts(pts, tb, n, self.fps)), decode_s, t_mono, t_wall,
                                   nv12=nv12, ready=ready, colour=colour)
                n += 1

    def _failed_before_first_frame(self, err: Exception, kept: Optional[av.Packet], got: tuple[float, float],
                                   packets: Iterator[tuple[av.Packet, tuple[float, float]]]) -> Iterator[DecodedFrame]:
        """NVDEC failed before this session's first frame: NVDEC refusing the stream (its capability check
        runs in the first Decode), not a corrupt packet. Never a silent loop of rebuilds that yield nothing:

        * before the stream's first NVDEC frame, `auto` decodes on the CPU from the failed packet on, and says
          why in the stream's state (its ring has no frame yet, so it takes RGB slots); a reopen stays there;
        * `decode: cuda` fails the stream with the reason (SourceError: the ingest thread fails it);
        * after earlier sessions gave NVDEC frames (the ring holds NV12 in GPU memory) the session ends with
          the reason: a network stream reconnects with backoff, a file ends early.
        """
        why = (f"Decode raised {err}" if isinstance(err, DecoderFailed) else str(err))[:300]
        if self.nvdec_frames:
            self.session_error = (f"NVDEC: failed before this session's first frame ({why}); the stream's "
                                  "earlier frames were NVDEC's (NV12 in GPU memory), so it does not switch to the CPU")
            return
        if self.decode == "cuda":
            raise SourceError(self.stream_id, f"decode: cuda, but NVDEC failed before the stream's first frame "
                                              f"({why}); {_STREAM_FIX}")
        self._session, self.filter_name = None, None
        self._chosen("cpu", f"auto: NVDEC failed before the stream's first frame ({why})", True)
        yield from super()._decode(itertools.chain([(kept, got)] if kept is not None else [], packets))

    def close(self) -> None:
        self._session = None  # the decoder and its surfaces go; frames handed out own their copies
        super().close()


def nvdec_possible(source: Any) -> bool:
    """The source may decode with NVDEC (decode auto/cuda on a CUDA machine): where is decided when it opens."""
    return isinstance(source, _NvdecDecoding) and source.decode_device != "cpu"


def cpu_fallback(source: Any) -> Optional[str]:
    """Why a stream that could have decoded with NVDEC (`decode: auto` on a CUDA machine) decodes on the CPU, or
    None: it decodes with NVDEC, has not opened yet, or never could (no CUDA: a plain PyAV source). For an ingest
    process's stream the engine's copy of its source carries what the process reported (leases.py)."""
    if isinstance(source, _NvdecDecoding) and source.decode_device == "cpu":
        return source.decode_reason
    return None


def _copy(packet: av.Packet) -> av.Packet:
    """A packet of the same bytes and timing, for PyAV to decode (compressed data: kilobytes)."""
    again = av.Packet(bytes(packet))
    again.pts, again.dts, again.time_base = packet.pts, packet.dts, packet.time_base
    again.is_keyframe, again.stream = packet.is_keyframe, packet.stream
    return again


class NvdecFileSource(_NvdecDecoding, FileSource):
    """A file (or named pipe) demuxed by PyAV, decoded by NVDEC when `decode` resolves to cuda."""


class NvdecNetworkSource(_NvdecDecoding, NetworkSource):
    """A network stream demuxed by PyAV (its timeouts, reconnects), decoded by NVDEC when `decode` resolves to cuda."""
