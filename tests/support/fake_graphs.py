"""A stand-in for torch.cuda.CUDAGraph on the CPU (engine/models/graphs.py GraphBackend): it "captures" by
remembering the function and "replays" by calling it on the static input and writing the result into the
static outputs, so a caller that keeps a view of a previous replay's outputs sees them overwritten, as with
a real graph."""

from __future__ import annotations

import torch


def _write(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _write(d, s)


class FakeBackend:
    """Records captures and replays; `fail_at` makes the capture of that size raise."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.captures: list[tuple[int, int, object]] = []  # (size, static input address, pool)
        self.replays: list[tuple[int, torch.Tensor]] = []   # (size, the whole static buffer at replay)
        self.buffer: torch.Tensor | None = None

    def new_pool(self):
        return object()

    def capture(self, fn, static_in, pool):
        b = static_in.shape[0]
        if b == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures.append((b, static_in.data_ptr(), pool))
        self.buffer = static_in if self.buffer is None else self.buffer  # the largest comes first: the whole buffer
        out = fn(static_in)

        def replay():
            self.replays.append((b, self.buffer.clone()))
            _write(out, fn(static_in))
        return replay, out
