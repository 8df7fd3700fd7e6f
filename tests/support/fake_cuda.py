"""A fake of torch.cuda's Stream and Event as the frame slots use them (engine/frames/storage.py DeviceSlots):
streams log what they were told to wait for, events count host waits. The GPU slot tests run on CPU tensors
with it; the same code runs on a GPU with the real ones."""

from __future__ import annotations

import contextlib

import torch


class FakeEvent:
    def __init__(self, name=""):
        self.name, self.recorded_on, self.synced = name, None, 0

    def record(self, stream):
        self.recorded_on = stream

    def synchronize(self):
        self.synced += 1


class FakeStream:
    def __init__(self):
        self.log: list = []  # ("wait", event) in the order they were queued (copies are not seen by the fake)

    def wait_event(self, event):
        self.log.append(("wait", event))


class FakeCuda:
    """torch.cuda's Stream, Event and stream() as DeviceSlots uses them."""

    def __init__(self):
        self.streams: list[FakeStream] = []
        self.current = None

    def Stream(self, **_):
        s = FakeStream()
        self.streams.append(s)
        return s

    def Event(self, **kwargs):
        e = FakeEvent("slot-ready")
        e.kwargs = kwargs
        return e

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev


def nv12(value: int, h: int = 8, w: int = 8) -> torch.Tensor:
    return torch.full((h * 3 // 2, w), value, dtype=torch.uint8)
