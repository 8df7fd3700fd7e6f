"""A live frame decoded while every slot lent to its ingest process is in use is dropped (ring_full): its colour
conversion is not spent on it (Source.wants, DecodedFrame.unconverted), and it is counted like any other drop."""

from __future__ import annotations

import numpy as np
import pytest

import streams.pyav as pyav
from engine.frames.ingest import IngestThread
from engine.frames.lifecycle import DropReason
from engine.ingest import process as ingest_process
from engine.ingest import slots as ingest_slots
from engine.ingest import wire
from engine.testing.clips import write_clip
from streams.pyav import FileSource


class _Ring:
    """RemoteRing's face to the ingest thread, with a slot free for frame `seq` only when `free(seq)` says so."""

    def __init__(self, free):
        self.free, self.next = free, 0
        self.written: list[int] = []
        self.at_source: list[tuple[int, DropReason]] = []

    def has_slot(self, h, w) -> bool:
        return self.free(self.next)

    def write(self, meta, frame, stop=None, ready=None) -> bool:
        assert frame is not None and self.free(meta.seq), meta.seq  # only frames that had a slot get here
        # a ring that does not say it takes NV12Planes (RemoteRing.takes_planes) gets arrays
        assert isinstance(frame, np.ndarray), type(frame)
        self.written.append(meta.seq)
        self.next = meta.seq + 1
        return True

    def drop_at_source(self, n, reason):
        self.at_source.append((n, reason))
        self.next += n

    def close(self):
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["rgb24", "nv12"])
def test_frames_without_a_slot_are_dropped_unconverted_and_counted(tmp_path, monkeypatch, fmt):
    clip = write_clip(tmp_path / "c.mp4", 90, size=(64, 48), fps=240, gop=10)
    converted = []
    for name in ("to_rgb", "nv12_planes"):
        real = getattr(pyav, name)
        monkeypatch.setattr(pyav, name, lambda f, real=real: converted.append(f.pts) or real(f))
    ring = _Ring(lambda seq: seq % 3 != 1)  # one frame in three finds every slot in use
    src = FileSource("cam", str(clip))
    src.pixel_format = fmt
    t = IngestThread(src, ring, live=True, loop=False, budget_s=10.0, emit=lambda *a: None)
    t.start()
    t._thread.join(30)
    assert not t._thread.is_alive() and t.end_reason == "end of stream"  # not "short": dropped frames count
    no_slot = [s for s in range(90) if s % 3 == 1]
    assert ring.at_source == [(1, DropReason.RING_FULL)] * len(no_slot)
    assert ring.written == [s for s in range(90) if s % 3 != 1] and t.seq == 90
    assert len(converted) == len(ring.written)  # the dropped ones were never converted


@pytest.mark.timeout(60)
def test_an_offline_stream_and_an_in_engine_ring_convert_every_frame(tmp_path):
    """Offline, write() waits for a slot (back-pressure): every frame is wanted; a ring in the engine (no
    has_slot) takes every frame too."""
    src = FileSource("cam", str(write_clip(tmp_path / "c.mp4", 5, size=(64, 48))))
    IngestThread(src, _Ring(lambda seq: True), live=False, loop=False, budget_s=1.0, emit=lambda *a: None)
    assert src.wants is None
    live = FileSource("cam", str(tmp_path / "c.mp4"))
    IngestThread(live, object.__new__(type("InEngine", (), {})), live=True, loop=False, budget_s=1.0,
                 emit=lambda *a: None)
    assert live.wants is None


def test_remote_ring_wants_a_frame_unless_its_size_s_slots_are_all_lent_out(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest_slots, "SHM_DIR", str(tmp_path))
    ring = ingest_process.RemoteRing("a", live=True, gen=1, send=lambda m: None, max_frame_pixels=10 ** 6,
                                     run="0123abcdp1s2")
    assert ring.has_slot(16, 16)  # no slots yet: write() asks for them
    seg = ingest_slots.Segment("vidar-0123abcdp1s2-a-1", 1, 16, 16, create=True)
    try:
        ring.attach(wire.Slots("a", 1, seg.name, 1, 16, 16))
        assert not ring.has_slot(16, 16)
        assert ring.has_slot(32, 16)  # a new size: write() asks for slots of it
        ring.credit(wire.Credit("a", 1, [0]))
        assert ring.has_slot(16, 16)
        meta = type("M", (), {"seq": 0, "pts": 0.0, "t_capture": 0.0, "t_capture_mono": 0.0, "deadline": 1e9,
                              "decode_s": 0.0, "colour": ("bt601", "limited")})()
        assert ring.write(meta, np.zeros((16, 16, 3), np.uint8))
        assert not ring.has_slot(16, 16)
    finally:
        ring.close()
        seg.unlink()


def test_remote_ring_writes_nv12_planes_straight_into_the_slot(tmp_path, monkeypatch):
    """A CPU decoder's NV12 frame (convert.NV12Planes) reaches the ingest process's slot byte for byte."""
    from streams.convert import NV12Planes, to_nv12
    from tests.support.colour import tagged_frames
    from tests.support.ingest import one_lent_slot

    f = tagged_frames(None, None, n=1, size=(72, 48))[0]
    with one_lent_slot(monkeypatch, tmp_path, "a", 48, 72) as (ring, seg, meta):
        seg.array[0].fill(7)
        assert ring.write(meta, NV12Planes(f))
        assert np.array_equal(seg.array[0], to_nv12(f)[0])


@pytest.mark.timeout(60)
def test_a_ring_that_takes_planes_gets_them_unwritten(tmp_path):
    """An ingest process's ring (RemoteRing.takes_planes) is handed the decoder's planes, not an array made first:
    the frame's bytes are written once, into the slot."""
    from streams.convert import NV12Planes

    got = []

    class _PlanesRing(_Ring):
        takes_planes = True

        def write(self, meta, frame, stop=None, ready=None) -> bool:
            got.append(type(frame))
            return True

    src = FileSource("cam", str(write_clip(tmp_path / "c.mp4", 6, size=(64, 48))))
    src.pixel_format = "nv12"
    t = IngestThread(src, _PlanesRing(lambda seq: True), live=False, loop=False, budget_s=1.0, emit=lambda *a: None)
    t.start()
    t._thread.join(30)
    assert got == [NV12Planes] * 6
