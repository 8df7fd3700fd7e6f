"""FrameRing's remote API under live overload (issue 33): lending a slot never drops the frame just committed."""

from __future__ import annotations

import math
import secrets
import time
from collections import Counter

import pytest

from engine.frames.accounting import Accounting
from engine.frames.lifecycle import DropReason, FrameMeta
from engine.frames.ring import FrameRing
from engine.frames.storage import SharedHostSlots
from engine.ingest.slots import Segment

pytestmark = pytest.mark.timeout(30)
H, W = 16, 16


@pytest.fixture
def ring():
    acct = Accounting("classify")
    r = FrameRing("cam", live=True, accounting=acct, memory_bytes=3 * H * W * 3, min_slots=3, max_slots=3,
                  max_frame_pixels=10 ** 6, storage=SharedHostSlots())
    acct.add_holder("ring", lambda: Counter({"cam": r.ready()}))
    seg = Segment(f"vidar-test-{secrets.token_hex(4)}-cam-1", r.slots_needed(H, W), H, W, create=True)
    r.set_geometry(H, W, seg)
    yield r, acct
    r.close()
    seg.unlink()


def _commit(r, slot, seq, t_capture_mono=math.nan):
    assert r.commit(slot, FrameMeta("cam", seq, seq / 60, time.time(), deadline=math.inf, height=H, width=W,
                                    t_capture_mono=t_capture_mono))


def test_a_full_live_ring_lends_the_oldest_of_two_ready_frames_never_the_only_one(ring):
    r, acct = ring
    slots = r.lend()
    assert len(slots) == 3
    _commit(r, slots[0], 0)
    held = r.take_ready()  # the scheduler took frame 0: its slot stays claimed
    _commit(r, slots[1], 1)
    _commit(r, slots[2], 2)
    # no slot free, the writer holds none, two frames READY: the older (1) goes (ring_full), its slot is lent
    assert r.lend() == [slots[1]]
    assert acct.snapshot("cam").dropped.get(DropReason.RING_FULL.value, 0) == 1
    _commit(r, slots[1], 3)
    [f2] = r.take_ready(1)  # frame 2 taken; frame 3 is the only READY one
    assert f2.meta.seq == 2
    # nothing free and one READY frame, the one just committed: it stays for the scheduler, nothing is lent
    assert r.lend() == []
    assert acct.snapshot("cam").dropped.get(DropReason.RING_FULL.value, 0) == 1
    assert [f.meta.seq for f in r.take_ready()] == [3]


def test_a_release_tells_the_lender_whether_the_writer_still_holds_a_lent_slot(ring):
    """The ingest I/O thread wakes for a freed slot only when the writer holds no lent slot of the stream (its
    next FrameReady wakes it otherwise): the flag it decides on is computed under the ring's lock."""
    r, _ = ring
    calls = []
    r.on_free = calls.append
    slots = r.lend()
    _commit(r, slots[0], 0)
    [f0] = r.take_ready()
    r.release(f0.slot)
    assert calls == [True]  # slots 1 and 2 are still lent: the writer has credit
    _commit(r, slots[1], 1)
    _commit(r, slots[2], 2)
    frames = r.take_ready()
    assert r.lend() == [slots[0]]  # the freed slot goes back to the writer
    _commit(r, slots[0], 3)
    for f in frames:
        r.release(f.slot)
    assert calls == [True, False, False]  # nothing lent any more: the lender must wake


def test_frames_dropped_at_the_source_are_ingested_and_dropped_with_their_reason(ring):
    r, acct = ring
    r.drop_at_source(2)  # no credit: ring_full, as an overwrite
    r.drop_at_source(3, DropReason.DEADLINE)  # past their deadline before the write
    snap = acct.snapshot("cam")
    assert snap.ingested == 5 and snap.dropped == {"ring_full": 2, "deadline": 3} and r.overwrites == 2
    r.close()
    r.drop_at_source(1, DropReason.DEADLINE)  # its stream is going: not counted any more
    assert acct.snapshot("cam").ingested == 5


