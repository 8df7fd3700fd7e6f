"""Issue 41 item 7b: a ring's shared-memory segments (SharedHostSlots) hold /dev/shm memory for exactly as long
as the frame budget counts them. An ended stream's ring (kept by the stream table for `ended_keep_s`) lets go of
its segment's mapping once its last frame is released; a ring that moves to a new segment while frames of the old
one are held counts the whole old segment (its mapping lives while one view of it does) until they are released."""

from __future__ import annotations

import math
import secrets
import time
from collections import Counter

import pytest

from engine.frames.accounting import Accounting
from engine.frames.budget import FrameMemoryBudget
from engine.frames.lifecycle import FrameMeta
from engine.frames.ring import FrameRing
from engine.frames.storage import SharedHostSlots
from engine.ingest.slots import Segment

pytestmark = pytest.mark.timeout(30)
H, W = 16, 16
SLOTS = 3


@pytest.fixture
def made():
    """Segments the test creates; each unlinked at the end whatever happened (the ring never unlinks: the lease does)."""
    segs: list[str] = []
    yield segs
    for name in segs:
        Segment.remove(name)


def _ring(budget=None):
    acct = Accounting("classify")
    r = FrameRing("cam", live=True, accounting=acct, memory_bytes=SLOTS * H * W * 3, min_slots=1, max_slots=SLOTS,
                  max_frame_pixels=10 ** 6, storage=SharedHostSlots(), budget=budget)
    acct.add_holder("ring", lambda: Counter({"cam": r.ready()}))
    return r


def _segment(r, made, h, w) -> str:
    """A new segment for h x w set on the ring, as Leases._new_segment does; returns its name, holding no reference
    to it (the lease drops its own at the stream's end or the next geometry), so only the ring can keep it mapped."""
    name = f"vidar-test-{secrets.token_hex(4)}-cam-{len(made)}"
    made.append(name)
    seg = Segment(name, r.slots_needed(h, w), h, w, create=True)
    r.set_geometry(h, w, seg)
    seg.unlink()  # the name goes now, as the lease's does; the memory stays while a mapping does
    return name


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return name in f.read()


def _frame(r, seq, h=H, w=W):
    """One frame through a lent slot, committed (READY); the other lent slots taken back."""
    slot = r.lend()[0]
    assert r.commit(slot, FrameMeta("cam", seq, seq / 30, time.time(), deadline=math.inf, height=h, width=w,
                                    t_capture_mono=math.nan))
    r.reclaim()


def test_an_ended_rings_segment_is_unmapped_once_its_last_frame_is_released(made):
    budget = FrameMemoryBudget(2 ** 30)
    r = _ring(budget)
    name = _segment(r, made, H, W)
    _frame(r, 0)
    [f0] = r.take_ready()  # on a worker
    _frame(r, 1)           # READY when the stream ends
    assert len(r.lend()) == 1  # and the free slot lent to the writer
    assert r.reclaim() == 1  # the stream ended, as Leases.end does: lent slots back, the ring closed; the ring
    r.close()                # stays (the stream table keeps the ended entry for ended_keep_s)
    assert _mapped(name)  # two frames still read it
    [f1] = r.take_ready()
    f0.release()
    assert _mapped(name) and budget.used_bytes() > 0
    f1.release()  # the last one
    assert not _mapped(name), "the ended ring still maps its segment"
    assert budget.used_bytes() == 0 and r.allocated_bytes() == 0


def test_a_closed_ring_maps_and_reserves_no_new_segment(made):
    """A Geometry message can come after the stream was removed (its ring closed): nothing is reserved or kept."""
    budget = FrameMemoryBudget(2 ** 30)
    r = _ring(budget)
    _segment(r, made, H, W)
    r.close()
    assert budget.used_bytes() == 0
    name = _segment(r, made, 2 * H, W)
    assert not _mapped(name) and budget.used_bytes() == 0


@pytest.mark.parametrize("new", [(2 * H, 2 * W), (H // 2, W // 2), (H, W)],
                         ids=["larger", "smaller", "same size, new segment"])
def test_a_new_segment_counts_the_old_one_until_its_last_frame_is_released(made, new):
    """The old segment is mapped whole while one of its frames is held: the budget counts all of it (not the held
    slots' bytes only), and its bytes are given back when the last of those frames is released."""
    budget = FrameMemoryBudget(2 ** 30)
    r = _ring(budget)
    old = _segment(r, made, H, W)
    old_bytes = SLOTS * H * W * 3
    assert budget.used_bytes() == old_bytes
    _frame(r, 0)
    _frame(r, 1)
    held = r.take_ready()  # two frames of the old segment on a worker
    h, w = new
    new_name = _segment(r, made, h, w)
    new_bytes = r.slots_needed(h, w) * h * w * 3
    assert _mapped(old) and _mapped(new_name)
    assert budget.used_bytes() == new_bytes + old_bytes
    held[0].release()
    assert _mapped(old) and budget.used_bytes() == new_bytes + old_bytes  # still mapped whole by the other frame
    _frame(r, 2, h, w)  # the new segment in use meanwhile
    held[1].release()
    assert not _mapped(old), "the old segment is still mapped after its last frame was released"
    assert budget.used_bytes() == new_bytes
    [f2] = r.take_ready()
    assert f2.pixels().shape == (h, w, 3)
    f2.release()


def test_a_new_segment_that_does_not_fit_beside_the_held_old_one_is_refused(made):
    """The rule (FrameRing.set_geometry): old + new within ring.total_memory_mb, or the new geometry is refused
    (SourceError, nothing changed: the lease fails the stream) rather than /dev/shm passing the budget."""
    from engine.errors import SourceError
    budget = FrameMemoryBudget(SLOTS * H * W * 3 * 1.5)
    r = _ring(budget)
    old = _segment(r, made, H, W)
    _frame(r, 0)
    [f0] = r.take_ready()
    with pytest.raises(SourceError, match="older frames still held"):
        _segment(r, made, H, W)
    assert budget.used_bytes() == SLOTS * H * W * 3 and _mapped(old)
    f0.release()
    _segment(r, made, H, W)  # nothing of the old one held any more: it fits
    assert not _mapped(old) and budget.used_bytes() == SLOTS * H * W * 3


def test_frames_of_an_old_segment_dropped_to_lend_their_slots_give_its_bytes_back(made):
    """A live ring's lend() drops the oldest READY frame for its slot (superseded): when that was the last frame
    viewing the old segment, the segment's bytes leave the budget then, not at some later release."""
    budget = FrameMemoryBudget(2 ** 30)
    r = _ring(budget)
    _segment(r, made, H, W)
    a, b, _ = r.lend()
    for seq, slot in enumerate((a, b)):
        assert r.commit(slot, FrameMeta("cam", seq, seq / 30, time.time(), deadline=math.inf, height=H, width=W,
                                        t_capture_mono=math.nan))
    old = made[-1]
    _segment(r, made, H, W)  # frames 0 and 1 READY in the old segment
    seg_bytes = SLOTS * H * W * 3
    assert budget.used_bytes() == 2 * seg_bytes
    _frame(r, 2)  # the free slot, in the new segment
    assert r.lend() == [a]  # frame 0 superseded: frame 1 still views the old segment
    assert budget.used_bytes() == 2 * seg_bytes and _mapped(old)
    assert r.commit(a, FrameMeta("cam", 3, 0.1, time.time(), deadline=math.inf, height=H, width=W,
                                 t_capture_mono=math.nan))
    assert r.lend() == [b]  # frame 1, the old segment's last
    assert budget.used_bytes() == seg_bytes and not _mapped(old)
    r.close()
