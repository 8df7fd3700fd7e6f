import math
import threading
from collections import Counter
import time

import numpy as np
import pytest

from engine.frames.accounting import Accounting
from engine.errors import SourceError
from engine.frames.lifecycle import FrameMeta
from engine.frames.ref import FrameReleasedError
from engine.frames.ring import FrameRing, slots_for


def ring(live=True, slots=3, max_pixels=10**8):
    acct = Accounting("classify")
    r = FrameRing("s", live=live, accounting=acct, memory_bytes=slots * 8 * 8 * 3, min_slots=2,
                  max_slots=slots, max_frame_pixels=max_pixels)
    acct.add_holder("ring", lambda: Counter({"s": r.ready()}))  # as a pool registers it
    return r, acct


def frame(seq, value=None, h=8, w=8):
    return FrameMeta("s", seq, seq / 30, time.time(), deadline=math.inf), np.full((h, w, 3), seq if value is None else value, np.uint8)


def test_slots_from_memory_budget():
    assert slots_for(1280 * 720 * 3, 64 * 2**20, 4, 64) == 24
    assert slots_for(1280 * 720 * 3, 1, 4, 64) == 4
    assert slots_for(16 * 16 * 3, 2**30, 4, 64) == 64


def test_zero_copy_read_and_release():
    r, acct = ring()
    r.write(*frame(7))
    (fv,) = r.take_ready()
    assert fv.meta.seq == 7 and int(fv.pixels()[0, 0, 0]) == 7 and fv.pixels().shape == (8, 8, 3)
    assert fv.pixels().data_ptr() == r._storage.tensor(fv.slot).data_ptr()  # a view of the slot, not a copy
    assert r.held() == 1
    fv.release()
    assert r.held() == 0 and acct.snapshot("s").ingested == 1


def test_live_overwrites_oldest_and_counts():
    r, acct = ring(live=True, slots=3)
    for i in range(5):
        assert r.write(*frame(i))
    s = acct.snapshot("s")
    assert s.ingested == 5 and s.dropped == {"ring_full": 2} and s.in_flight == 3 and s.held == {"ring": 3}
    assert s.balanced() and r.overwrites == 2 and r.at_source == 0  # each overwritten frame was copied first
    got = [fv.meta.seq for fv in r.take_ready()]
    assert got == [2, 3, 4]
    # taken frames are the taker's to hold: with nobody registered for them, the check says so
    assert acct.snapshot("s").in_flight == 0 and not acct.snapshot("s").balanced()


def test_live_drops_new_frame_when_every_slot_is_claimed():
    r, acct = ring(live=True, slots=2)
    r.write(*frame(0)), r.write(*frame(1))
    held = r.take_ready()
    r.write(*frame(2))
    assert acct.snapshot("s").dropped == {"ring_full": 1}
    assert r.at_source == 1  # dropped before any copy (bench_host's `admitted` leaves it out)
    assert r.take_ready() == []
    for fv in held:
        fv.release()


def test_offline_back_pressure_blocks_then_resumes():
    r, acct = ring(live=False, slots=2)
    r.write(*frame(0)), r.write(*frame(1))
    done = threading.Event()
    t = threading.Thread(target=lambda: (r.write(*frame(2)), done.set()))
    t.start()
    assert not done.wait(0.3)  # blocked: no slot free, nothing dropped
    first = r.take_ready()
    first[0].release()
    assert done.wait(2)
    t.join()
    assert acct.snapshot("s").dropped == {}
    assert [fv.meta.seq for fv in r.take_ready()] == [2]


def test_close_wakes_a_blocked_writer():
    r, _ = ring(live=False, slots=2)
    r.write(*frame(0)), r.write(*frame(1))
    result = []
    t = threading.Thread(target=lambda: result.append(r.write(*frame(2))))
    t.start()
    time.sleep(0.1)
    r.close()
    t.join(2)
    assert result == [False] and not t.is_alive()


