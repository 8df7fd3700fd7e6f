"""Issue 32 item 4: a CPU-decoded stream's ring slots on a GPU machine are plain host memory (no upload reads
them: the runners stage host frames through their own pinned buffer, batch_preprocess.py), allocated by the
writer outside the pool's ledger lock, and the frame budget counts exactly what they hold.

The "GPU machine" is torch.cuda.is_available() made True; pinned allocations are seen by a fake of
torch.empty that records pin_memory=True and strips it (pinning raises without a driver)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from engine.frames.accounting import Accounting
from engine.frames.budget import FrameMemoryBudget
from engine.frames.lifecycle import FrameMeta
from engine.frames.ring import FrameRing
from engine.frames.storage import DeviceSlots, HostSlots
from engine.testing.fake_cuda import FakeCuda, nv12

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gpu_machine(monkeypatch):
    """CUDA 'available', and every torch.empty(pin_memory=True) recorded (then made unpinned)."""
    pinned: list[tuple] = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kw):
        if pin_memory:
            pinned.append(args)
        return real_empty(*args, **kw)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", empty)
    return pinned


@pytest.fixture
def lock_checked(monkeypatch):
    """Every slot allocation, host or device, fails the test if the calling thread holds a ledger lock."""
    locks: list = []
    allocations: list = []
    for cls in (HostSlots, DeviceSlots):
        real = cls.allocate

        def allocate(self, slot, h, w, _real=real):
            held = [lock for lock in locks if lock._is_owned()]
            assert not held, f"slot {slot} allocated under the ledger lock"
            allocations.append((slot, h, w))
            return _real(self, slot, h, w)
        monkeypatch.setattr(cls, "allocate", allocate)
    return locks, allocations


def meta(seq):
    return FrameMeta("cam", seq, seq / 30, time.time(), deadline=math.inf)


def test_cpu_decoded_slots_are_not_pinned_on_a_gpu_machine(gpu_machine):
    r = FrameRing("cam", live=True, accounting=Accounting("p"), memory_bytes=3 * 16 * 16 * 3, min_slots=2,
                  max_slots=4, max_frame_pixels=10**8)
    for seq in range(9):  # three at a time: every slot is used
        assert r.write(meta(seq), np.full((16, 16, 3), seq, np.uint8))
        if seq % 3 == 2:
            for ref in r.take_ready():
                ref.release(seen=True)
    assert r.capacity == 3 and r.allocated_bytes() == 3 * 16 * 16 * 3
    assert gpu_machine == []  # nothing pinned: no upload reads a ring slot
    r.close()


@pytest.mark.parametrize("live", [True, False])
def test_slots_are_allocated_outside_the_ledger_lock_and_the_budget_stays_exact(lock_checked, live):
    """First frames, a size change (slots reallocated as reused) and live overwrites: every allocation runs
    with the ledger lock free; what the ring holds never exceeds its reservation, which is exact (h * w * 3 a
    slot: pageable memory is not rounded up as pinned blocks were), and it is given back at close."""
    locks, allocations = lock_checked
    acct = Accounting("p")
    locks.append(acct.lock)
    budget = FrameMemoryBudget(2 ** 20)
    r = FrameRing("cam", live=live, accounting=acct, memory_bytes=3 * 16 * 16 * 3, min_slots=2, max_slots=3,
                  max_frame_pixels=10**8, budget=budget)
    seq = 0
    for h, w in ((16, 16), (8, 12), (16, 16)):
        for _ in range(5):
            assert r.write(meta(seq), np.full((h, w, 3), seq, np.uint8))
            assert r.allocated_bytes() <= budget.used_bytes()
            seq += 1
            if seq % 2:  # every other frame taken and released: the others are overwritten (live)
                for ref in r.take_ready():
                    assert int(ref.pixels()[0, 0, 0]) == (ref.seq % 256)
                    ref.release()
    for ref in r.take_ready():
        ref.release()
    # exact: the reservation is 3 slots of h * w * 3 bytes, and each slot holds exactly that
    assert budget.used_bytes() == 3 * 16 * 16 * 3
    assert r.allocated_bytes() > 0 and r.allocated_bytes() % (16 * 16 * 3) == 0
    assert {(h, w) for _, h, w in allocations} == {(16, 16), (8, 12)}
    r.close()
    assert budget.used_bytes() == 0 and r.allocated_bytes() == 0


def test_device_slots_are_allocated_outside_the_ledger_lock(lock_checked):
    locks, allocations = lock_checked
    acct = Accounting("p")
    locks.append(acct.lock)
    r = FrameRing("cam", live=True, accounting=acct, memory_bytes=2 * 8 * 8 * 3 // 2, min_slots=2, max_slots=2,
                  max_frame_pixels=10**8, storage=DeviceSlots(torch.device("cpu"), cuda=FakeCuda()))
    for seq in range(4):
        assert r.write(meta(seq), nv12(seq))
        r.take_ready()[0].release()
    assert len(allocations) == 4 and r.allocated_bytes() == 8 * 8 * 3 // 2  # slot 0, reused


def test_a_ring_closed_while_its_writer_allocates_gives_its_reservation_back_only_after_the_slot(monkeypatch):
    """The writer allocates its reserved slot outside the lock: a close meanwhile must not return the budget
    while that slot's memory is held (the writer frees it and returns the reservation when it sees the close)."""
    budget = FrameMemoryBudget(2 ** 20)
    r = FrameRing("cam", live=True, accounting=Accounting("p"), memory_bytes=2 * 8 * 8 * 3, min_slots=2,
                  max_slots=2, max_frame_pixels=10**8, budget=budget)
    seen = []
    real = HostSlots.allocate

    def allocate(self, slot, h, w):
        r.close()  # another thread closes the ring just as the writer (outside the lock) allocates its slot
        real(self, slot, h, w)
        seen.append(budget.used_bytes())
    monkeypatch.setattr(HostSlots, "allocate", allocate)
    assert r.write(meta(0), np.zeros((8, 8, 3), np.uint8)) is False  # closed while writing: never ingested
    assert seen == [2 * 8 * 8 * 3]  # still reserved while the slot held memory
    assert budget.used_bytes() == 0 and r.allocated_bytes() == 0
