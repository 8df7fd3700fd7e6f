"""NVDEC decoding (streams/nvdec.py) on the CPU through the fake PyNvVideoCodec and fake CUDA
(engine/testing/fake_nvdec.py), `decode: auto | cpu | cuda` selection, and one GPU test with the real package."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from engine.errors import SourceOpenError
from engine.testing.clips import write_clip
from streams import nvdec, open_source
from streams.colour import colour_from_av
from streams.pyav import FileSource
from engine.testing.fake_nvdec import DisplayDecodeLatencyType, FakeCuda, FakeNvdec, VideoPacketFlag
from tests.support.nvdec_helpers import Fails, install, pyav_nv12, read_all, solid_clip  # noqa: F401 - shared with test_nvdec_*

pytestmark = pytest.mark.timeout(120)

GOP = 15  # write_clip's keyframe interval: keyframes at 0, 15, 30, 45


@pytest.fixture
def fake(monkeypatch) -> FakeNvdec:
    return install(monkeypatch, FakeNvdec())


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    """The same pattern as MP4 (avcC: needs Annex-B conversion), a raw Annex-B .h264 and MPEG-TS (already Annex-B)."""
    d = tmp_path_factory.mktemp("nvdec")
    return {"mp4": write_clip(d / "c.mp4", 48, (96, 64), gop=GOP),
            "h264": write_clip(d / "c.h264", 48, (96, 64), gop=GOP, fmt="h264"),
            "ts": write_clip(d / "c.ts", 48, (96, 64), gop=GOP, fmt="mpegts")}


def recording_arrivals(source) -> list:
    """Wrap the source's demuxer: the arrival of every packet with data, in order (what frames must carry)."""
    seen, demux = [], source._packets

    def packets():
        for packet, got in demux():
            if packet.size:
                seen.append(got)
            yield packet, got
    source._packets = packets
    return seen


# -- decoding ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, packet_filter", [("mp4", "h264_mp4toannexb"), ("h264", "dump_extra"), ("ts", "dump_extra")])
def test_frames_equal_pyav_nv12_and_are_the_frames_own(fake, clips, kind, packet_filter):
    src = open_source("cam", str(clips[kind]), decode="auto")
    frames = read_all(src)
    ref = pyav_nv12(clips[kind])
    assert (src.decode_device, src.decode_reason) == ("cuda", "auto: h264 on NVDEC")
    # MP4 converted to Annex-B; Annex-B inputs (raw, TS: FFmpeg fills their extradata while probing) get the
    # extradata's parameter sets put before each keyframe
    assert src.filter_name == packet_filter
    assert fake.annexb and all(fake.annexb)  # every packet NVDEC got started with a start code
    assert len(frames) == len(ref) == 48
    # all frames read first, compared after: a frame still pointing into a surface shows a later picture
    assert all(np.array_equal(f.nv12.numpy(), r) for f, r in zip(frames, ref))
    surfaces = {s.untyped_storage().data_ptr() for s in fake.surfaces}
    assert not {f.nv12.untyped_storage().data_ptr() for f in frames} & surfaces
    assert all(f.rgb is None and f.colour == ("bt601", "limited") and f.nv12.is_contiguous() for f in frames)
    cpu = read_all(open_source("cam", str(clips[kind]), decode="cpu"))
    assert [f.pts for f in frames] == [f.pts for f in cpu]


def test_low_latency_one_cuda_stream_of_its_own_and_an_event_after_each_copy(fake, clips):
    src = open_source("cam", str(clips["mp4"]), decode="cuda")
    frames = read_all(src)
    (dec,) = fake.decoders
    assert dec.latency == DisplayDecodeLatencyType.LOW
    assert all(flag == VideoPacketFlag.ENDOFPICTURE for size, flag, _ in fake.packets if size)
    assert fake.outputs_per_call == [1] * 48 + [0]  # each frame out of its own packet's call; nothing to flush
    (stream,) = fake.cuda.streams
    assert dec.cudastream == stream.cuda_stream != 0  # never the legacy default stream
    assert fake.dlpack_streams == [stream.cuda_stream] * 48  # the copies ran on the decoder's stream
    assert all(f.ready.stream is stream for f in frames)


