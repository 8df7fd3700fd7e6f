"""Parameter sets sent only in the SDP reach NVDEC (issue 32 item 2): a real RTSP session from Debian's
GStreamer RTSP server (tests/support/rtsp_server.py) with rtph264pay's default config-interval 0, through the
NVDEC source path with the fake PyNvVideoCodec, whose decoders drop slices that come before SPS and PPS
(as NVIDIA's parser does)."""

from __future__ import annotations

import subprocess

import pytest

from engine.testing.clips import write_clip
from streams import open_source
from tests.support.nvdec_helpers import install, read_all
from engine.testing.fake_nvdec import FakeNvdec, cudaVideoCodec, is_slice, nal_types
from tests.support.net import free_port
from tests.support.rtsp import SERVER, SYSTEM_PY, require_server

pytestmark = [pytest.mark.rtsp, pytest.mark.timeout(120)]

GOP, FRAMES = 15, 45
SPS, PPS = 7, 8


@pytest.fixture
def sdp_only_server(tmp_path):
    """The clip served once per client, its SPS/PPS in the SDP only (config-interval 0, GStreamer's default)."""
    require_server()
    clip = write_clip(tmp_path / "c.mp4", FRAMES, (96, 64), gop=GOP)
    p = subprocess.Popen([SYSTEM_PY, str(SERVER), "--port", str(free_port()), "--file", str(clip),
                          "--config-interval", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().strip()
        assert line.startswith("READY "), f"server did not start: {line} {p.stderr.read() if p.poll() else ''}"
        yield line.split()[1]
    finally:
        p.terminate()
        p.wait(5)


def recording_nals(source) -> list:
    """Wrap the source's demuxer: the NAL unit types of each packet as it arrived (before any filter)."""
    seen, demux = [], source._packets

    def packets():
        for packet, got in demux():
            if packet.size:
                seen.append(nal_types(cudaVideoCodec.H264, bytes(packet)))
            yield packet, got
    source._packets = packets
    return seen


def params_before_first_slice(nals_per_packet: list[list[int]]) -> bool:
    seen = set()
    for nal in (n for packet in nals_per_packet for n in packet):
        if is_slice(cudaVideoCodec.H264, nal):
            return {SPS, PPS} <= seen
        seen.add(nal)
    return False


def test_parameter_sets_only_in_the_sdp_reach_every_decoder_before_its_first_slice(monkeypatch, sdp_only_server):
    # the 20th Decode call raises: that decoder is discarded and a new one built at the next keyframe (30)
    fake = install(monkeypatch, FakeNvdec(fail_on_calls=(20,)))
    src = open_source("cam", sdp_only_server, decode="auto")
    src.open()
    extradata = nal_types(cudaVideoCodec.H264, bytes(src._stream.codec_context.extradata or b""))
    arrived = recording_nals(src)
    try:
        frames = list(src.frames())
    finally:
        src.close()
    # the case itself: SPS and PPS are in the extradata (from the SDP), in none of the packets
    assert {SPS, PPS} <= set(extradata), extradata
    assert len(arrived) == FRAMES and not any({SPS, PPS} & set(nals) for nals in arrived), arrived[:3]
    assert src.decode_device == "cuda" and src.filter_name == "dump_extra"
    first, rebuilt = fake.decoders
    assert params_before_first_slice(first.nals) and params_before_first_slice(rebuilt.nals)
    assert fake.slices_without_params == 0
    # frames 0-18 from the first decoder, then from keyframe 30 on from the rebuilt one
    assert [round(f.pts * 30) for f in frames] == list(range(19)) + list(range(2 * GOP, FRAMES))
    assert src.decode_errors == 1 and all(f.nv12 is not None for f in frames)

