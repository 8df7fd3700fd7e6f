"""The core's step pulls only from the rings that got frames (commit 273dc55).

`Pool._pull` takes frames from the rings in `Pool._ready`, which a ring fills itself (FrameRing.ready_set, under
the ledger lock) when a frame becomes READY in `write()` or `commit()`, in attach order; an offline ring held back
by its credit, or with frames left after a limited take, stays in it. These tests build a pool whose workers are
never started, so every frame a step pulls stays in its scheduler, where the test counts it; `take_ready` is
wrapped on every ring to see which rings a step asked."""

from __future__ import annotations

import math
import secrets
import time
from collections import Counter

import numpy as np
import pytest

from engine.config import FaultsConfig
from engine.executor.pool import Pool
from engine.frames.lifecycle import DropReason, FrameMeta
from engine.frames.ring import FrameRing
from engine.frames.storage import SharedHostSlots
from engine.ingest.slots import Segment
from engine.models.noop import NoopRunner
from engine.models.registry import PoolSpec

H, W = 8, 8


class _Publisher:
    """What a pool asks its publisher before anything is published: nothing held; events kept."""

    def __init__(self):
        self.events = []

    def held(self, pool):
        return Counter()

    def submit_event(self, stream, kind, reason, **kw):
        self.events.append((stream, kind, reason))


@pytest.fixture
def make_pool():
    """Pools with no worker started (step() pulls into the scheduler and dispatches nothing); every frame they
    still hold is dropped at the end."""
    pools = []

    def make(credit=8):
        spec = PoolSpec("classify", [NoopRunner()], None, max_batch=4)
        pool = Pool(spec, publisher=_Publisher(), faults=FaultsConfig(), max_wait_s=0.004, credit=credit)
        pools.append(pool)
        return pool
    yield make
    for pool in pools:
        pool.abort(drop=DropReason.SHUTDOWN)


def _ring(sid, pool, *, live=True, slots=4, storage=None):
    return FrameRing(sid, live=live, accounting=pool.acct, memory_bytes=slots * H * W * 3, min_slots=2, max_slots=slots,
                     max_frame_pixels=10 ** 6, storage=storage)


def _attach(pool, n, **kw):
    rings = [_ring(f"s{i:02d}", pool, **kw) for i in range(n)]
    for r in rings:
        pool.attach(r)
    return rings


def _meta(sid, seq):
    return FrameMeta(sid, seq, seq / 30, time.time(), deadline=math.inf, height=H, width=W)


def _write(ring, seq):
    assert ring.write(_meta(ring.stream, seq), np.full((H, W, 3), seq % 256, np.uint8))


def _count_takes(monkeypatch, rings):
    """Every take_ready call on these rings, by stream name, in call order."""
    calls: list[str] = []
    for r in rings:
        real = r.take_ready

        def take(limit=None, _sid=r.stream, _real=real):
            calls.append(_sid)
            return _real(limit)
        monkeypatch.setattr(r, "take_ready", take)
    return calls


def _drain(pool):
    """Take every frame out of the scheduler (each dropped, as a deadline would), in the order it was queued:
    [(stream, seq)]. Frees the credit they held."""
    with pool.acct.lock:
        frames = pool.scheduler.remove(lambda fv: True)
        for fv in frames:
            pool.acct.drop(fv.meta.stream, DropReason.DEADLINE)
            fv.release()
    return [(fv.meta.stream, fv.meta.seq) for fv in frames]


@pytest.mark.timeout(30)
def test_a_step_asks_only_the_rings_that_got_frames(make_pool, monkeypatch):
    """40 live rings attached, frames written into two: a step calls take_ready on those two only and pulls
    every frame; the next step, with nothing new, asks no ring at all."""
    pool = make_pool()
    rings = _attach(pool, 40)
    calls = _count_takes(monkeypatch, rings)
    _write(rings[31], 0)
    _write(rings[31], 1)
    _write(rings[7], 0)
    pool.step(time.monotonic())
    assert calls == ["s07", "s31"]  # attach order, not the order the frames came in
    assert pool.scheduler.count_by_key() == Counter({"s31": 2, "s07": 1})
    assert all(r.ready() == 0 for r in rings)
    calls.clear()
    pool.step(time.monotonic())
    assert calls == []
    assert _drain(pool) == [("s07", 0), ("s31", 0), ("s31", 1)]