def test_rejects_absurd_and_malformed_frames():
    r, acct = ring(max_pixels=100)
    with pytest.raises(SourceError, match=r"frame 16x16 exceeds ring.max_frame_pixels=100"):
        r.write(*frame(0, h=16, w=16))
    with pytest.raises(SourceError, match="expected an HxWx3 uint8 numpy array"):
        r.write(FrameMeta("s", 0, 0, 0), np.zeros((4, 4), np.uint8))
    assert acct.snapshot("s").ingested == 0


def test_size_change_reallocates_the_slot():
    r, _ = ring(slots=2)
    r.write(*frame(0))
    r.take_ready()[0].release()
    r.write(*frame(1, h=4, w=6))
    (fv,) = r.take_ready()
    assert fv.pixels().shape == (4, 6, 3) and r.reallocations == 1


def test_size_change_keeps_memory_within_the_budget():
    acct = Accounting("classify")
    r = FrameRing("s", live=True, accounting=acct, memory_bytes=4 * 8 * 8 * 3, min_slots=2, max_slots=4,
                  max_frame_pixels=10**8)
    acct.add_holder("ring", lambda: Counter({"s": r.ready()}))
    for i in range(4):
        r.write(*frame(i))
    for fv in r.take_ready():
        fv.release()
        acct.drop("s", "test")  # the consumer's terminal state for it
    assert r.capacity == 4 and r.allocated_bytes() == 4 * 8 * 8 * 3
    for i in range(4, 10):  # 4x larger frames: the budget now holds 2 slots (min_slots)
        r.write(*frame(i, h=16, w=16))
        for fv in r.take_ready():
            assert fv.pixels().shape == (16, 16, 3)
            fv.release()
            acct.drop("s", "test")
    assert r.allocated_bytes() <= 2 * 16 * 16 * 3
    s = acct.snapshot("s")
    assert s.ingested == 10 and s.balanced() and s.in_flight == 0


def test_pixels_after_release_are_refused_even_once_the_slot_holds_another_frame():
    r, _ = ring(slots=2)
    r.write(*frame(0))
    (fv,) = r.take_ready()
    fv.release()
    fv.release()  # idempotent
    with pytest.raises(FrameReleasedError, match=r"after release"):
        fv.pixels()
    stale = type(fv)(fv.stream, fv.slot, fv.seq, fv.meta, r)  # another ref to the same slot (e.g. a hung worker's)
    r.write(*frame(1))
    (new,) = r.take_ready()
    assert new.slot == fv.slot and int(new.pixels()[0, 0, 0]) == 1  # the slot was reused
    with pytest.raises(FrameReleasedError, match=r"slot 0 no longer holds frame #0"):
        stale.pixels()
    assert "s#0" in repr(fv) and "slot=0" in repr(fv)


def test_seen_frames_are_offered_to_the_tap_before_the_slot_is_freed_and_outside_the_lock():
    r, acct = ring(slots=2)
    got = []

    def tap(meta, pixels):
        got.append((meta.seq, int(pixels[0, 0, 0]), r.held(), _owned(acct.lock)))
    r.tap = tap
    r.write(*frame(3)), r.write(*frame(4))
    seen, dropped = r.take_ready()
    seen.release(seen=True)
    dropped.release()  # a drop: never offered
    assert got == [(3, 3, 2, False)] and r.held() == 0  # offered while its slot was still held


def test_a_tap_error_is_logged_and_the_slot_freed(caplog):
    r, _ = ring()
    r.tap = lambda meta, pixels: 1 / 0
    r.write(*frame(5))
    (fv,) = r.take_ready()
    fv.release(seen=True)
    assert r.held() == 0 and "view tap failed on s#5" in caplog.text


def _owned(lock) -> bool:
    """Whether `lock` is held now (by any thread: probed from a fresh one, as the lock is re-entrant)."""
    out = []
    t = threading.Thread(target=lambda: out.append(lock.acquire(blocking=False)) or (out[0] and lock.release()))
    t.start()
    t.join()
    return not out[0]
