"""A fake of torch.cuda's Stream and Event as the frame slots use them (engine/frames/storage.py DeviceSlots,
DeviceSharedSlots; engine/ingest/cuda_slots.py): streams log what they were told to wait for, events count
host waits, records and queries. The GPU slot tests run on CPU tensors with it; the same code runs on a GPU with
the real ones.

CUDA IPC (issue 33 item 8): `Event(interprocess=True).ipc_handle()` and `open_event(device, handle)`, and
`export_block(tensor)` / `open_block(fields)`, keep what they share in this object, so one process plays both the
core and the ingest process and both sides see the same event (what an IPC event is: one event, two processes).
A stream can be `held` (its queued work does not run, as a hung or dead producer's GPU stream): an event recorded
on it stays incomplete (`query()` False) until `run()`. As with CUDA, an event never recorded queries complete.
"""

from __future__ import annotations

import contextlib
import itertools

import torch


class FakeEvent:
    def __init__(self, name="", interprocess=False):
        self.name, self.recorded_on, self.synced = name, None, 0
        self.interprocess = interprocess
        self.records = self.queries = 0
        self.complete = True  # never recorded: complete, as cudaEventQuery says of a fresh event
        self.handle = None

    def record(self, stream=None):
        self.recorded_on = stream
        self.records += 1
        self.complete = not getattr(stream, "held", False)
        if not self.complete:
            stream.pending.append(self)

    def query(self):
        self.queries += 1
        return self.complete

    def synchronize(self):
        self.synced += 1

    def ipc_handle(self):
        if not self.interprocess:  # torch raises too: only interprocess events can be shared
            raise RuntimeError("ipc_handle of an event created without interprocess=True")
        return self.handle

    def __repr__(self):
        return f"FakeEvent({self.name})"


class FakeStream:
    def __init__(self, name=""):
        self.name = name
        self.log: list = []  # ("wait", event) in the order they were queued (copies are not seen by the fake)
        self.held = False    # its work does not run: events recorded on it stay incomplete until run()
        self.pending: list[FakeEvent] = []
        self.synced = 0

    def wait_event(self, event):
        self.log.append(("wait", event))

    def synchronize(self):
        self.synced += 1

    def run(self):
        """The held work ran: every event recorded on this stream completes."""
        self.held = False
        for e in self.pending:
            e.complete = True
        self.pending.clear()

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeCuda:
    """torch.cuda's Stream, Event and stream() as DeviceSlots uses them, plus the IPC calls of cuda_slots.TorchIpc."""

    def __init__(self):
        self.streams: list[FakeStream] = []
        self.current = None
        self.events_made: list[FakeEvent] = []  # every Event construction (none may happen per frame)
        self.events_opened = 0                  # open_event calls (once per slot and attach)
        self.blocks_opened = 0
        self._ids = itertools.count()
        self._shared: dict[bytes, object] = {}  # handle -> the shared event or block

    def Stream(self, **_):
        s = FakeStream(f"s{len(self.streams)}")
        self.streams.append(s)
        return s

    def Event(self, interprocess=False, **kwargs):
        e = FakeEvent("ipc" if interprocess else "slot-ready", interprocess=interprocess)
        e.kwargs = kwargs
        if interprocess:
            e.handle = b"ev%d" % next(self._ids)
            self._shared[e.handle] = e
        self.events_made.append(e)
        return e

    def open_event(self, device, handle):
        self.events_opened += 1
        return self._shared[bytes(handle)]  # the other side's event itself: one event seen by both

    def export_block(self, block):
        handle = b"mem%d" % next(self._ids)
        self._shared[handle] = block
        return {"shape": list(block.shape), "stride": list(block.stride()), "offset": 0, "device": 0,
                "handle": handle, "storage_bytes": block.numel(), "storage_offset": 0, "ref_counter": b"rc",
                "ref_counter_offset": 0, "event": b"", "event_sync": False}

    def open_block(self, f):
        self.blocks_opened += 1
        block = self._shared[bytes(f["handle"])]
        assert list(block.shape) == list(f["shape"]), (block.shape, f["shape"])
        return block

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev


def nv12(value: int, h: int = 8, w: int = 8) -> torch.Tensor:
    return torch.full((h * 3 // 2, w), value, dtype=torch.uint8)