@pytest.mark.timeout(30)
def test_frames_written_on_several_rings_across_steps_are_all_pulled_in_attach_order(make_pool, monkeypatch):
    """Over several steps, frames written on a changing handful of the 40 rings, in an order other than the
    attach order: each step asks exactly the rings written since the last, in attach order, and takes their
    frames in that order; no frame is missed (the ledger balances with every frame counted)."""
    pool = make_pool()
    rings = _attach(pool, 40)
    calls = _count_takes(monkeypatch, rings)
    rounds = [[39, 0, 17], [5], [22, 21, 20, 3, 38], [17, 17, 2], [11, 30, 11, 0]]  # ring indexes, in write order
    seqs = Counter()
    pulled = []
    for written in rounds:
        expected = []
        for i in written:
            _write(rings[i], seqs[i])
            expected.append((i, seqs[i]))
            seqs[i] += 1
        calls.clear()
        pool.step(time.monotonic())
        order = sorted(set(written))
        assert calls == [f"s{i:02d}" for i in order]
        got = _drain(pool)
        assert got == [(f"s{i:02d}", s) for i, s in sorted(expected)]  # attach order, each ring's frames oldest first
        pulled += got
    assert len(pulled) == sum(len(r) for r in rounds)
    for i, r in enumerate(rings):
        snap = pool.acct.snapshot(r.stream)
        assert snap.ingested == seqs[i] and snap.dropped.get("deadline", 0) == seqs[i] and snap.balanced()
    calls.clear()
    pool.step(time.monotonic())
    assert calls == []


@pytest.mark.timeout(30)
def test_frames_written_before_the_attach_are_pulled_at_the_first_step(make_pool, monkeypatch):
    """A ring is attached before its writer starts, but one written first (no pool to tell yet) is not
    forgotten: the attach puts it in the set."""
    pool = make_pool()
    rings = _attach(pool, 5)
    early = _ring("early", pool)
    _write(early, 0)
    _write(early, 1)
    pool.attach(early)
    calls = _count_takes(monkeypatch, rings + [early])
    pool.step(time.monotonic())
    assert calls == ["early"]
    assert _drain(pool) == [("early", 0), ("early", 1)]


@pytest.mark.timeout(30)
def test_a_remote_writers_commit_puts_its_ring_in_the_set(make_pool, monkeypatch):
    """The ingest processes' path: a lent slot committed (FrameRing.commit, not write) is pulled at the next
    step, from that ring only."""
    pool = make_pool()
    rings = _attach(pool, 6)
    remote = _ring("remote", pool, slots=3, storage=SharedHostSlots())
    seg = Segment(f"vidar-test-{secrets.token_hex(4)}-remote-1", remote.slots_needed(H, W), H, W, create=True)
    try:
        remote.set_geometry(H, W, seg)
        pool.attach(remote)
        calls = _count_takes(monkeypatch, rings + [remote])
        a, b = remote.lend(2)
        assert remote.commit(a, _meta("remote", 0))
        assert remote.commit(b, _meta("remote", 1), notify=False)
        pool.step(time.monotonic())
        assert calls == ["remote"]
        assert _drain(pool) == [("remote", 0), ("remote", 1)]
        calls.clear()
        [c] = remote.lend(1)
        _write(rings[4], 0)  # an in-process writer beside it, attached before it
        assert remote.commit(c, _meta("remote", 2))
        pool.step(time.monotonic())
        assert calls == ["s04", "remote"]
        assert _drain(pool) == [("s04", 0), ("remote", 2)]
    finally:
        pool.detach("remote", DropReason.STREAM_REMOVED)
        seg.unlink()


@pytest.mark.timeout(30)
def test_a_ring_detached_while_it_has_frames_is_skipped_and_its_frames_dropped(make_pool, monkeypatch):
    """A ring in the set (frames written, not pulled yet) is detached: detach drops its frames
    (stream_removed) as before, and the next step does not ask it, raises nothing, and pulls the others."""
    pool = make_pool()
    rings = _attach(pool, 3)
    a, b, c = rings
    calls = _count_takes(monkeypatch, rings)
    _write(a, 0)
    _write(b, 0)
    _write(b, 1)
    _write(c, 0)
    pool.detach("s01", DropReason.STREAM_REMOVED)
    snap = pool.acct.snapshot("s01")
    assert snap.ingested == 2 and snap.dropped == {"stream_removed": 2} and snap.in_flight == 0 and snap.balanced()
    assert b.closed
    calls.clear()
    pool.step(time.monotonic())
    assert calls == ["s00", "s02"]
    assert _drain(pool) == [("s00", 0), ("s02", 0)]


@pytest.mark.timeout(30)
def test_a_ring_left_in_the_set_after_its_stream_went_is_skipped(make_pool, monkeypatch):
    """The step's own guard: a ring still in the set that is no longer its stream's attached ring (the stream
    detached, and the same id attached again with a new ring) is not asked; the new ring is."""
    pool = make_pool()
    rings = _attach(pool, 3)
    old = rings[1]
    _write(old, 0)
    pool.detach("s01", DropReason.STREAM_REMOVED)
    new = _ring("s01", pool)
    pool.attach(new)
    calls = _count_takes(monkeypatch, rings + [new])
    _write(new, 5)
    _write(rings[2], 0)
    with pool.acct.lock:
        pool._ready[old] = None  # stale: what the guard in _pull is for
    pool.step(time.monotonic())
    assert calls.count("s01") == 1 and calls == ["s02", "s01"]  # the new ring, attached after s02
    assert _drain(pool) == [("s02", 0), ("s01", 5)]
    assert pool.acct.snapshot("s01").dropped == {"stream_removed": 1, "deadline": 1}