@pytest.mark.parametrize("reorder_delay", [0, 2])
def test_ready_events_are_the_sessions_own_re_recorded_one_per_frame_of_a_call(monkeypatch, clips, reorder_delay):
    """No CUDA event made per frame (torch's CUDAEventPool: concurrent cudaEventCreate is costly): the i-th frame of
    a decode call gets the session's i-th event, recorded again after that frame's copy and before it is handed out;
    frames out of one call (a flush after reordering) never share one."""
    fake = install(monkeypatch, FakeNvdec(reorder_delay=reorder_delay))
    made = []
    real_new_event = fake.cuda.new_event
    monkeypatch.setattr(fake.cuda, "new_event", lambda: made.append(real_new_event()) or made[-1])
    src = open_source("cam", str(clips["mp4"]), decode="cuda")
    seen: dict[int, int] = {}
    n = 0
    for f in src.frames():
        seen[id(f.ready)] = seen.get(id(f.ready), 0) + 1
        assert f.ready.recorded == seen[id(f.ready)]  # recorded for this frame, before it was handed out
        n += 1
    assert n == 48
    most = max(fake.outputs_per_call)
    assert most == 1 if reorder_delay == 0 else most > 1  # with reordering the flush hands out several at once
    assert len(made) == most  # one event per frame of the busiest call, whatever the frame count


@pytest.mark.parametrize("reorder_delay", [0, 2])
def test_each_frame_keeps_its_own_packets_arrival(monkeypatch, clips, reorder_delay):
    # with a delay (as B-frame reordering gives) a frame comes out with a later packet: its own arrival still
    fake = install(monkeypatch, FakeNvdec(reorder_delay=reorder_delay))
    src = open_source("cam", str(clips["h264"]), decode="auto")  # raw .h264: no pts, the tickets carry it
    src.open()
    arrivals = recording_arrivals(src)
    frames = list(src.frames())
    assert len(frames) == len(arrivals) == 48
    assert [(f.t_arrival, f.t_arrival_wall) for f in frames] == arrivals
    assert all(0 <= f.decode_s < 60 for f in frames)
    if reorder_delay:
        assert fake.outputs_per_call[:reorder_delay] == [0] * reorder_delay


def test_a_decoder_that_raised_is_discarded_and_rebuilt_at_the_next_keyframe(monkeypatch, clips):
    fake = install(monkeypatch, FakeNvdec(fail_on_calls=(5,)))
    src = open_source("cam", str(clips["mp4"]), decode="auto")
    frames = read_all(src)
    ref = pyav_nv12(clips["mp4"])
    kept = list(range(4)) + list(range(GOP, 48))  # packet 5 raised; 5..14 wait for the keyframe at 15
    assert [round(f.pts * 30) for f in frames] == kept
    assert all(np.array_equal(f.nv12.numpy(), ref[i]) for f, i in zip(frames, kept))
    assert src.decode_errors == 1 and len(fake.decoders) == 2 and fake.calls_on_broken == 0
    assert src.session_error == ""


def test_a_decoder_that_cannot_be_rebuilt_ends_the_session_and_says_why(monkeypatch, clips):
    install(monkeypatch, FakeNvdec(fail_on_calls=(5,), refuse_creates=(2,)))
    src = open_source("cam", str(clips["mp4"]), decode="auto")
    frames = read_all(src)
    assert len(frames) == 4 and src.decode_errors == 1
    assert "NVDEC: the decoder could not be rebuilt (PyNvVCExceptionUnsupported" in src.session_error


# -- choosing where to decode -----------------------------------------------------------------------------
def _have(fake=None):
    return lambda: fake


