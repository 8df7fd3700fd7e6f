"""Choosing NVDEC only for what this GPU decodes (issue 32 items 1 and 5), on the CPU with the fake
PyNvVideoCodec (engine/testing/fake_nvdec.py): GetDecoderCaps checked before NVDEC is chosen, a Decode
error before a stream's first frame falling back to the CPU with the reason (or failing `decode: cuda`),
and odd frame sizes decoded on the CPU, for good."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from engine.errors import SourceError, SourceOpenError
from engine.testing.clips import write_clip
from streams import nvdec, nvdec_caps, open_source
from tests.support.nvdec_helpers import Fails, install, pyav_nv12, read_all, solid_clip
from engine.testing.fake_nvdec import DEFAULT_CAPS, FakeNvdec

pytestmark = pytest.mark.timeout(120)

GOP = 15


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """96x64 H.264 in MP4, keyframes every GOP frames."""
    return write_clip(tmp_path_factory.mktemp("caps") / "c.mp4", 48, (96, 64), gop=GOP)


@pytest.fixture(scope="module")
def odd_clip(tmp_path_factory) -> Path:
    """33x31 VP9 (VP9, AV1 and MPEG-2 allow odd sizes; NVDEC decodes VP9)."""
    return solid_clip(tmp_path_factory.mktemp("odd") / "o.webm", "libvpx-vp9", "yuv420p", size=(33, 31))


# -- the pure checks ------------------------------------------------------------------------------------
def _caps(**over):
    return lambda module, codec: {**DEFAULT_CAPS, **over}


@pytest.mark.parametrize("requested, codec, size, caps, expect", [
    ("auto", "h264", (96, 64), _caps(), ("cuda", "auto: h264 on NVDEC")),
    ("auto", "vp9", (33, 31), _caps(), ("cpu", "auto: odd frame size 33x31 (NVDEC's NV12 frames here need an even")),
    ("auto", "av1", (64, 30), _caps(), ("cuda", "auto: av1 on NVDEC")),
    ("auto", "mpeg2video", (64, 31), _caps(), ("cpu", "auto: odd frame size 64x31")),
    ("auto", "av1", (96, 64), _caps(supported=0),
     ("cpu", "auto: this GPU's NVDEC does not decode 8-bit 4:2:0 av1 (GetDecoderCaps)")),
    ("auto", "h264", (4160, 64), _caps(width_max=4096, height_max=4096),
     ("cpu", "auto: 4160x64 is over this GPU's NVDEC limit for h264, 4096x4096 (GetDecoderCaps)")),
    ("auto", "hevc", (4096, 4096), _caps(width_max=8192, height_max=8192, mb_num_max=36864),
     ("cpu", "auto: 4096x4096 is 65536 macroblocks, over this GPU's NVDEC limit for hevc, 36864")),
    ("auto", "h264", (32, 16), _caps(width_min=48, height_min=16),
     ("cpu", "auto: 32x16 is under this GPU's NVDEC minimum for h264, 48x16")),
    ("auto", "h264", (0, 0), _caps(width_max=16, height_max=16), ("cuda", "auto: h264 on NVDEC")),  # size unknown
    ("auto", "h264", (96, 64), lambda module, codec: "RuntimeError: Could not dynamically load libnvcuvid.so.1",
     ("cpu", "auto: NVDEC's capabilities could not be read (GetDecoderCaps: RuntimeError: Could not dynamically")),
    ("auto", "h264", (96, 64), lambda module, codec: object(), ("cuda", "auto: h264 on NVDEC")),  # unknown shape
    ("cuda", "vp9", (33, 31), _caps(),
     Fails(SourceOpenError, r"stream 'cam7': decode: cuda, but odd frame size 33x31 .*; set decode: cpu \(or auto\) "
                            "for this stream$")),
    ("cuda", "h264", (4160, 64), _caps(),
     Fails(SourceOpenError, r"decode: cuda, but 4160x64 is over this GPU's NVDEC limit .*set decode: cpu")),
])
def test_resolve_decode_checks_size_and_caps(requested, codec, size, caps, expect):
    call = dict(cuda_available=True, nvdec_import=lambda: "module", stream_id="cam7", size=size, caps=caps)
    if isinstance(expect, Fails):
        with pytest.raises(expect.error, match=expect.match):
            nvdec.resolve_decode(requested, codec, **call)
        return
    device, reason = nvdec.resolve_decode(requested, codec, **call)
    assert device == expect[0] and reason.startswith(expect[1]), reason


def test_caps_are_asked_once_per_gpu_and_codec_and_a_failed_query_is_remembered():
    fake = FakeNvdec()
    first = nvdec_caps.decoder_caps(fake, 0, "h264")
    assert first == {"codec_id": 4, "chromaformat_id": 1, "bitdepth": 8, **DEFAULT_CAPS}  # PyNvVideoCodec's keys
    assert nvdec_caps.decoder_caps(fake, 0, "h264") is first
    nvdec_caps.decoder_caps(fake, 1, "h264")
    nvdec_caps.decoder_caps(fake, 0, "hevc")
    assert fake.caps_calls == [(0, "H264", 1, 8), (1, "H264", 1, 8), (0, "HEVC", 1, 8)]

    class Broken(FakeNvdec):
        def GetDecoderCaps(self, **kwargs):  # noqa: N802
            self.caps_calls.append(kwargs)
            raise RuntimeError("Could not dynamically load libnvcuvid.so.1: no such file\nIf using Docker ...")
    broken = Broken()
    for _ in range(2):
        assert nvdec_caps.decoder_caps(broken, 0, "h264") == \
            "RuntimeError: Could not dynamically load libnvcuvid.so.1: no such file"
    assert len(broken.caps_calls) == 1


# -- through a source -------------------------------------------------------------------------------------
@pytest.mark.parametrize("decode", ["auto", "cuda"])
def test_a_stream_the_gpus_caps_refuse_is_never_sent_to_nvdec(monkeypatch, clip, decode):
    fake = install(monkeypatch, FakeNvdec(caps={"H264": {"width_max": 64, "height_max": 64}}))
    src = open_source("cam1", str(clip), decode=decode)
    why = "96x64 is over this GPU's NVDEC limit for h264, 64x64 (GetDecoderCaps)"
    if decode == "cuda":
        with pytest.raises(SourceOpenError, match=rf"stream 'cam1': decode: cuda, but {re.escape(why)}; set decode"):
            src.open()
    else:
        frames = read_all(src)
        assert (src.decode_device, src.decode_reason) == ("cpu", f"auto: {why}")
        assert len(frames) == 48 and frames[0].rgb.shape == (64, 96, 3)
    assert fake.creates == 0 and fake.caps_calls == [(0, "H264", 1, 8)]  # refused before any decoder


def _refuses_in_decode_only(monkeypatch, fake):
    """GetDecoderCaps says yes (as for a profile or level the caps do not describe), Decode says no."""
    monkeypatch.setattr(fake, "caps", {"H264": {"width_max": 64}})
    monkeypatch.setattr(nvdec, "decoder_caps", lambda nvc, gpu, codec: dict(DEFAULT_CAPS))
    return "Decode raised PyNvVCExceptionUnsupported: fake: Resolution not supported on this GPU"


@pytest.mark.parametrize("failure", ["first Decode raises", "refused in Decode only"])
def test_nvdec_failing_before_the_first_frame_falls_back_to_the_cpu_for_good(monkeypatch, clip, failure, caplog):
    fake = install(monkeypatch, FakeNvdec(fail_on_calls=(1,) if failure == "first Decode raises" else ()))
    why = ("Decode raised PyNvVCExceptionDecode: fake: decode failed on call 1" if failure == "first Decode raises"
           else _refuses_in_decode_only(monkeypatch, fake))
    src = open_source("cam2", str(clip), decode="auto")
    frames = read_all(src)
    # every frame, the first included: the packet NVDEC failed on is decoded again on the CPU
    assert len(frames) == 48 and all(f.rgb is not None and f.nv12 is None for f in frames)
    assert [round(f.pts * 30) for f in frames] == list(range(48))
    reason = f"auto: NVDEC failed before the stream's first frame ({why})"
    assert (src.decode_device, src.decode_reason) == ("cpu", reason)
    assert src.decode_errors == 0 and src.session_error == ""
    again = read_all(src)  # a reopen (a reconnect, a looping file) stays on the CPU: never re-resolved as cuda
    assert len(again) == 48 and again[0].rgb is not None and (src.decode_device, src.decode_reason) == ("cpu", reason)
    assert fake.creates == 1 and fake.calls == 1  # one decoder, one call: no rebuild loop
    told = [r.getMessage() for r in caplog.records if "cam2" in r.getMessage()]
    assert told[-1] == f"stream cam2: decoding on the CPU: {reason}", told


@pytest.mark.parametrize("failure", ["first Decode raises", "refused in Decode only"])
def test_forced_cuda_fails_the_stream_when_nvdec_fails_before_its_first_frame(monkeypatch, clip, failure):
    fake = install(monkeypatch, FakeNvdec(fail_on_calls=(1,) if failure == "first Decode raises" else ()))
    if failure != "first Decode raises":
        _refuses_in_decode_only(monkeypatch, fake)
    src = open_source("cam3", str(clip), decode="cuda")
    with pytest.raises(SourceError, match=r"stream 'cam3': decode: cuda, but NVDEC failed before the stream's first "
                                          r"frame \(Decode raised PyNvVCException.*\); set decode: cpu"):
        read_all(src)
    assert fake.creates == 1


def test_a_stream_whose_ring_holds_nvdec_frames_ends_the_session_instead_of_switching(monkeypatch, clip):
    """NVDEC decoded the first pass (48 frames, 49 calls with the flush): the second pass's first Decode fails.
    The ring's slots are NV12 in GPU memory, so the session ends with the reason (a network stream reconnects)."""
    fake = install(monkeypatch, FakeNvdec(fail_on_calls=(50,)))
    src = open_source("cam4", str(clip), decode="auto")
    assert len(read_all(src)) == 48 and src.decode_device == "cuda"
    assert read_all(src) == [] and src.decode_device == "cuda"
    assert src.session_error.startswith("NVDEC: failed before this session's first frame (Decode raised "
                                        "PyNvVCExceptionDecode: fake: decode failed on call 50)")
    assert fake.creates == 2 and fake.calls_on_broken == 0


