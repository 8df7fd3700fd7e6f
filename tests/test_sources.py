import numpy as np
import pytest

from engine.errors import SourceOpenError
from streams import open_source, redact_url
from streams.pyav import FileSource, RtspSource
from streams.synthetic import SyntheticSource
from tests.conftest import decode_all, write_clip


def test_synthetic_is_deterministic_and_moving():
    a = SyntheticSource("s", "synthetic://shapes?size=160x120&fps=30&seed=3")
    b = SyntheticSource("s", "synthetic://shapes?size=160x120&fps=30&seed=3")
    assert np.array_equal(a.render(5), b.render(5))
    assert not np.array_equal(a.render(5), a.render(15))
    f = a.render(0)
    assert f.shape == (120, 160, 3) and f.dtype == np.uint8


def test_synthetic_finite_stream():
    s = SyntheticSource("s", "synthetic://shapes?size=64x48&fps=10&frames=7")
    s.open()
    frames = list(s.frames())
    assert len(frames) == 7 and frames[3].pts == pytest.approx(0.3)
    assert s.total_frames == 7


@pytest.mark.parametrize("url, message", [
    ("synthetic://circles", "unknown synthetic pattern 'circles'"),
    ("synthetic://shapes?size=big", "bad synthetic parameters"),
    ("synthetic://shapes?colour=red", r"unknown synthetic parameters \['colour'\]"),
    ("synthetic://shapes?size=8x8", "out of range"),
])
def test_synthetic_bad_urls(url, message):
    with pytest.raises(SourceOpenError, match=f"stream 'cam9': .*{message}"):
        SyntheticSource("cam9", url)


def test_file_source_reads_every_frame(clip48):
    src = open_source("f", str(clip48))
    assert isinstance(src, FileSource)
    src.open()
    frames = list(src.frames())
    assert len(frames) == 48 == src.total_frames
    assert [round(f.pts * 30) for f in frames] == list(range(48))
    ref = decode_all(clip48)
    assert all(np.array_equal(a.rgb, b) for a, b in zip(frames, ref))
    src.close()


def test_missing_file(tmp_path):
    with pytest.raises(SourceOpenError, match=r"stream 'cam2': file '.*nope.mp4' not found"):
        open_source("cam2", str(tmp_path / "nope.mp4")).open()


def test_not_a_video(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_bytes(b"this is not a video\n" * 100)
    with pytest.raises(SourceOpenError, match=r"stream 'cam3': .*is not a video FFmpeg can read"):
        open_source("cam3", str(p)).open()


def test_audio_only_file_has_no_video(tmp_path):
    p = tmp_path / "tone.wav"
    import av
    with av.open(str(p), "w") as out:
        st = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for pkt in st.encode(frame):
            out.mux(pkt)
    with pytest.raises(SourceOpenError, match="has no video stream"):
        open_source("mic", str(p)).open()


def test_rtsp_url_picks_rtsp_source_with_timeouts():
    s = open_source("cam", "rtsp://u:secret@10.0.0.1/x", open_timeout_s=2, read_timeout_s=3)
    assert isinstance(s, RtspSource) and s.network
    assert s._open_options() == {"options": {"rtsp_transport": "tcp"}, "timeout": (2, 3)}
    assert "secret" not in s.display_url


def test_unreachable_rtsp_fails_fast_and_names_the_stream():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    s = open_source("cam7", f"rtsp://user:pw@127.0.0.1:{port}/x", open_timeout_s=2, read_timeout_s=2)
    with pytest.raises(SourceOpenError, match=r"stream 'cam7': cannot open 'rtsp://\*\*\*@127.0.0.1") as info:
        s.open()
    assert "pw" not in str(info.value)


@pytest.mark.parametrize("url, shown", [
    ("rtsp://admin:hunter2@cam.local:554/s1", "rtsp://***@cam.local:554/s1"),
    ("rtsp://cam.local/s1", "rtsp://cam.local/s1"),
    ("/videos/a@b.mp4", "/videos/a@b.mp4"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_corrupt_packets_are_skipped_and_counted(tmp_path):
    clip = write_clip(tmp_path / "c.mp4", 60, gop=10)
    data = bytearray(clip.read_bytes())
    rng = np.random.default_rng(1)
    for pos in rng.integers(len(data) // 4, len(data) - 100, size=40):  # flip bytes in the payload
        data[pos] ^= 0xFF
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(bytes(data))
    src = open_source("c", str(bad))
    src.open()
    frames = list(src.frames())  # must not raise
    assert 0 < len(frames) <= 60
