"""CUDA graphs for a model runner's forward, and the copy of a batch's results to the host.

`GraphDispatcher` is the one owner of which graphs exist (vLLM's `v1/cudagraph_dispatcher.py` is the
model): its `sizes` are the truth, `dispatch(n)` picks the smallest captured size >= n (the batch is
padded up to it) or None (eager), `capture` records one graph per size at warm-up and `run` replays.
On an H200, timm's ViT-L/16 in bf16 at batch 1 ran 6-10 ms eager (launch-bound) and 1.39 ms replayed
(../shared/gpu/README.md), which is why a pool on a GPU runs graphs.

The capture mechanics sit behind `GraphBackend`, so that the CPU tests drive padding, bucket choice,
static-buffer reuse, output slicing and the eager fallback with a fake that "replays" by calling the
function again; `CudaGraphBackend` is the real one (the pattern of ../shared/gpu/probe.py `s_vit`).

`HostCopy` is the other half of STYLE.md point 17: a batch's small outputs are copied into pinned host
buffers on the runner's stream behind its kernels, one event is recorded, and the caller blocks on that
event only when it reads them (not on a `.cpu()` per tensor, each a full stream synchronisation).
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from engine.models.device import host_event, pinned_empty
from engine.sched.batch_size import candidate_sizes

log = logging.getLogger("vidar.graphs")

#: what a captured function returns: a tensor, or a tuple/list of tensors and None (classify: logits, embedding)
Outputs = Any
Forward = Callable[[torch.Tensor], Outputs]

# torch allows one capture at a time in a process (torch.cuda.graph's own note); runners of several
# pools, or a worker rebuilt while another runner captures, take turns here.
_CAPTURE_LOCK = threading.Lock()


def default_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, ... up to `max_batch`, and `max_batch` (ClassifyConfig.graph_batch_sizes unset): the
    sizes an auto max_batch sweep measures too (engine/sched/batch_size.py says why powers of two)."""
    return candidate_sizes(max_batch)


class GraphBackend(Protocol):
    """How a graph is recorded and replayed; the dispatcher decides which and when."""

    def new_pool(self) -> Any:
        """A memory pool all of one dispatcher's graphs share."""

    def capture(self, fn: Forward, static_in: torch.Tensor, pool: Any) -> tuple[Callable[[], None], Outputs]:
        """Record `fn(static_in)`; return (replay, the static outputs each replay overwrites)."""


def _graph_kwargs() -> dict[str, str]:
    # thread_local: only this thread's unsafe CUDA calls (cudaMalloc, a sync) break the capture, so a
    # decoder or another runner working on its own stream meanwhile cannot invalidate it; torch >= 2.1
    params = inspect.signature(torch.cuda.graph.__init__).parameters
    return {"capture_error_mode": "thread_local"} if "capture_error_mode" in params else {}


class CudaGraphBackend:
    """torch.cuda.CUDAGraph: warm-up runs on a side stream, then the capture on that same stream.

    The side stream keeps the warm-up's one-time work (cuBLAS workspaces, autotuning) off the capture;
    one stream for every capture of a pool is what torch asks for when captures share a pool.
    """

    def __init__(self, device: torch.device, *, warmup_runs: int = 2):
        self.device, self.warmup_runs = device, warmup_runs
        self._stream: Optional[torch.cuda.Stream] = None

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Forward, static_in: torch.Tensor, pool: Any) -> tuple[Callable[[], None], Outputs]:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        side = self._stream
        with _CAPTURE_LOCK:
            current = torch.cuda.current_stream(self.device)
            side.wait_stream(current)
            try:
                with torch.cuda.stream(side):
                    for _ in range(self.warmup_runs):
                        fn(static_in)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side, **_graph_kwargs()):
                    out = fn(static_in)
            finally:
                # torch.cuda.graph's exit ends the capture before it restores the stream: a capture that
                # fails there would leave this thread on the side stream
                torch.cuda.set_stream(current)
                current.wait_stream(side)
        return graph.replay, out


