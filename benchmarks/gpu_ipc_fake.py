"""CPU stand-ins for the torch.cuda calls of benchmarks/gpu_ipc_probe.py's seven questions, so that their dry run
(gpu_check --dry-run, make test) goes through the same lines, processes and pipes as on a device. Made up: what
they answer proves the scripts run, nothing about a GPU.

  * `Event(interprocess=True)` is a 9-byte file (a pending flag and a record count), its `ipc_handle()` the file's
    path, so `Event.from_ipc_handle` in another process shares it as CUDA's IPC events are shared;
  * a `Stream` has a clock: `_sleep(cycles)` queues FAKE_HZ-scaled seconds of "kernel" on the current stream, and
    an event recorded behind them completes when they have run, on a timer thread of the recording process (so a
    recorder killed before that leaves its record pending for good: one possible answer of question 2);
  * blocks are bytearrays; `reduce_tensor` gives them a reference counter in a file, in the field positions of
    torch's rebuild_cuda_tensor (11: ref_counter_handle, 12: its offset), set to 1 at export and decremented only
    by `release_ipc_counter`; a dropped block whose counter is not 0 stays reserved until `ipc_collect` finds it 0
    (what torch's CudaIPCSentData limbo does);
  * timing events read `time.perf_counter`; memory queries answer zeros.

No torch import here: a spawned stand-in starts in ~0.1 s, so the dry run of the seven stays short.
"""

from __future__ import annotations

import contextlib
import fcntl
import struct
import threading
import time
import uuid
import weakref
from pathlib import Path

#: "cycles" a stand-in kernel runs per second: the device scripts' 2e9-cycle sleeps (about 1 s on an H100/H200)
#: become 0.3 s here
FAKE_HZ = 6e9
_STATE = struct.Struct("<BQ")  # pending (0/1), records so far


class FakeStream:
    def __init__(self, *_, **__):
        self.busy_until = 0.0  # perf_counter when its queued "kernels" have run
        self.timers: list[threading.Timer] = []

    def wait_event(self, event: "FakeEvent") -> None:
        self.busy_until = max(self.busy_until, event.done_at)

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.busy_until - time.perf_counter()))
        for t in self.timers:
            t.join()


class FakeEvent:
    cuda: "FakeCuda"  # set by FakeCuda's subclass: where the current stream and the files are

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 _path: str | None = None):
        self.interprocess, self.done_at = interprocess or _path is not None, 0.0
        self.path = _path
        if self.interprocess and _path is None:
            self.path = str(self.cuda.workdir / f"event-{uuid.uuid4().hex}")
            Path(self.path).write_bytes(_STATE.pack(0, 0))  # never recorded: complete, as CUDA's are
        self._pending = False  # in-process events keep their state here

    @classmethod
    def from_ipc_handle(cls, device: int, handle: bytes) -> "FakeEvent":
        return cls(_path=handle.decode())

    def ipc_handle(self) -> bytes:
        if not self.interprocess:  # torch raises too: only interprocess events are shared
            raise RuntimeError("ipc_handle of an event created without interprocess=True")
        return self.path.encode()

    def _state(self, update=None) -> tuple[int, int]:
        with open(self.path, "r+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # a record in one process and a completion in another do not interleave
            pending, n = _STATE.unpack(f.read(_STATE.size))
            if update is not None:
                pending, n = update(pending, n)
                f.seek(0)
                f.write(_STATE.pack(pending, n))
            return pending, n

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        self.done_at = max(stream.busy_until, time.perf_counter())
        delay = self.done_at - time.perf_counter()
        if not self.interprocess:
            self._pending = delay > 0
            return
        _, mine = self._state(lambda pending, n: (1, n + 1))  # the count after this record
        if delay <= 0:
            self._state(lambda pending, m: (0, m))
            return

        def complete():  # only this record's completion: a later record keeps its own pending
            self._state(lambda pending, m: (0 if m == mine else pending, m))
        t = threading.Timer(delay, complete)
        t.daemon = True  # dies with its process: the record of a killed recorder stays pending
        t.start()
        stream.timers.append(t)

    def query(self) -> bool:
        if not self.interprocess:
            return not self._pending or time.perf_counter() >= self.done_at
        return self._state()[0] == 0

    def synchronize(self) -> None:
        while not self.query():
            time.sleep(0.005)

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.done_at - self.done_at) * 1e3


