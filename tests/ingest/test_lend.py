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
    # no slot free, the writer holds none, two frames READY: the older (1) goes (superseded), its slot is lent
    assert r.lend() == [slots[1]]
    assert acct.snapshot("cam").dropped == {DropReason.SUPERSEDED.value: 1}
    _commit(r, slots[1], 3)
    [f2] = r.take_ready(1)  # frame 2 taken; frame 3 is the only READY one
    assert f2.meta.seq == 2
    # nothing free and one READY frame, the one just committed: it stays for the scheduler, nothing is lent
    assert r.lend() == []
    assert acct.snapshot("cam").dropped == {DropReason.SUPERSEDED.value: 1}
    assert [f.meta.seq for f in r.take_ready()] == [3]


def test_lending_a_full_live_ring_supersedes_the_oldest_ready_frame_never_the_one_just_committed(ring):
    """Issue 41 item 7a: lend() frees a slot by dropping the oldest READY frame, counted `superseded` (a newer frame
    of its stream waits for the scheduler: the older copy is the one spent for nothing, as the scheduler itself
    would count it), never the frame just committed; and while only one READY frame is left it lends nothing."""
    r, acct = ring
    a, b, c = r.lend()
    for seq, slot in enumerate((a, b, c)):
        _commit(r, slot, seq)  # three READY frames, none free, the writer holds no lent slot
    assert r.lend() == [a]  # frame 0, the oldest, goes; frames 1 and 2 stay
    _commit(r, a, 3)
    assert r.lend() == [b]  # frame 1: still the oldest, not frame 3 just committed
    [f2] = r.take_ready(1)  # the scheduler took frame 2: its slot is claimed
    assert f2.meta.seq == 2
    _commit(r, b, 4)
    assert r.lend() == [a]  # frames 3 and 4 READY: 3 goes, never 4
    _commit(r, a, 5)
    [f4] = r.take_ready(1)
    assert f4.meta.seq == 4
    assert r.lend() == []  # frame 5 is the only READY frame left (the others claimed): it stays, nothing is lent
    assert [f.meta.seq for f in r.take_ready()] == [5]
    snap = acct.snapshot("cam")
    assert snap.dropped == {DropReason.SUPERSEDED.value: 3} and snap.ingested == 6, snap.dropped


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


def test_an_offline_stream_feeding_several_pools_is_lent_only_what_every_ring_has_room_for():
    """Issue 41 item 10: a stream feeding two pools is written once into the first pool's slot and copied by the
    engine's I/O thread into the other's ring, which must never wait there (every stream's frames pass that thread).
    Offline, the process is lent no more slots than the other ring has free beyond the frames already lent; the
    rest of the back-pressure waits in the process, and no frame is lost."""
    from types import SimpleNamespace

    from engine.ingest.leases import Leases

    acct, acct2 = Accounting("classify"), Accounting("sam2")
    first = FrameRing("cam", live=False, accounting=acct, memory_bytes=4 * H * W * 3, min_slots=4, max_slots=4,
                      max_frame_pixels=10 ** 6, storage=SharedHostSlots())
    other = FrameRing("cam", live=False, accounting=acct2, memory_bytes=2 * H * W * 3, min_slots=2, max_slots=2,
                      max_frame_pixels=10 ** 6)
    seg = Segment(f"vidar-test-{secrets.token_hex(4)}-cam-1", first.slots_needed(H, W), H, W, create=True)
    try:
        first.set_geometry(H, W, seg)
        other.reserve_for(H, W)
        leases = Leases.__new__(Leases)
        leases.cfg = SimpleNamespace(ingest=SimpleNamespace(live_credit=2))
        lease = SimpleNamespace(ring=first, fanout=(other,), cfg=SimpleNamespace(mode="offline"),
                                segment=SimpleNamespace(h=H, w=W))
        lent = leases._lend(lease)
        assert len(lent) == 2  # the other ring's two free slots, not the first ring's four
        assert leases._lend(lease) == []  # both lent: nothing more until the other ring frees one
        for seq, slot in enumerate(lent):  # committed and copied: the other ring takes both without waiting
            meta = FrameMeta("cam", seq, 0.0, time.time(), deadline=math.inf, height=H, width=W)
            m2 = FrameMeta("cam", seq, 0.0, time.time(), deadline=math.inf)
            assert first.commit(slot, meta) and other.write(m2, seg.array[slot])
        assert leases._lend(lease) == []  # the other ring is full: the process waits, nothing is dropped
        [ref] = other.take_ready(1)
        other.release(ref.slot)
        assert len(leases._lend(lease)) == 1
        assert sum(acct2.snapshot("cam").dropped.values()) == 0
    finally:
        first.close()
        other.close()
        seg.unlink()
