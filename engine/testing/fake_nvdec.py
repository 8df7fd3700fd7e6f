"""A fake PyNvVideoCodec and fake CUDA streams/events, so streams/nvdec.py runs (and is checked) on a CPU.

FakeNvdec is module-like: it has the names the adapter uses (CreateDecoder, PacketData, cudaVideoCodec,
DisplayDecodeLatencyType, VideoPacketFlag, the PyNvVCException* classes). Its decoder decodes with PyAV
(software) underneath, so frames are real, and behaves as NVDEC does where the adapter could get it wrong:

  * it reads the packet from the pointer and size the adapter put in PacketData (bsl_data, bsl), so a
    buffer freed too early or a length-prefixed (not Annex-B) packet shows: FFmpeg's h264 decoder with no
    extradata cannot decode MP4's avcC packets;
  * it hands frames out as NV12 CPU tensors through `__dlpack__`, REUSING its surfaces: the i-th frame of
    every Decode call is written into the same buffer, so a frame not copied out before the next call
    changes under its reader (as NVDEC's surfaces do);
  * it holds back 4 frames unless LOW/ZERO latency was asked, and 1 when a packet lacks ENDOFPICTURE;
  * it records the CUDA stream it was given (0, the legacy default stream, must fail a test) and whether
    each `__dlpack__` happened while that stream was the current one;
  * it raises on chosen Decode calls (counted over all its decoders) and a decoder that raised keeps
    raising (so reusing it shows); CreateDecoder can be refused on chosen calls;
  * `reorder_delay` holds every frame back that many calls whatever the latency (B-frame reordering),
    so a frame's packet must be found from the timestamp it echoes, not from the last packet;
  * H.264/HEVC: like NVIDIA's parser, a decoder drops the slices that come before it has seen the parameter
    sets (SPS and PPS; HEVC also VPS): they give no frame, and are counted (`slices_without_params`); the
    NAL unit types of every packet each decoder got are recorded (`FakeDecoder.nals`);
  * `GetDecoderCaps(gpuid, codec, chromaformat, bitdepth)` answers with the dict PyNvVideoCodec 2.2.4 returns
    (the keys of PyNvDecoder.cpp's PyNvDecoderCaps; the values are set per codec by `caps`, made up for the
    tests, not a GPU's), and, as NVDEC's sequence callback does, `Decode` raises for a frame those caps
    refuse ("Codec not supported on this GPU", "Resolution not supported on this GPU"): CreateDecoder
    accepts any codec and size.

Install: `monkeypatch.setattr(nvdec, "load_pynvvideocodec", lambda: fake)` and
`monkeypatch.setattr(nvdec, "cuda_ops", fake.cuda)`.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
from dataclasses import dataclass, field
from typing import Iterator, Optional

import av
import torch


class cudaVideoCodec(enum.IntEnum):  # noqa: N801 - PyNvVideoCodec's name (cuviddec.h values)
    MPEG1 = 0
    MPEG2 = 1
    MPEG4 = 2
    VC1 = 3
    H264 = 4
    JPEG = 5
    H264_SVC = 6
    H264_MVC = 7
    HEVC = 8
    VP8 = 9
    VP9 = 10
    AV1 = 11


class DisplayDecodeLatencyType(enum.IntEnum):
    NATIVE = 0
    LOW = 1
    ZERO = 2


class VideoPacketFlag(enum.IntEnum):  # CUvideopacketflags
    ENDOFSTREAM = 0x01
    TIMESTAMP = 0x02
    DISCONTINUITY = 0x04
    ENDOFPICTURE = 0x08
    NOTIFY_EOS = 0x10


class PyNvVCExceptionDecode(Exception):
    pass


class PyNvVCExceptionUnsupported(Exception):
    pass


class cudaVideoChromaFormat(enum.IntEnum):  # noqa: N801 - cuviddec.h values
    Monochrome = 0
    YUV420 = 1  # PyNvVideoCodec names it "420"
    YUV422 = 2
    YUV444 = 3


#: what the fake's GetDecoderCaps answers unless `caps` says otherwise (made up: wide enough for the tests'
#: clips, 32x32 included; a real GPU's minimum is larger)
DEFAULT_CAPS = {"supported": 1, "num_decoder_engines": 7, "width_max": 4096, "height_max": 4096,
                "mb_num_max": 65536, "width_min": 16, "height_min": 16}
#: NAL unit types that are parameter sets / slices (H.264: 7 SPS, 8 PPS, 1-5 slices; HEVC: 32 VPS, 33 SPS,
#: 34 PPS, 0-31 slices)
_PARAMS = {"H264": {7, 8}, "HEVC": {32, 33, 34}}


def nal_types(codec: "cudaVideoCodec", data: bytes) -> list[int]:
    """The NAL unit types of an Annex-B H.264/HEVC buffer, in order (a start code never occurs inside a
    NAL unit: emulation prevention)."""
    out, i = [], data.find(b"\x00\x00\x01")
    while 0 <= i < len(data) - 3:
        header = data[i + 3]
        out.append(header & 0x1F if codec == cudaVideoCodec.H264 else (header >> 1) & 0x3F)
        i = data.find(b"\x00\x00\x01", i + 3)
    return out


def is_slice(codec: "cudaVideoCodec", nal: int) -> bool:
    return 1 <= nal <= 5 if codec == cudaVideoCodec.H264 else nal <= 31


class PacketData:
    """PyNvVideoCodec's PacketData: plain fields (bsl_data is a pointer, as an int)."""

    def __init__(self) -> None:
        self.bsl = self.bsl_data = self.pts = self.dts = self.key = self.decode_flag = self.bDiscontinuity = 0