class FakeBlock(bytearray):
    def copy_(self, other: "FakeBlock") -> "FakeBlock":
        self[:] = other
        return self


def _counter(path: str, offset: int, delta: int = 0) -> int:
    with open(path, "r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(offset)
        n = struct.unpack("<q", f.read(8))[0] + delta
        f.seek(offset)
        f.write(struct.pack("<q", n))
        return n


def fake_rebuild(cls, size, stride, offset, storage_cls, dtype, device, handle, nbytes, storage_offset,
                 requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required):
    """The consumer's side of `reduce_tensor`: maps the block (its counter must exist). Like torch's consumer, it
    would decrement the counter when its tensor dies, which a killed consumer never does."""
    _counter(ref_counter_handle.decode(), ref_counter_offset)
    return cls(0)


class FakeCuda:
    """torch.cuda as the questions use it, plus benchmarks/gpu_ipc_probe.TorchCuda's extras."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.Event = type("Event", (FakeEvent,), {"cuda": self})
        self.Stream = FakeStream
        self._local = threading.local()
        self._default = FakeStream()
        self._blocks: dict[int, int] = {}     # key: bytes, every block alive or held after it was dropped
        self._shared: dict[int, str] = {}     # key: its counter file
        self._limbo: set[int] = set()

    def current_stream(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self._default

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        before, self._local.stream = getattr(self._local, "stream", None), s
        try:
            yield
        finally:
            self._local.stream = before

    def _sleep(self, cycles: int) -> None:
        s = self.current_stream()
        s.busy_until = max(s.busy_until, time.perf_counter()) + cycles / FAKE_HZ

    def synchronize(self) -> None:
        self._default.synchronize()

    def init(self) -> None:
        """No context to create."""

    def mem_get_info(self) -> tuple[int, int]:
        return 0, 0

    def memory_reserved(self) -> int:
        return sum(self._blocks.values())

    def empty_cache(self) -> None:
        """Nothing cached."""

    def block(self, nbytes: int) -> FakeBlock:
        b, key = FakeBlock(nbytes), uuid.uuid4().int
        self._blocks[key] = nbytes
        b.key = key
        weakref.finalize(b, self._dropped, key)
        return b

    def _dropped(self, key: int) -> None:
        path = self._shared.get(key)
        if path is not None and _counter(path, 0) > 0:
            self._limbo.add(key)  # still counted as reserved: a consumer may use it
        else:
            self._blocks.pop(key, None)

    def ipc_collect(self) -> None:
        for key in [k for k in self._limbo if _counter(self._shared[k], 0) == 0]:
            self._limbo.discard(key)
            self._blocks.pop(key, None)

    def reduce_tensor(self, b: FakeBlock) -> tuple:
        path = str(self.workdir / f"refcount-{b.key:x}")
        Path(path).write_bytes(struct.pack("<q", 1))  # the export's one reference, as _share_cuda_ sets it
        self._shared[b.key] = path
        return fake_rebuild, (FakeBlock, (len(b),), (1,), 0, "UntypedStorage", "uint8", 0, f"fake-{b.key:x}".encode(),
                              len(b), 0, False, path.encode(), 0, None, False)

    def release_ipc_counter(self, handle: bytes, offset: int) -> None:
        _counter(handle.decode(), offset, -1)

    def lat_input(self):
        import torch  # only the latency question's own process pays for it
        return torch.randn(128, 128)