def test_a_failure_after_the_first_frame_still_rebuilds_at_the_next_keyframe(monkeypatch, clip):
    install(monkeypatch, FakeNvdec(fail_on_calls=(2,)))
    src = open_source("cam5", str(clip), decode="auto")
    frames = read_all(src)
    assert src.decode_device == "cuda" and src.decode_errors == 1
    assert [round(f.pts * 30) for f in frames] == [0] + list(range(GOP, 48))
    assert all(np.array_equal(f.nv12.numpy(), pyav_nv12(clip)[round(f.pts * 30)]) for f in frames[:2])


@pytest.mark.parametrize("decode", ["auto", "cuda"])
def test_odd_frame_sizes_are_decoded_on_the_cpu_and_stay_there(fake, odd_clip, decode):
    src = open_source("cam6", str(odd_clip), decode=decode)
    if decode == "cuda":
        with pytest.raises(SourceOpenError, match=r"stream 'cam6': decode: cuda, but odd frame size 33x31 .*"
                                                  r"set decode: cpu \(or auto\)"):
            src.open()
        return
    for _ in range(3):  # reopened (a reconnect, a looping file): decided once, never re-resolved as cuda
        frames = read_all(src)
        assert len(frames) == 3 and frames[0].rgb.shape == (31, 33, 3) and frames[0].nv12 is None
        assert (src.decode_device, src.decode_reason) == (
            "cpu", "auto: odd frame size 33x31 (NVDEC's NV12 frames here need an even width and height)")
    assert fake.creates == 0


@pytest.fixture
def fake(monkeypatch) -> FakeNvdec:
    return install(monkeypatch, FakeNvdec())
