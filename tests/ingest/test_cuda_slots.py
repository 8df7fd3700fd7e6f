"""CUDA IPC slots for NVDEC frames from an ingest process (issue 33 item 8), on the CPU with a fake of torch.cuda.

NOT RUN ON A GPU: the fake (engine/testing/fake_cuda.py) plays both processes in one, sharing its events and
blocks the way CUDA IPC shares them between two. What these tests prove is the ordering logic of
engine/ingest/cuda_slots.py, engine/frames/storage.DeviceSharedSlots and the RemoteRing's CUDA path: which stream
waits on which event, what the core's host polls, what is never created per frame. The core does not lend CUDA
IPC pools to ingest processes yet (NVDEC streams there write host slots: tests/ingest/test_nvdec_in_process.py),
so no running engine takes this path; benchmarks/gpu_check.py `--only ingest_gpu` is where a device would run it.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from engine.frames.accounting import Accounting
from engine.frames.lifecycle import FrameMeta
from engine.frames.ring import FrameRing
from engine.frames.storage import DeviceSharedSlots
from engine.ingest import wire
from engine.ingest.cuda_slots import CudaSlotPool, PendingFrames
from engine.ingest.process import RemoteRing
from engine.testing.fake_cuda import FakeCuda, FakeEvent, nv12

pytestmark = pytest.mark.timeout(60)
H, W = 8, 8


class _Side:
    """The core's ring and pool, and one ingest process's RemoteRing attached to it, over one fake CUDA."""

    def __init__(self, slots=3, live=False):
        self.cuda = FakeCuda()
        self.acct = Accounting("classify")
        self.storage = DeviceSharedSlots(cuda=self.cuda)
        self.ring = FrameRing("cam", live=live, accounting=self.acct, memory_bytes=slots * H * W * 3 // 2,
                              min_slots=2, max_slots=16, max_frame_pixels=10**8, storage=self.storage)
        self.acct.add_holder("ring", lambda: Counter({"cam": self.ring.ready()}))
        n = self.ring.slots_needed(H, W)
        self.pool = CudaSlotPool("vidar-t-cam-1", n, H, W, device=torch.device("cpu"), cuda=self.cuda)
        self.ring.set_geometry(H, W, self.pool)
        self.pending = PendingFrames()
        self.gen = 0
        self.attach()

    def attach(self):
        """A (new) producer: its RemoteRing opens the pool once, and holds every free slot as a credit."""
        self.gen += 1
        self.sent: list = []
        self.remote = RemoteRing("cam", live=False, gen=self.gen, send=self.sent.append, max_frame_pixels=10**8)
        self.remote.cuda_ops = self.cuda
        self.remote.attach(self.pool.export("cam", self.gen))
        self.remote.credit(wire.Credit("cam", self.gen, self.ring.lend()))

    @property
    def copy_stream(self):
        return self.remote._copy_stream

    @property
    def core_stream(self):
        return self.storage._stream

    def produce(self, seq, value, ready=None) -> wire.FrameReady:
        meta = FrameMeta("cam", seq, seq / 60, time.time(), deadline=math.inf)
        assert self.remote.write(meta, nv12(value, H, W), ready=ready)
        msg = self.sent[-1]
        assert isinstance(msg, wire.FrameReady)
        return msg

    def deliver(self, msg: wire.FrameReady) -> bool:
        """What the core's ingest-io thread does with a FrameReady of a CUDA slot: poll, commit when written."""
        meta = FrameMeta(msg.stream, msg.seq, msg.pts, msg.t_capture, deadline=msg.deadline, height=msg.h,
                         width=msg.w)
        return self.pending.add(msg.stream, msg.gen, msg.slot, self.ring.written_event(msg.slot),
                                lambda: self.ring.commit(msg.slot, meta))


def test_a_frame_crosses_into_a_core_slot_written_waited_on_the_gpu_and_polled_on_the_host():
    s = _Side()
    decoded = FakeEvent("decoded")
    msg = s.produce(0, 7, ready=decoded)
    slot = msg.slot
    # the ingest's copy stream: after the decoder's event, after the core's released[slot]; written[slot] after
    assert s.copy_stream.log == [("wait", decoded), ("wait", s.pool.released[slot])]
    assert s.pool.written[slot].recorded_on is s.copy_stream
    assert s.deliver(msg)
    assert s.pool.written[slot].queries >= 1  # the core polled it on the host
    (ref,) = s.ring.take_ready()
    assert torch.equal(ref.pixels(), nv12(7, H, W)) and ref.meta.pixel_format == "nv12"
    # the reader waits on the core's own admitted[slot], recorded on the core's stream: never on written[slot]
    assert ref.ready_event() is s.pool.admitted[slot] and s.pool.admitted[slot].recorded_on is s.core_stream
    read_done = FakeEvent("read")
    ref.release(seen=True, after=read_done)
    assert s.core_stream.log == [("wait", read_done)]  # the core's stream waits on its own events only
    assert s.pool.released[slot].recorded_on is s.core_stream
    assert s.acct.snapshot("cam").ingested == 1