@pytest.mark.timeout(30)
def test_an_offline_ring_at_its_credit_keeps_its_frames_and_is_pulled_once_credit_frees(make_pool, monkeypatch):
    """Credit 2: an offline ring with 3 frames gives 2 (the third stays READY), is not asked while its 2 are
    held (a live ring beside it still is), and gives the third at the first step after its credit frees,
    although nothing was written since: it stayed in the set."""
    pool = make_pool(credit=2)
    cam = _ring("cam", pool)
    off = _ring("off", pool, live=False)
    pool.attach(cam)
    pool.attach(off)
    calls = _count_takes(monkeypatch, [cam, off])
    for seq in range(3):
        _write(off, seq)
    pool.step(time.monotonic())
    assert calls == ["off"]
    assert pool.scheduler.count_by_key() == Counter({"off": 2}) and off.ready() == 1
    calls.clear()
    _write(cam, 0)
    pool.step(time.monotonic())  # at its credit: not asked, its frame kept
    assert calls == ["cam"]
    assert pool.scheduler.count_by_key() == Counter({"off": 2, "cam": 1}) and off.ready() == 1
    calls.clear()
    pool.step(time.monotonic())
    assert calls == [] and off.ready() == 1
    assert _drain(pool) == [("off", 0), ("off", 1), ("cam", 0)]  # the credit frees
    pool.step(time.monotonic())
    assert calls == ["off"]
    assert off.ready() == 0 and _drain(pool) == [("off", 2)]
    calls.clear()
    pool.step(time.monotonic())
    assert calls == []  # empty now: out of the set
    snap = pool.acct.snapshot("off")
    assert snap.ingested == 3 and snap.dropped == {"deadline": 3} and snap.balanced()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("pending, idle, slack", [(0, True, 0), (1, True, 2), (3, True, 0), (4, True, 0),
                                                  (2, False, 0)])
def test_frames_that_cannot_fill_the_batch_being_waited_for_need_no_wake_up(make_pool, monkeypatch, pending, idle,
                                                                            slack):
    """Pool.wake_slack: while an idle worker waits for a batch of 4 to fill, the frames short of filling it may
    arrive without waking the core (it steps at the wait's limit anyway); an empty pool, a full batch or no idle
    worker: every frame wakes it."""
    pool = make_pool()
    assert pool.wake_slack() > 1000  # a pool no stream feeds never limits the others
    _attach(pool, 1)
    monkeypatch.setattr(pool.scheduler, "pending", lambda: pending)
    monkeypatch.setattr(pool.slots, "idle", lambda: object() if idle else None)
    assert pool.wake_slack() == slack


@pytest.mark.timeout(10)
def test_the_core_is_woken_by_the_frame_past_its_slack_and_by_anything_else_at_once():
    from engine.core.loop import EngineCore

    core = EngineCore({}, None, shutdown_timeout_s=1.0)
    core._absorb = 2
    core.frames_ready()
    core.frames_ready()
    assert not core._wake.is_set()  # two frames short of the batch: the step at the wait's limit takes them
    core.frames_ready()
    assert core._wake.is_set() and core._absorb == 0
    core._wake.clear()
    core._absorb = 2
    core.frames_ready(3)  # a batch read at once that fills it
    assert core._wake.is_set()
    core._wake.clear()
    core._absorb = 5
    core.wake()  # a finishing worker, a control request: never absorbed
    assert core._wake.is_set()


def test_a_pools_fallbacks_include_its_processors():
    """Pool.fallbacks (the `list` entries' `fallbacks`, vidar_gpu_fallback) names what its processor runs without,
    as SAM 2's tracking stage does after a failed capture of its step graphs (tests/models/test_sam2_step_graphs.py)."""
    from engine.models.base import PostProcessor

    class _Eager(PostProcessor):
        def process(self, frames, fields):
            return fields, lambda: None

        def fallbacks(self):
            return {"tracking_graphs": "capture failed: RuntimeError: out of memory"}

    pool = Pool(PoolSpec("sam2", [NoopRunner()], None, max_batch=4, processor=_Eager()), publisher=_Publisher(),
                faults=FaultsConfig(), max_wait_s=0.004, credit=8)
    bare = Pool(PoolSpec("plugin", [NoopRunner()], None, max_batch=4, processor=object()), publisher=_Publisher(),
                faults=FaultsConfig(), max_wait_s=0.004, credit=8)  # a processor need not derive PostProcessor
    try:
        assert pool.fallbacks() == {"tracking_graphs": "capture failed: RuntimeError: out of memory"}
        assert bare.fallbacks() == {}
    finally:
        pool.abort(drop=DropReason.SHUTDOWN)
        bare.abort(drop=DropReason.SHUTDOWN)