_SOFTWARE = {cudaVideoCodec.H264: "h264", cudaVideoCodec.HEVC: "hevc", cudaVideoCodec.VP9: "vp9",
             cudaVideoCodec.VP8: "vp8", cudaVideoCodec.AV1: "libdav1d", cudaVideoCodec.MPEG2: "mpeg2video",
             cudaVideoCodec.MPEG1: "mpeg1video"}


# -- CUDA -------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class FakeStream:
    cuda_stream: int  # the handle the adapter gives CreateDecoder
    waited: list = field(default_factory=list)

    def wait_event(self, event: "FakeEvent") -> None:
        self.waited.append(event)


@dataclass(eq=False)
class FakeEvent:
    stream: Optional[FakeStream] = None  # where it was recorded
    recorded: int = 0

    def record(self, stream: Optional[FakeStream] = None) -> None:
        self.stream, self.recorded = stream, self.recorded + 1

    def query(self) -> bool:
        return self.recorded > 0

    def synchronize(self) -> None:
        pass


class FakeCuda:
    """streams.nvdec.CudaOps on the CPU: streams with non-zero handles, events, the current stream."""

    def __init__(self, available: bool = True):
        self.available = available
        self.streams: list[FakeStream] = []
        self.current: Optional[FakeStream] = None

    def is_available(self) -> bool:
        return self.available

    def initialized(self) -> bool:
        """As CUDA's context: made by the first stream, held after."""
        return bool(self.streams)

    def new_stream(self, gpu: int) -> FakeStream:
        self.streams.append(FakeStream(0x7F00 + len(self.streams)))
        return self.streams[-1]

    def new_event(self) -> FakeEvent:
        return FakeEvent()

    @contextlib.contextmanager
    def stream_context(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


# -- the decoder ------------------------------------------------------------------------------------------
class FakeFrame:
    """A decoded frame: a view of one of the decoder's surfaces (reused by its next Decode call)."""

    def __init__(self, owner: "FakeNvdec", surface: torch.Tensor, timestamp: int, stream: int):
        self._owner, self._surface, self.timestamp, self._stream = owner, surface, timestamp, stream

    def __dlpack__(self, *args, **kwargs):
        current = self._owner.cuda.current
        self._owner.dlpack_streams.append(current.cuda_stream if current is not None else None)
        return self._surface.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._surface.__dlpack_device__()


class FakeDecoder:
    def __init__(self, owner: "FakeNvdec", codec: cudaVideoCodec, cudastream: int, latency: DisplayDecodeLatencyType):
        self.owner, self.codec, self.cudastream, self.latency = owner, codec, cudastream, latency
        self._ctx = av.CodecContext.create(_SOFTWARE[codec], "r")
        self._ctx.thread_type = "NONE"  # frame threads would add their own hold-back
        self._held: list[av.VideoFrame] = []
        self._surfaces: list[torch.Tensor] = []
        self.broken = False
        self.calls = 0
        self.nals: list[list[int]] = []  # the NAL unit types of each packet (H.264/HEVC)
        self._params: set[int] = set()   # the parameter set types seen so far
        self._checked = False            # the "sequence callback" (the caps check) ran
        self._pending = b""              # NAL units of packets without a slice (parameter sets sent alone)

    def Decode(self, pd: PacketData) -> list[FakeFrame]:  # noqa: N802 - PyNvVideoCodec's name
        owner = self.owner
        owner.calls += 1
        self.calls += 1
        if self.broken:
            owner.calls_on_broken += 1
            raise PyNvVCExceptionDecode("fake: Decode on a decoder that raised before (discard it)")
        if owner.calls in owner.fail_on_calls:
            self.broken = True
            raise PyNvVCExceptionDecode(f"fake: decode failed on call {owner.calls}")
        owner.packets.append((pd.bsl, pd.decode_flag, pd.pts))
        if pd.bsl:
            data = ctypes.string_at(pd.bsl_data, pd.bsl)
            owner.annexb.append(data.startswith((b"\x00\x00\x01", b"\x00\x00\x00\x01")))
            if not self._has_params(data):
                owner.slices_without_params += 1
                owner.outputs_per_call.append(0)
                return []  # NVIDIA's parser drops slices it has no parameter sets for: no frame, no error
            if self.nals and not any(is_slice(self.codec, n) for n in self.nals[-1]):
                # NVIDIA's parser takes parameter sets in a packet of their own; FFmpeg's decoder refuses a
                # packet without a picture, so they go to it with the next one
                self._pending += data
                owner.outputs_per_call.append(0)
                return []
            data, self._pending = self._pending + data, b""
            packet = av.Packet(data)
            packet.pts = pd.pts
            got = self._ctx.decode(packet)
        else:
            got = self._ctx.decode(None)
        if got and not self._checked:
            self._sequence_check(got[0])
        self._held += got
        out, self._held = self._release(flush=not pd.bsl, end_of_picture=pd.decode_flag == VideoPacketFlag.ENDOFPICTURE)
        owner.outputs_per_call.append(len(out))
        return [self._to_surface(i, f) for i, f in enumerate(out)]

    def _has_params(self, data: bytes) -> bool:
        """Records the packet's NAL units; False when it holds a slice before the parameter sets."""
        needed = _PARAMS.get(self.codec.name)
        if needed is None:
            return True
        nals = nal_types(self.codec, data)
        self.nals.append(nals)
        for nal in nals:
            if is_slice(self.codec, nal) and not needed <= self._params:
                return False
            self._params |= {nal} & needed
        return True

    def _sequence_check(self, frame: av.VideoFrame) -> None:
        """What NvDecoder's sequence callback checks with cuvidGetDecoderCaps, in the first Decode that has a
        picture (CreateDecoder has accepted anything); this decoder is broken after it raised."""
        self._checked = True
        caps = self.owner.caps_of(self.codec)
        why = None
        if not caps["supported"]:
            why = "Codec not supported on this GPU"
        elif frame.width > caps["width_max"] or frame.height > caps["height_max"]:
            why = "Resolution not supported on this GPU"
        elif frame.width < caps["width_min"] or frame.height < caps["height_min"]:
            why = "Resolution not supported on this GPU"
        if why:
            self.broken = True
            raise PyNvVCExceptionUnsupported(f"fake: {why}")

    def _release(self, *, flush: bool, end_of_picture: bool) -> tuple[list, list]:
        if flush:
            return self._held, []
        low = self.latency in (DisplayDecodeLatencyType.LOW, DisplayDecodeLatencyType.ZERO)
        keep = 4 if not low else (0 if end_of_picture else 1)
        keep = max(keep, self.owner.reorder_delay)
        cut = max(0, len(self._held) - keep)
        return self._held[:cut], self._held[cut:]

    def _to_surface(self, i: int, frame: av.VideoFrame) -> FakeFrame:
        nv12 = torch.from_numpy(frame.to_ndarray(format="nv12"))
        if i == len(self._surfaces) or self._surfaces[i].shape != nv12.shape:
            self._surfaces[i:i + 1] = [torch.empty_like(nv12)]
            self.owner.surfaces.append(self._surfaces[i])
        self._surfaces[i].copy_(nv12)  # the surface is overwritten: what a reader without a copy sees changes
        return FakeFrame(self.owner, self._surfaces[i], frame.pts, self.cudastream)


class FakeNvdec:
    """The module-like fake (see the module docstring). Everything it saw is recorded on it."""

    cudaVideoCodec = cudaVideoCodec
    cudaVideoChromaFormat = cudaVideoChromaFormat
    DisplayDecodeLatencyType = DisplayDecodeLatencyType
    VideoPacketFlag = VideoPacketFlag
    PacketData = PacketData
    PyNvVCExceptionDecode = PyNvVCExceptionDecode
    PyNvVCExceptionUnsupported = PyNvVCExceptionUnsupported

    def __init__(self, cuda: Optional[FakeCuda] = None, *, fail_on_calls: tuple[int, ...] = (),
                 refuse_creates: tuple[int, ...] = (), reorder_delay: int = 0,
                 caps: Optional[dict[str, dict]] = None):
        self.cuda = cuda or FakeCuda()
        self.caps = caps or {}  # cudaVideoCodec name -> what differs from DEFAULT_CAPS
        self.caps_calls: list[tuple[int, str, int, int]] = []  # (gpuid, codec, chromaformat, bitdepth) asked
        self.slices_without_params = 0  # packets with a slice a decoder got before its parameter sets
        self.fail_on_calls, self.refuse_creates, self.reorder_delay = set(fail_on_calls), set(refuse_creates), reorder_delay
        self.decoders: list[FakeDecoder] = []
        self.creates = 0
        self.calls = 0
        self.calls_on_broken = 0
        self.packets: list[tuple[int, int, int]] = []   # (bsl, decode_flag, pts) of each call that decoded
        self.annexb: list[bool] = []                     # each data packet started with a start code
        self.outputs_per_call: list[int] = []
        self.dlpack_streams: list[Optional[int]] = []    # the current stream at each frame's __dlpack__
        self.surfaces: list[torch.Tensor] = []           # every surface any decoder handed out

    def caps_of(self, codec: cudaVideoCodec) -> dict:
        return {**DEFAULT_CAPS, **self.caps.get(cudaVideoCodec(codec).name, {})}

    def GetDecoderCaps(self, *, gpuid: int = 0, codec: cudaVideoCodec = cudaVideoCodec.H264,  # noqa: N802
                       chromaformat: cudaVideoChromaFormat = cudaVideoChromaFormat.YUV420, bitdepth: int = 8) -> dict:
        """PyNvVideoCodec 2.2.4's answer: a dict of ints (PyNvDecoder.cpp PyNvDecoderCaps)."""
        self.caps_calls.append((gpuid, cudaVideoCodec(codec).name, int(chromaformat), bitdepth))
        return {"codec_id": int(codec), "chromaformat_id": int(chromaformat), "bitdepth": bitdepth,
                **self.caps_of(codec)}

    def CreateDecoder(self, *, gpuid: int = 0, codec: cudaVideoCodec, cudacontext: int = 0, cudastream: int = 0,  # noqa: N802
                      usedevicememory: bool = True, latency: DisplayDecodeLatencyType = DisplayDecodeLatencyType.NATIVE,
                      **_: object) -> FakeDecoder:
        self.creates += 1
        if self.creates in self.refuse_creates:
            raise PyNvVCExceptionUnsupported(f"fake: CreateDecoder refused (call {self.creates})")
        self.decoders.append(FakeDecoder(self, codec, cudastream, latency))
        return self.decoders[-1]