def _raise(err):
    def imp():
        raise err
    return imp


NO_DRIVER = RuntimeError("Failed to load NVENC library: libnvidia-encode.so.1: cannot open shared object file\n\n"
                         "=== TROUBLESHOOTING STEPS ===")


@pytest.mark.parametrize("requested, codec, cuda, imp, pix_fmt, expect", [
    ("cpu", "h264", True, _have(), None, ("cpu", "decode: cpu")),
    ("auto", "h264", True, _have(), "yuv420p", ("cuda", "auto: h264 on NVDEC")),
    ("auto", "hevc", True, _have(), "yuvj420p", ("cuda", "auto: hevc on NVDEC")),
    ("cuda", "av1", True, _have(), None, ("cuda", "cuda: av1 on NVDEC")),
    ("cuda", None, True, _have(), None, ("cuda", "cuda: NVDEC")),  # before open: the machine only
    ("auto", "h264", False, _have(), None, ("cpu", "auto: no CUDA device (torch.cuda.is_available() is False)")),
    ("auto", "mjpeg", True, _have(), None, ("cpu", "auto: NVDEC does not decode 'mjpeg' here (it does: h264, hevc")),
    ("auto", "h264", True, _have(), "yuv420p10le", ("cpu", "auto: pixel format 'yuv420p10le' is not 8-bit 4:2:0")),
    ("auto", "h264", True, _raise(NO_DRIVER), None,
     ("cpu", "auto: PyNvVideoCodec is unavailable (RuntimeError: Failed to load NVENC library: libnvidia-encode.so.1")),
    ("auto", "h264", True, _raise(ImportError("No module named 'PyNvVideoCodec'")), None,
     ("cpu", "auto: PyNvVideoCodec is unavailable (ImportError: No module named 'PyNvVideoCodec')")),
    ("cuda", "h264", False, _have(), None, Fails(SourceOpenError, "stream 'cam7': decode: cuda, but no CUDA device")),
    ("cuda", "h264", True, _raise(NO_DRIVER), None,
     Fails(SourceOpenError, r"stream 'cam7': decode: cuda, but PyNvVideoCodec is unavailable \(RuntimeError: Failed to load "
                     r"NVENC library.*install the gpu extra .*or set decode: cpu")),
    ("cuda", "mjpeg", True, _have(), None, Fails(SourceOpenError, "stream 'cam7': decode: cuda, but NVDEC does not decode 'mjpeg'")),
    ("gpu", "h264", True, _have(), None, Fails(ValueError, "decode='gpu': allowed: auto, cpu, cuda")),
])
def test_resolve_decode(requested, codec, cuda, imp, pix_fmt, expect):
    call = dict(cuda_available=cuda, nvdec_import=imp, stream_id="cam7", pix_fmt=pix_fmt)
    if isinstance(expect, Fails):
        with pytest.raises(expect.error, match=expect.match):
            nvdec.resolve_decode(requested, codec, **call)
    else:
        device, reason = nvdec.resolve_decode(requested, codec, **call)
        assert device == expect[0] and reason.startswith(expect[1]), reason


def test_resolve_decode_imports_only_when_it_matters():
    def imp():
        raise AssertionError("imported")
    assert nvdec.resolve_decode("cpu", "h264", cuda_available=True, nvdec_import=imp)[0] == "cpu"
    assert nvdec.resolve_decode("auto", "mjpeg", cuda_available=True, nvdec_import=imp)[0] == "cpu"
    assert nvdec.resolve_decode("auto", "h264", cuda_available=False, nvdec_import=imp)[0] == "cpu"


