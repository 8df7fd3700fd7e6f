"""G5: corrupt input is contained. Every case runs through the whole engine beside a healthy stream,
must end (no hang), count what it lost, and never crash."""


import numpy as np

from engine.models.noop import NoopRunner
from engine.testing.clips import corrupt_mdat, faststart, write_clip
from tests.support.collector import Collector
from tests.support.engines import engine_config, run_engine


def h264_raw(path, frames, size, seed=0):
    """A raw Annex-B H.264 elementary stream (concatenable: SPS/PPS travel in-band)."""
    return write_clip(path, frames, size, seed=seed, gop=10, fmt="h264")


def run_with_healthy_neighbour(tmp_path, endpoint, bad_url, **extra):
    streams = [{"id": "good", "url": "synthetic://shapes?size=96x64&fps=30&frames=30", "mode": "offline"},
               {"id": "bad", "url": str(bad_url), "mode": "offline"}]
    cfg = engine_config(streams, endpoint, publish={"min_subscribers": 1}, **extra)
    col = Collector(endpoint, ["good", "bad"])
    eng, finished = run_engine(cfg, models={"classify": NoopRunner()}, timeout=60)
    msgs = col.wait(10)
    assert finished, "the engine must finish: no hang"
    good = sorted(m["seq"] for m in msgs if m["type"] == "classify" and m["stream"] == "good")
    assert good == list(range(30))
    bad_events = [m for m in msgs if m["type"] == "event" and m["stream"] == "bad"]
    s = eng.pools["classify"].acct.snapshot("bad")
    assert s.balanced() and s.in_flight == 0
    return eng, bad_events, [m for m in msgs if m["type"] == "classify" and m["stream"] == "bad"]


def reference_decode(path):
    """(frames, packets that failed to decode) for a plain PyAV loop over the file: what vidar must count."""
    import av
    frames = errors = 0
    with av.open(str(path)) as c:
        for pkt in c.demux(c.streams.video[0]):
            try:
                frames += len(pkt.decode())
            except av.error.FFmpegError:
                errors += 1
    return frames, errors


def test_truncated_file_ends_early_with_the_reason(tmp_path, endpoint):
    """A cut file whose index is at the front (streamable mp4) decodes to the cut and ends as if complete
    (FFmpeg says nothing): its eos says it ended early, from the frame count the file declares."""
    cut = tmp_path / "cut.mp4"
    data = faststart(write_clip(tmp_path / "full.mp4", 60), tmp_path / "fs.mp4").read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    frames, _ = reference_decode(cut)
    eng, events, results = run_with_healthy_neighbour(tmp_path, endpoint, cut)
    assert 0 < frames < 60 and len(results) == frames
    assert events[-1]["kind"] == "eos"
    assert events[-1]["reason"] == f"ended early: {frames} of the 60 frames the file declares (truncated?)"


def test_truncated_file_without_its_index_is_a_clear_error(tmp_path, endpoint):
    clip = write_clip(tmp_path / "full.mp4", 60)  # index (moov) at the end: the cut loses it
    data = clip.read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) * 2 // 3])
    eng, events, results = run_with_healthy_neighbour(tmp_path, endpoint, cut)
    assert [e["kind"] for e in events] == ["error", "eos"] and results == []
    assert "is not a video FFmpeg can read (invalid data)" in events[-1]["reason"]


def test_random_bytes_as_a_file(tmp_path, endpoint):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    eng, events, results = run_with_healthy_neighbour(tmp_path, endpoint, junk)
    assert [e["kind"] for e in events][-1] == "eos"
    assert results == [] or all(r["stream"] == "bad" for r in results)


def test_flipped_bytes_are_counted_and_skipped(tmp_path, endpoint):
    """2 % of the payload bytes flipped: every packet the decoder refuses is counted (exactly as many as a
    plain PyAV loop refuses), the others are delivered, and the decoder resyncs (frames after the errors)."""
    bad = tmp_path / "flipped.mp4"
    corrupt_mdat(write_clip(tmp_path / "c.mp4", 90, gop=10), bad, 0.02, seed=0)
    frames, errors = reference_decode(bad)
    eng, events, results = run_with_healthy_neighbour(tmp_path, endpoint, bad)
    assert events[-1]["kind"] == "eos"
    decode_errors = eng.stream_counters()["decode_errors"]["bad"]
    assert errors >= 1 and decode_errors == errors  # vidar_decode_errors_total
    assert len(results) == frames and frames + errors <= 90
    assert max(r["seq"] for r in results) == frames - 1 and frames >= 60  # resynced: most frames survive


def test_resolution_change_mid_stream(tmp_path, endpoint):
    a = h264_raw(tmp_path / "a.h264", 20, (320, 240))
    b = h264_raw(tmp_path / "b.h264", 20, (160, 96), seed=4)
    both = tmp_path / "both.h264"
    both.write_bytes(a.read_bytes() + b.read_bytes())
    eng, events, results = run_with_healthy_neighbour(tmp_path, endpoint, both)
    assert sorted(r["seq"] for r in results) == list(range(40))
    assert events[-1]["reason"] == "end of stream"
    ring = eng.streams["bad"].rings["classify"]
    assert ring.reallocations >= 1


def test_absurd_dimensions_are_rejected_before_allocation(tmp_path, endpoint):
    y4m = tmp_path / "huge.y4m"  # a raw-video header claiming 12000x12000 (432 MB per RGB frame)
    y4m.write_bytes(b"YUV4MPEG2 W12000 H12000 F30:1 Ip A1:1 C420jpeg\nFRAME\n" + b"\x80" * 4096)
    eng, events, results = run_with_healthy_neighbour(tmp_path, endpoint, y4m,
                                                      ring={"max_frame_pixels": 4096 * 4096})
    assert [e["kind"] for e in events] == ["error", "eos"]
    assert "claims 12000x12000 frames, over ring.max_frame_pixels=16777216" in events[0]["reason"]
    assert results == []
