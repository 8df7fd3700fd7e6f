"""GPU frame slots (DeviceSlots): NV12 frames, ordered by events, never by a host sync.

The ordering logic runs here on CPU tensors with a fake of torch.cuda's Stream and Event that logs
what each stream was told to wait for; the same code runs on a GPU with the real ones (the `gpu`
test at the end, and benchmarks/gpu_check.py). What has not run on a GPU: all of it, until a device
session runs the gpu-marked test.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter

import numpy as np
import pytest
import torch

from engine.errors import SourceError
from engine.frames import ring as ring_module
from engine.frames.accounting import Accounting
from engine.frames.lifecycle import FrameMeta
from engine.frames.ref import LooseFrames
from engine.frames.ring import FrameRing
from engine.frames.storage import DeviceSlots, HostSlots
from engine.testing.fake_cuda import FakeCuda, FakeEvent, nv12

pytestmark = pytest.mark.timeout(60)


def device_ring(slots=3, live=True, h=8, w=8):
    acct = Accounting("classify")
    cuda = FakeCuda()
    storage = DeviceSlots(torch.device("cpu"), cuda=cuda)
    r = FrameRing("cam", live=live, accounting=acct, memory_bytes=slots * h * w * 3 // 2, min_slots=2,
                  max_slots=16, max_frame_pixels=10**8, storage=storage)
    acct.add_holder("ring", lambda: Counter({"cam": r.ready()}))
    return r, cuda, acct


def meta(seq):
    return FrameMeta("cam", seq, seq / 60, time.time(), deadline=math.inf)


def test_nv12_frames_round_trip_and_the_budget_counts_one_and_a_half_bytes_a_pixel():
    r, cuda, _ = device_ring(slots=3)
    assert r.write(meta(0), nv12(7), ready=FakeEvent("decoded"))
    assert r.capacity == 3  # memory / (8 * 8 * 1.5): an RGB budget (3 bytes a pixel) would give 2 (the minimum)
    (ref,) = r.take_ready()
    assert ref.meta.pixel_format == "nv12" and (ref.meta.height, ref.meta.width) == (8, 8)
    assert torch.equal(ref.pixels(), nv12(7))
    assert r.allocated_bytes() == 8 * 8 * 3 // 2  # one slot written; the others are allocated on first use


def test_a_write_waits_on_the_decoder_then_on_the_slots_last_reader_and_readers_wait_on_the_write():
    r, cuda, _ = device_ring(slots=2)
    decoded = FakeEvent("decoded")
    r.write(meta(0), nv12(1), ready=decoded)
    copy_stream = cuda.streams[0]
    assert copy_stream.log == [("wait", decoded)]
    (ref,) = r.take_ready()
    written = ref.ready_event()
    assert written.recorded_on is copy_stream  # a reader's stream waits on this, not on the host
    read_done = FakeEvent("read")
    slot = ref.slot
    ref.release(seen=True, after=read_done)
    copy_stream.log.clear()
    for seq in (1, 2):  # two frames: one of them reuses the released slot
        r.write(meta(seq), nv12(seq + 1), ready=FakeEvent(f"decoded{seq}"))
    waits = [e for op, e in copy_stream.log if op == "wait"]
    assert read_done in waits  # the rewrite of that slot waited on the GPU for its reader
    assert waits.index(read_done) > 0 and waits[waits.index(read_done) - 1].name.startswith("decoded")
    assert read_done.synced == 0  # never a host sync
    assert slot in {f.slot for f in r.take_ready()}


def test_the_pending_reader_event_is_waited_for_once():
    r, cuda, _ = device_ring(slots=2)
    r.write(meta(0), nv12(1))
    (ref,) = r.take_ready()
    done = FakeEvent("read")
    ref.release(seen=False, after=done)
    for seq in range(1, 5):
        r.write(meta(seq), nv12(seq))
        r.take_ready()[0].release()
    assert [e for op, e in cuda.streams[0].log if op == "wait"].count(done) == 1


def test_one_ready_event_per_slot_re_recorded_never_one_a_frame():
    """torch's CUDAEventPool: concurrent cudaEventCreate calls are costly (48 decoder threads would make thousands a
    second): a slot's event is made at its first write and recorded again at each; a reader gets it recorded for its
    own frame (waits queued before the slot's release, so a later record never reaches them)."""
    r, cuda, _ = device_ring(slots=3)
    used = set()
    for seq in range(50):
        assert r.write(meta(seq), nv12(seq))
        (ref,) = r.take_ready()
        used.add(ref.slot)
        ev = ref.ready_event()
        assert ev.recorded_on is cuda.streams[0]
        records = ev.records
        ref.release(seen=True, after=FakeEvent(f"read{seq}"))
        assert ev.records == records  # no record between the reader's wait and the release
    made = [e for e in cuda.events_made if not e.interprocess]
    assert len(made) == len(used)  # one per slot used, not 50
    assert sum(e.records for e in made) == 50


@pytest.mark.parametrize("frame, message", [
    (np.zeros((8, 8, 3), np.uint8), r"stream 'cam': decoder produced uint8 \(8, 8, 3\), expected an NV12 uint8 tensor .* \(this ring holds nv12\)"),
    (torch.zeros((8, 8), dtype=torch.uint8), r"expected an NV12 uint8 tensor of \(H \* 3 // 2, W\)"),
    (torch.zeros((12, 8), dtype=torch.float32), r"decoder produced torch.float32 \(12, 8\)"),
])
def test_a_frame_the_slots_cannot_hold_is_the_streams_error(frame, message):
    r, _, acct = device_ring()
    with pytest.raises(SourceError, match=message):
        r.write(meta(0), frame)
    assert acct.snapshot("cam").ingested == 0


def test_a_ring_given_no_storage_takes_device_slots_for_a_tensor_and_host_slots_for_an_array(monkeypatch):
    made = []

    def device_slots(device):
        made.append(device)
        return DeviceSlots(device, cuda=FakeCuda())
    monkeypatch.setattr(ring_module, "DeviceSlots", device_slots)
    for first, expect in ((nv12(3), "nv12"), (np.full((8, 8, 3), 3, np.uint8), "rgb24")):
        r = FrameRing("cam", live=True, accounting=Accounting("p"), memory_bytes=2**16, min_slots=2, max_slots=4,
                      max_frame_pixels=10**8)
        r.write(meta(0), first)
        (ref,) = r.take_ready()
        assert ref.meta.pixel_format == expect
        assert torch.equal(torch.as_tensor(ref.pixels()), torch.as_tensor(first))
        with pytest.raises(SourceError, match="this ring holds " + expect):  # a stream does not switch decoders
            r.write(meta(1), np.zeros((8, 8, 3), np.uint8) if expect == "nv12" else nv12(1))
    assert made == [torch.device("cpu")]


def test_a_host_slot_drops_its_release_event_so_the_ingest_thread_never_waits_on_the_gpu():
    """A mixed batch (NV12 and host RGB frames) releases every frame on one event, recorded after its NV12 reads;
    a host slot was read on the host before prepare returned, so the ingest thread must not wait for it
    (before issue 32 the next write into that slot synchronised on it)."""
    r = FrameRing("cam", live=True, accounting=Accounting("p"), memory_bytes=2 * 8 * 8 * 3, min_slots=2,
                  max_slots=2, max_frame_pixels=10**8)
    batch_event = FakeEvent("batch")
    for seq in range(6):  # every slot rewritten after its release, several times
        assert r.write(meta(seq), np.full((8, 8, 3), seq, np.uint8))
        (ref,) = r.take_ready()
        assert int(ref.pixels()[0, 0, 0]) == seq
        ref.release(seen=True, after=batch_event)
    assert batch_event.synced == 0


def test_the_worker_thread_releases_slots_on_the_models_release_event():
    """The pool's worker thread asks the model for its release event right after prepare and hands
    it to every frame's release (executor/worker_thread.py)."""
    from engine.executor.messages import Batch
    from engine.executor.worker_thread import WorkerThread
    from engine.models.noop import NoopRunner

    class Store(LooseFrames):
        def __init__(self, tensors):
            super().__init__(tensors)
            self.after = []

        def release(self, slot, seen, after=None):
            super().release(slot, seen, after)
            self.after.append(after)

    marker = FakeEvent("prepared")

    class Model(NoopRunner):
        def release_event(self):
            return marker

    store = Store([torch.zeros(4, 4, 3, dtype=torch.uint8)] * 2)
    t = WorkerThread("p", 0, Model(per_frame_s=0.0), threads=None, on_done=lambda *_: True)
    t._execute(Batch(0, store.refs("cam")))
    assert store.after == [marker, marker]


@pytest.mark.gpu
def test_device_slots_on_a_gpu_copy_and_order_by_events():
    r = FrameRing("cam", live=True, accounting=Accounting("p"), memory_bytes=2**22, min_slots=2, max_slots=4,
                  max_frame_pixels=10**8)
    src = torch.arange(12 * 8, dtype=torch.int32).remainder(256).to(torch.uint8).view(12, 8).cuda()
    decoder = torch.cuda.Stream()
    ready = torch.cuda.Event()
    ready.record(decoder)
    r.write(meta(0), src, ready=ready)
    (ref,) = r.take_ready()
    reader = torch.cuda.Stream()
    reader.wait_event(ref.ready_event())
    with torch.cuda.stream(reader):
        got = ref.pixels().clone()
        done = torch.cuda.Event()
        done.record(reader)
    ref.release(seen=True, after=done)
    torch.cuda.synchronize()
    assert torch.equal(got, src)