def test_the_real_import_on_a_machine_without_the_driver_reads_as_unavailable():
    if importlib.util.find_spec("PyNvVideoCodec") is None:
        pytest.skip("PyNvVideoCodec is not installed here (the gpu extra)")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the import may well work here")
    device, reason = nvdec.resolve_decode("auto", "h264", cuda_available=True, nvdec_import=nvdec.load_pynvvideocodec)
    assert device == "cpu"
    assert reason.startswith("auto: PyNvVideoCodec is unavailable (RuntimeError: Failed to load NVENC library"), reason


@pytest.fixture(scope="module")
def mjpeg_clip(tmp_path_factory) -> Path:
    """A codec NVDEC is not given here (MJPEG in Matroska)."""
    return solid_clip(tmp_path_factory.mktemp("mjpeg") / "m.mkv", "mjpeg", "yuvj420p")


def test_auto_falls_back_at_open_and_says_so_once_per_stream(fake, mjpeg_clip, caplog):
    caplog.set_level(logging.INFO, "vidar.source")
    src = open_source("cam3", str(mjpeg_clip), decode="auto")
    assert src.decode_device is None  # decided when it opens: the codec is known then
    for _ in range(3):  # a reconnect (or a looping file) opens again: told once
        frames = read_all(src)
    assert len(frames) == 3 and frames[0].rgb.shape == (32, 32, 3) and frames[0].nv12 is None
    assert src.decode_device == "cpu" and src.decode_reason.startswith("auto: NVDEC does not decode 'mjpeg'")
    told = [r for r in caplog.records if "cam3" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.WARNING, [r.getMessage() for r in told]
    assert not fake.decoders


@pytest.fixture(scope="module")
def bt2020_clip(tmp_path_factory) -> Path:
    """8-bit H.264 tagged BT.2020: a codec NVDEC decodes, a matrix our NV12 conversion does not know."""
    return solid_clip(tmp_path_factory.mktemp("bt2020") / "c.mp4", "libx264", "yuv420p",
                      {"x264-params": "colormatrix=bt2020nc:colorprim=bt2020:transfer=bt2020-10"})


@pytest.mark.parametrize("decode", ["auto", "cuda"])
def test_a_colour_matrix_the_nv12_path_cannot_convert_is_decoded_on_the_cpu(fake, bt2020_clip, decode):
    src = open_source("cam6", str(bt2020_clip), decode=decode)
    if decode == "cuda":
        with pytest.raises(SourceOpenError, match=r"stream 'cam6': decode: cuda, but colour matrix 9 .*decode: cpu"):
            src.open()
        return
    frames = read_all(src)
    assert frames[0].nv12 is None and frames[0].rgb.shape == (32, 32, 3)
    assert src.decode_device == "cpu" and src.decode_reason.startswith("auto: colour matrix 9 (AVCOL_SPC_BT2020_NCL)")
    assert not fake.decoders


def test_forced_cuda_with_a_codec_nvdec_does_not_decode_fails_at_open(fake, mjpeg_clip):
    src = open_source("cam4", str(mjpeg_clip), decode="cuda")
    with pytest.raises(SourceOpenError, match="stream 'cam4': decode: cuda, but NVDEC does not decode 'mjpeg'.*decode: cpu"):
        src.open()


@pytest.mark.parametrize("decode, outcome", [
    ("auto", ("cpu", "auto: NVDEC refused the stream (PyNvVCExceptionUnsupported: fake: CreateDecoder refused")),
    ("cuda", Fails(SourceOpenError, "stream 'cam5': decode: cuda, but NVDEC refused the stream .*set decode: cpu")),
])
def test_a_decoder_refused_at_open(monkeypatch, clips, decode, outcome):
    install(monkeypatch, FakeNvdec(refuse_creates=(1,)))
    src = open_source("cam5", str(clips["mp4"]), decode=decode)
    if isinstance(outcome, Fails):
        with pytest.raises(outcome.error, match=outcome.match):
            src.open()
        return
    frames = read_all(src)
    assert src.decode_device == outcome[0] and src.decode_reason.startswith(outcome[1])
    assert len(frames) == 48 and frames[0].rgb is not None


@pytest.mark.parametrize("first_refused", [False, True])
def test_a_stream_keeps_the_decoder_its_first_open_chose(monkeypatch, clips, first_refused):
    """Its ring's slots were made for that decoder's frames (NV12 on the GPU, or RGB on the host): a reopen
    (reconnect, looping file) never switches. NVDEC first, refused later: the reopen fails (a network stream
    retries with backoff) instead of handing CPU frames to GPU slots; the CPU first: it stays on the CPU."""
    install(monkeypatch, FakeNvdec(refuse_creates=(1,) if first_refused else (2,)))
    src = open_source("cam7", str(clips["mp4"]), decode="auto")
    first = read_all(src)
    if first_refused:
        assert first[0].rgb is not None and src.decode_device == "cpu"
        again = read_all(src)  # NVDEC would accept now: the stream stays on the CPU
        assert again[0].rgb is not None and src.decode_device == "cpu"
        assert src.decode_reason.startswith("auto: NVDEC refused the stream")
        return
    assert first[0].nv12 is not None and src.decode_device == "cuda"
    with pytest.raises(SourceOpenError, match="stream 'cam7': decode: cuda, but NVDEC refused the stream"):
        src.open()


@pytest.mark.parametrize("url, decode, cuda, expect", [
    ("synthetic://shapes?size=32x32&frames=2", "cuda", False, ("SyntheticSource", "cpu", "synthetic")),
    ("CLIP", "cpu", True, ("FileSource", "cpu", "decode: cpu")),
    ("CLIP", "auto", False, ("FileSource", "cpu", "auto: no CUDA device")),  # plain PyAV, nothing tried at open
    ("CLIP", "auto", True, ("NvdecFileSource", None, "auto: decided when the stream opens")),
    ("rtsp://cam.local/x", "cuda", True, ("NvdecNetworkSource", None, "cuda: decided when the stream opens")),
    ("CLIP", "cuda", False, Fails(SourceOpenError, "stream 'cam6': decode: cuda, but no CUDA device .*install the gpu extra")),
    ("CLIP", "gpu", True, Fails(ValueError, "decode='gpu': allowed: auto, cpu, cuda")),
])
def test_open_source_decode(monkeypatch, clips, url, decode, cuda, expect):
    install(monkeypatch, FakeNvdec(FakeCuda(available=cuda)))
    url = str(clips["mp4"]) if url == "CLIP" else url
    if isinstance(expect, Fails):
        with pytest.raises(expect.error, match=expect.match):
            open_source("cam6", url, decode=decode)
        return
    src = open_source("cam6", url, decode=decode)
    assert (type(src).__name__, src.decode_device) == expect[:2]
    assert src.decode_reason.startswith(expect[2]), src.decode_reason
    assert isinstance(src, FileSource) == (not url.startswith(("synthetic", "rtsp")))


@pytest.mark.parametrize("colorspace, color_range, pix_fmt, expect", [
    (2, 0, "yuv420p", ("bt601", "limited")),   # unspecified: what FFmpeg assumes
    (1, 1, "yuv420p", ("bt709", "limited")),
    (1, 2, "yuv420p", ("bt709", "full")),
    (5, 0, "yuv420p", ("bt601", "limited")),   # BT470BG
    (6, 2, "yuv420p", ("bt601", "full")),      # SMPTE170M
    (2, 0, "yuvj420p", ("bt601", "full")),     # the J formats are full range
    (None, None, None, ("bt601", "limited")),
])
def test_stream_colour(colorspace, color_range, pix_fmt, expect):
    assert colour_from_av(colorspace, color_range, pix_fmt) == expect


@pytest.mark.parametrize("colorspace, color_range, pix_fmt, pair", [(1, 2, "yuv420p", 0), (2, 0, "yuv420p", 1)])
def test_stream_colour_matches_how_pyav_converts(colorspace, color_range, pix_fmt, pair):
    # the CPU path's RGB (PyAV 18 reads the frame's colour tags) differs between bt601 and bt709: the
    # mapping must name the matrix PyAV used
    f = av.VideoFrame(16, 16, pix_fmt)
    for plane, v in zip(f.planes, (81, 90, 240)):
        plane.update(bytes([v]) * plane.buffer_size)
    f.colorspace, f.color_range = colorspace, color_range
    rgb = f.to_ndarray(format="rgb24")[0, 0].tolist()
    assert rgb == [[255, 35, 10], [253, 0, 0]][pair]  # bt709 full / bt601 limited, measured here
    assert colour_from_av(colorspace, color_range, pix_fmt) == [("bt709", "full"), ("bt601", "limited")][pair]


@pytest.mark.parametrize("codec, extradata, expect", [
    ("h264", b"\x01B\xc0\n\xff\xe1", "h264_mp4toannexb"),   # avcC (MP4, MKV)
    ("hevc", b"\x01\x01`\x00\x00\x00", "hevc_mp4toannexb"),  # hvcC
    ("h264", b"\x00\x00\x00\x01gB", "dump_extra"),          # Annex-B extradata (raw .h264, RTSP): SPS/PPS kept
    ("h264", b"", None),                                     # none
    ("vp9", b"\x01\x02", None),
])
def test_packet_filter(codec, extradata, expect):
    assert nvdec.packet_filter(codec, extradata) == expect


# -- the real thing -------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_real_nvdec_decodes_a_clip_as_pyav_does(clip48):
    """PyNvVideoCodec on a GPU: H.264 decoding is bit-exact, so NVDEC's NV12 equals FFmpeg's."""
    src = open_source("gpu", str(clip48), decode="cuda")
    frames = read_all(src)
    ref = pyav_nv12(clip48)
    assert src.decode_device == "cuda" and src.filter_name == "h264_mp4toannexb" and len(frames) == len(ref) == 48
    reader = torch.cuda.Stream()
    for f, r in zip(frames, ref):
        reader.wait_event(f.ready)  # the copy-out ran on the decoder's stream: this stream waits for it
        with torch.cuda.stream(reader):
            got = f.nv12.cpu().numpy()
        assert f.nv12.is_cuda and np.array_equal(got, r)
    assert [f.pts for f in frames] == pytest.approx([i / 30 for i in range(48)])


@pytest.mark.gpu
def test_real_nvdec_echoes_each_packets_ticket_on_its_frame(clip48):
    """What the arrival and pts of an NVDEC frame rest on: DecodedFrame.timestamp is the PacketData.pts given."""
    with av.open(str(clip48)) as c:
        session = nvdec.NvdecSession(nvdec.load_pynvvideocodec(), c.streams.video[0])
        assert session.cuda_stream.cuda_stream != 0
        echoed, given = [], []
        for ticket, packet in enumerate(c.demux(c.streams.video[0]), start=1):
            given += [ticket] if packet.size else []
            echoed += [t for t, _, _ in session.decode(packet, ticket)]
    assert echoed == given and len(given) == 48


@pytest.mark.gpu
def test_real_get_decoder_caps_answers_with_the_keys_read():
    """streams/nvdec_caps.py reads these keys of PyNvVideoCodec 2.2.4's GetDecoderCaps (PyNvDecoder.cpp): a GPU
    whose H.264 answer lacks them would choose NVDEC unchecked (the first-Decode fallback still stands)."""
    from streams.nvdec_caps import decoder_caps
    caps = decoder_caps(nvdec.load_pynvvideocodec(), 0, "h264")
    assert not isinstance(caps, str), caps
    assert {"supported", "width_max", "height_max", "mb_num_max", "width_min", "height_min"} <= set(caps), caps
    assert caps["supported"] and caps["width_max"] >= 1920 and caps["height_max"] >= 1080, caps