def test_a_live_stream_has_at_most_its_credit_of_frames_waiting_or_being_written(ring):
    """ingest.live_credit: beyond it the writer sheds at the source, before the copy, a frame the scheduler
    would only have superseded; frames being computed (claimed) do not count."""
    r, acct = ring
    a, b = r.lend(2)  # 3 free slots, credit 2
    assert r.lend(2) == []  # two lent: nothing more
    _commit(r, a, 0)
    assert r.lend(2) == []  # one READY, one lent
    [f0] = r.take_ready()  # the scheduler took frame 0: it no longer counts
    [c] = r.lend(2)
    assert c not in (a, b)
    _commit(r, b, 1)
    _commit(r, c, 2)
    assert r.lend(2) == []  # two READY, the slot of frame 0 still claimed
    r.release(f0.slot)
    assert r.lend(2) == []  # a free slot, but two frames wait: the next one is shed at the source
    assert r.lend() == [f0.slot]  # no credit given: every free slot, as an offline ring
    assert not acct.snapshot("cam").dropped  # the credit itself never drops a frame


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _window(r, acct, clock, *, committed, superseded=0, shed=0, seq0=0, late=True):
    """One lean window of the ring's stream: `committed` frames through one lent slot, `superseded` of them
    dropped by the scheduler as superseded, `shed` more dropped at the source for want of credit. `late`: the
    frames were captured 10 s apart and committed back to back (a writer far behind, catching up: bursty);
    else captured a nanosecond apart, so each commit comes after more than half its capture gap (on time)."""
    gap = 10.0 if late else 1e-9
    for k in range(committed):
        [s] = r.lend(1)
        _commit(r, s, seq0 + k, t_capture_mono=(seq0 + k) * gap)
        [f] = r.take_ready()
        if k < superseded:
            acct.drop("cam", DropReason.SUPERSEDED)
        r.release(f.slot)
    r.drop_at_source(shed)
    clock.t += 1.01  # past LEAN_WINDOW_S: the next lend decides


def test_a_live_stream_whose_writer_is_behind_gets_a_credit_of_one_until_it_keeps_up_again(ring):
    """Lean credit (ring.LEAN_ENTER): frames arriving late and in bursts, more than a tenth of them superseded (their
    copies spent for nothing): the credit is one frame until a window in which under a quarter of the stream's
    frames are shed at the source. Frames being computed do not count, as before."""
    r, acct = ring
    r.clock = clock = _Clock()
    assert len(r.lend(2)) == 2 and not r.lean  # the first lend opens the first window
    r.reclaim()
    _window(r, acct, clock, committed=20, superseded=3)  # 15 %, bursty: behind
    [s] = r.lend(2)  # one frame, not two
    assert r.lean and r.lean_spells == 1 and r.lend(2) == []
    _commit(r, s, 100)
    [f] = r.take_ready()  # being computed: does not count
    [s] = r.lend(2)
    r.release(f.slot)
    _commit(r, s, 101)
    r.release(r.take_ready()[0].slot)
    _window(r, acct, clock, committed=10, shed=10, seq0=200)  # half shed at the source: still behind
    assert len(r.lend(2)) == 1 and r.lean
    r.reclaim()
    _window(r, acct, clock, committed=20, shed=2, seq0=300)  # a tenth shed: it keeps up again
    assert len(r.lend(2)) == 2 and not r.lean
    assert acct.snapshot("cam").dropped.get("ring_full") == 12  # only what the test shed itself


def test_a_stream_superseded_now_and_then_keeps_its_full_credit(ring):
    r, acct = ring
    r.clock = clock = _Clock()
    r.lend(2)
    r.reclaim()
    _window(r, acct, clock, committed=20, superseded=2)  # exactly a tenth: not more than LEAN_ENTER
    assert len(r.lend(2)) == 2 and not r.lean and r.lean_spells == 0


def test_a_lean_stream_stays_lean_through_a_window_without_frames(ring):
    """Nothing to judge (a reconnect, a process restart): the credit stays as it was until frames flow again."""
    r, acct = ring
    r.clock = clock = _Clock()
    r.lend(2)
    r.reclaim()
    _window(r, acct, clock, committed=20, superseded=3)
    assert len(r.lend(2)) == 1 and r.lean
    r.reclaim()
    _window(r, acct, clock, committed=0)
    assert len(r.lend(2)) == 1 and r.lean


def test_frames_dropped_at_the_source_are_counted_apart_from_those_admitted(ring):
    r, acct = ring
    r.drop_at_source(2)
    r.drop_at_source(3, DropReason.DEADLINE)
    [s] = r.lend(1)
    _commit(r, s, 0)
    assert r.at_source == 5 and acct.snapshot("cam").ingested == 6  # admitted: 6 - 5