def _rows(out: Outputs, n: int) -> Outputs:
    """The first n rows of every tensor in `out` (views: the padded rows' outputs are dropped)."""
    if isinstance(out, torch.Tensor):
        return out[:n]
    if isinstance(out, (tuple, list)):
        return type(out)(_rows(o, n) for o in out)
    return out  # None and other non-tensors pass through


class GraphDispatcher:
    """Which CUDA graphs exist for one runner, their capture at warm-up and their padded replay.

    Contract of `run`: with a graph, the returned tensors are views of the graph's static outputs, so
    the next `run` overwrites them: the caller reads (or copies) them before it calls `run` again.
    One dispatcher serves one thread (its runner's worker); graphs never replay concurrently, which is
    what makes sharing one input buffer and one memory pool between all sizes safe.

    Example:
        d = GraphDispatcher(model_forward, [1, 2, 4, 8], backend=CudaGraphBackend(dev), key="models.classify")
        d.capture((3, 224, 224), torch.bfloat16, dev)   # at warm-up, before the decoders start
        logits = d.run(x)                                # x: [n, 3, 224, 224]; replays the graph of size >= n
    """

    def __init__(self, forward: Forward, wanted: Sequence[int], *, backend: GraphBackend, key: str,
                 switch: Optional[str] = None):
        """`switch`: the config key that turns these graphs off, named when capture fails (default
        `<key>.cuda_graphs`)."""
        if not wanted or min(wanted) < 1:
            raise ValueError(f"{key}.graph_batch_sizes: need batch sizes >= 1, got {list(wanted)!r}")
        self.forward, self.backend, self.key = forward, backend, key
        self.switch = switch or f"{key}.cuda_graphs"
        self.replays = 0  # batches run by a graph's replay (not the eager fallbacks)
        self.wanted: tuple[int, ...] = tuple(sorted(set(int(b) for b in wanted)))
        self.eager_reason: Optional[str] = None  # why there are no graphs, once capture was tried
        self._graphs: dict[int, tuple[Callable[[], None], Outputs]] = {}
        self._static_in: Optional[torch.Tensor] = None
        self._pool: Any = None
        self._dirty_rows = 0  # rows of the static input a previous batch left non-zero
        self._mismatch_logged = False

    @property
    def sizes(self) -> tuple[int, ...]:
        """The captured batch sizes, sorted (empty before capture and after a failed one)."""
        return tuple(sorted(self._graphs))

    @property
    def attempted(self) -> bool:
        return bool(self._graphs) or self.eager_reason is not None

    def dispatch(self, n: int) -> Optional[int]:
        """The smallest captured size >= n, or None: no graph that large (or none at all), run eager.

        Over the largest captured size is eager, not an error: graph_batch_sizes may stop below
        max_batch on purpose (capture memory), and the scheduler never forms a batch over max_batch.
        """
        if n < 1:
            raise ValueError(f"{self.key}: a batch needs at least 1 input, got {n}")
        return next((b for b in self.sizes if b >= n), None)

    @torch.inference_mode()
    def capture(self, item_shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> bool:
        """Capture one graph per wanted size, largest first; True if they all were.

        `item_shape` is one input without the batch dimension, e.g. (3, 224, 224). All graphs share one
        memory pool and one static input buffer of the largest size, each graph reading its first b
        rows (a slice on dim 0 of a contiguous buffer is contiguous and starts at the same address):
        one allocation and one copy target instead of one per size, safe because graphs never run at
        the same time. Largest first, so the smaller graphs reuse the larger one's freed intermediates
        in the shared pool (vLLM's order). Any failure leaves no graph at all (`eager_reason` says why,
        logged once): a partial set would only complicate what the latency model learns.
        """
        if self.attempted:
            return bool(self._graphs)
        try:
            self._pool = self.backend.new_pool()
            self._static_in = torch.zeros((self.wanted[-1], *item_shape), dtype=dtype, device=device)
            for b in reversed(self.wanted):
                self._graphs[b] = self.backend.capture(self.forward, self._static_in[:b], self._pool)
        except Exception as e:  # any capture failure (an op that syncs, out of memory, ...) means eager
            self._graphs.clear()
            self._static_in = self._pool = None
            self.eager_reason = f"capture failed: {type(e).__name__}: {e}"
            log.warning("%s: CUDA graphs off, every batch runs eager: %s (set %s: false to skip the capture)",
                        self.key, self.eager_reason, self.switch)
            return False
        log.info("%s: CUDA graphs captured for batch sizes %s (a batch runs in the next size up, padded; "
                 "a batch over %d runs eager)", self.key, list(self.sizes), self.sizes[-1])
        return True

    @torch.inference_mode()
    def run(self, x: torch.Tensor) -> Outputs:
        """forward(x), replayed in the graph of the next captured size up (padded), or eager.

        With a graph the outputs are views of static buffers: see the class contract.
        """
        n = int(x.shape[0])
        size = self.dispatch(n)
        if size is None or not self._fits(x):
            return self.forward(x)
        static = self._static_in
        static[:n].copy_(x)
        # padding: zeros (the padded rows' outputs are dropped; zeros keep their work the same every time
        # and never hand a previous batch's frame on); only rows a larger batch left behind need it
        if self._dirty_rows > n:
            static[n:self._dirty_rows].zero_()
        self._dirty_rows = n
        replay, out = self._graphs[size]
        replay()
        self.replays += 1
        return _rows(out, n)

    def _fits(self, x: torch.Tensor) -> bool:
        s = self._static_in
        if x.shape[1:] == s.shape[1:] and x.dtype == s.dtype and x.device == s.device:
            return True
        if not self._mismatch_logged:  # a contract change (input size, dtype) at run time: say so once
            self._mismatch_logged = True
            log.warning("%s: input %s %s on %s does not match the captured %s %s on %s: running eager",
                        self.key, tuple(x.shape[1:]), x.dtype, x.device, tuple(s.shape[1:]), s.dtype, s.device)
        return False

    def close(self) -> None:
        """Drop the graphs (their pool's memory goes back to torch's allocator)."""
        self._graphs.clear()
        self._static_in = self._pool = None


class HostCopy:
    """Host buffers a batch's small outputs are copied into without a full synchronisation.

    `copy(tensors, stream)` queues one non-blocking copy per tensor into pinned buffers (kept and grown,
    never shrunk) behind the work already on `stream`, and records one event; `wait()` blocks on that
    event alone. The returned host tensors are views of the buffers: read them before the next `copy`.
    With `pin=False` (CPU tests) the copies are plain and `wait` returns at once.
    """

    def __init__(self, *, pin: bool = True):
        self.pin = pin
        self._bufs: list[torch.Tensor] = []
        self._event = host_event() if pin else None  # wait() blocks on it: blocking, so the host sleeps

    def copy(self, tensors: Sequence[torch.Tensor], stream: Optional[Any] = None) -> list[torch.Tensor]:
        host = []
        for i, t in enumerate(tensors):
            buf = self._bufs[i] if i < len(self._bufs) else None
            if buf is None or buf.dtype != t.dtype or buf.numel() < t.numel():
                # pinned: the copy from the device is a DMA queued behind the kernels (pageable would sync)
                buf = pinned_empty(t.numel(), t.dtype) if self.pin else torch.empty(t.numel(), dtype=t.dtype)
                self._bufs[i:i + 1] = [buf]
            view = buf[:t.numel()].view(t.shape)
            view.copy_(t, non_blocking=self.pin)
            host.append(view)
        if self._event is not None:
            self._event.record(stream)
        return host

    def wait(self) -> None:
        """Block until the last `copy`'s data is on the host."""
        if self._event is not None:
            self._event.synchronize()