def test_the_next_write_into_a_slot_waits_for_its_release_on_the_gpu_and_nothing_syncs_the_host():
    s = _Side(slots=2)
    for seq in range(6):  # more frames than slots: every slot is rewritten after its release
        msg = s.produce(seq, seq, ready=FakeEvent(f"decoded{seq}"))
        assert s.deliver(msg)
        (ref,) = s.ring.take_ready()
        assert torch.equal(ref.pixels(), nv12(seq, H, W))
        ref.release(seen=True, after=FakeEvent(f"read{seq}"))
        s.remote.credit(wire.Credit("cam", s.gen, s.ring.lend()))
    waits = [e for op, e in s.copy_stream.log if op == "wait"]
    for slot in range(s.pool.count):
        # each write waited the decoder then released[slot]: the slot's last reader, on the GPU
        assert waits.count(s.pool.released[slot]) == 3
    assert [e.name for e in waits[::2]] == [f"decoded{i}" for i in range(6)]
    every = s.cuda.events_made + [e for _, e in s.copy_stream.log] + [e for _, e in s.core_stream.log]
    assert not any(e.synced for e in every) and not any(st.synced for st in s.cuda.streams)  # no host sync


def test_no_event_is_created_per_frame():
    s = _Side(slots=3)
    made = len(s.cuda.events_made)
    assert made == 3 * s.pool.count  # written, released, admitted: once per slot, with the pool
    assert s.cuda.events_opened == 2 * s.pool.count and s.cuda.blocks_opened == 1  # opened once, at attach
    for seq in range(30):
        assert s.deliver(s.produce(seq, seq % 250))
        for ref in s.ring.take_ready():
            ref.release(seen=True, after=FakeEvent("read"))  # the caller's event, not ours
        s.remote.credit(wire.Credit("cam", s.gen, s.ring.lend()))
    assert len(s.cuda.events_made) == made and s.cuda.events_opened == 2 * s.pool.count
    assert s.acct.snapshot("cam").ingested == 30


def test_a_copy_that_never_completes_is_never_admitted_never_waited_on_and_its_slot_is_reclaimed():
    """A producer whose GPU stream never runs its copy (hung, or dead with the copy queued): written[slot] stays
    incomplete. The core holds the descriptor (host polls only), admits nothing behind it of that stream, never
    makes a stream of its own wait on it, and when the producer dies takes the slot back; the next producer
    writes the same slot with the same events."""
    s = _Side(slots=3)
    s.copy_stream.held = True
    stuck = s.produce(0, 1)
    later = s.produce(1, 2)
    assert not s.deliver(stuck) and not s.deliver(later)
    for _ in range(5):
        assert s.pending.poll() == 0
    assert s.ring.ready() == 0 and s.acct.snapshot("cam").ingested == 0
    foreign = set(map(id, s.pool.written + s.pool.released))
    assert not any(id(e) in foreign for _, e in s.core_stream.log)  # only host queries touched them
    assert s.pool.written[stuck.slot].queries >= 5
    # the producer dies: its held descriptors go (counted), its lent slots come back
    assert s.pending.forget("cam") == 2 and s.pending.dropped == 2
    assert s.ring.reclaim() == s.pool.count
    # a new producer (a restarted process): the pool exported again, the same events opened again
    s.attach()
    assert s.cuda.blocks_opened == 2
    msg = s.produce(2, 9)
    assert msg.slot == stuck.slot  # the slot the dead producer held
    assert s.deliver(msg)
    (ref,) = s.ring.take_ready()
    assert torch.equal(ref.pixels(), nv12(9, H, W)) and ref.seq == 2
    assert s.acct.snapshot("cam").ingested == 1


def test_a_slow_copy_is_admitted_once_it_completes_and_in_its_streams_order():
    s = _Side(slots=3)
    s.copy_stream.held = True
    first = s.produce(0, 1)
    s.copy_stream.held = False
    second = s.produce(1, 2)  # its copy is done, but an older frame of its stream is still copying
    assert not s.deliver(first) and not s.deliver(second)
    assert s.pending.poll() == 0
    s.copy_stream.run()
    assert s.pending.poll() == 2
    assert [r.seq for r in s.ring.take_ready()] == [0, 1]


def test_an_event_whose_query_raises_fails_its_stream_only_never_the_poller():
    """Issue 43 item 2: torch's Event.query raises for any CUDA error but "not ready", and an IPC event whose
    recorder died is undefined. The raise stays in PendingFrames: the stream's frames in flight are dropped
    (counted), the stream is named for its owner to stop, and another stream's frames are still admitted."""
    s = _Side(slots=3)
    s.copy_stream.held = True
    held = s.produce(0, 1)
    assert not s.deliver(held)

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    s.pool.written[held.slot].query = broken
    other = FakeEvent("other")
    other.record(s.cuda.Stream())
    admitted = []
    assert s.pending.add("other", 1, 0, other, lambda: admitted.append(1) or True)  # a healthy stream goes on
    assert s.pending.poll() == 0 and s.pending.dropped == 1 and not s.pending.held
    assert s.pending.add("cam", held.gen, held.slot, s.ring.written_event(held.slot), lambda: True) is False
    assert s.pending.dropped == 2  # a later descriptor of the failed stream: never admitted, counted
    failed = s.pending.take_failed()
    assert list(failed) == ["cam"] and "illegal memory access" in failed["cam"] and not s.pending.failed
    assert admitted == [1] and s.ring.ready() == 0


def test_leases_stop_a_stream_whose_copy_event_raised_once_with_the_reason():
    """Leases.copies_failed, which the ingest I/O thread calls with PendingFrames.take_failed: the stream stopped
    with the reason, once; a stream already gone is skipped."""
    from engine.ingest.leases import Leases
    failed_with = []
    lease = type("L", (), {"remote": type("R", (), {"failed": False})()})()
    fake = type("F", (), {"leases": {"cam": lease}, "fail": lambda self, l, why: failed_with.append((l, why))})()
    Leases.copies_failed(fake, {"cam": "RuntimeError: boom", "gone": "RuntimeError: x"})
    assert failed_with == [(lease, failed_with[0][1])] and "RuntimeError: boom" in failed_with[0][1]
    lease.remote.failed = True
    Leases.copies_failed(fake, {"cam": "RuntimeError: again"})
    assert len(failed_with) == 1


def test_a_descriptor_for_a_slot_not_lent_is_refused():
    s = _Side(slots=3)
    msg = s.produce(0, 1)
    forged = wire.FrameReady("cam", 99, msg.gen, 1, 0.0, 0.0, 0.0, math.inf, 0.0, H, W, ("bt601", "limited"))
    assert s.ring.written_event(99) is None
    assert not s.deliver(forged)  # written_event None -> commit() checks and refuses
    assert s.ring.ready() == 0 and s.deliver(msg)


def test_the_attach_message_crosses_the_wire_and_the_pool_needs_an_even_size():
    s = _Side(slots=2)
    m = s.pool.export("cam", 4)
    back = wire.decode(wire.encode(m))
    assert back == m and back.written == [e.handle for e in s.pool.written]
    with pytest.raises(ValueError, match="even size, not 7x8"):
        CudaSlotPool("p", 2, 8, 7, device=torch.device("cpu"), cuda=FakeCuda())


def test_an_ingest_process_imports_torch_only_for_an_nvdec_stream():
    code = ("import sys, engine.ingest.process as p, numpy as np; from engine.frames.lifecycle import FrameMeta; "
            "r = p.RemoteRing('c', live=True, gen=1, send=lambda m: None, max_frame_pixels=10**8); "
            "r.write(FrameMeta('c', 0, 0.0, 0.0), np.zeros((4, 4, 3), np.uint8)); "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr[-2000:]


def test_a_pool_is_refused_with_the_reason_when_torch_would_share_it_as_expandable_segments(monkeypatch):
    """Issue 43 item 2: with expandable_segments torch shares a block by pidfd_getfd, which ptrace rules and Docker's
    seccomp deny to the ingest process: every attach would fail. The pool is refused at creation, naming why."""
    for conf in ("expandable_segments:True", "max_split_size_mb:128,expandable_segments:true"):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        with pytest.raises(ValueError, match="expandable_segments"):
            CudaSlotPool("p", 2, H, W, device=torch.device("cpu"), cuda=FakeCuda())
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    CudaSlotPool("p", 2, H, W, device=torch.device("cpu"), cuda=FakeCuda())


def test_a_new_pool_replaces_the_old_one_only_after_the_copies_queued_into_it_ran():
    """Issue 43 item 2: an attach that replaces the process's pool (a size change) first waits for the copy stream,
    whose queued copies would otherwise write the old pool after its mapping was dropped."""
    s = _Side(slots=3)
    s.produce(0, 1)
    assert s.copy_stream.synced == 0
    s.remote.attach(s.pool.export("cam", s.gen))
    assert s.copy_stream.synced == 1
