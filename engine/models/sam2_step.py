"""One batched tracking step's tensor work, eager or replayed as a CUDA graph.

`step_tensors` is the step: (b) memory attention, (c) the mask decoder, (d) the memory encoder, for B
objects at once (sam2_tracker.py says what each is). `StepGraphs` records it as CUDA graphs for the steady
state, when every object's bank is full: then the memory layout is fixed (`num_maskmem` frames and
`max_obj_ptrs_in_encoder` pointers each, no key mask) and the shapes depend on the object count alone,
so one graph per object count (1, 2, 4, ... padded up, as the encoder's; engine/models/graphs.py) covers
every step of a stream after its first ~16 frames. Steps whose banks are not full (after a prompt), at a
degrade size, or with more objects than the largest graph run eager.

Why: on an H200 the eager tracking stage of 8 streams x 2 objects took 322.8 ms a step, launch-bound on
a slow host (../shared/gpu/README.md); a replay is one launch. Meta compiles the same pieces for its
published speed (`vos_optimized`: the mask decoder and memory encoder with torch.compile's CUDA graphs).
Hand-recorded here rather than compiled: the engine's graphs share one dispatcher (padding, bucket
choice, eager fallback, all tested on the CPU with a fake capture), and capture takes seconds where
max-autotune compilation takes minutes at every start.

The dispatcher takes one static input, so a step's inputs are packed into one float32 row per object:
the current features and their positions, the gathered memory and its positions, the high-resolution
features. Features that arrive in bf16 (the encoder under autocast) are exact in float32 and are cast
back inside the graph, so a replay computes what the eager step does on the same inputs.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from math import prod
from typing import Callable, Optional, Sequence

import torch

from engine.models.graphs import GraphBackend, GraphDispatcher, default_sizes
from engine.models.sam2_attention import memory_attention
from engine.models.sam2_model import autocast

log = logging.getLogger("vidar.sam2")

#: graphs for up to this many objects in a step (more run eager): at 1024 px an object's packed inputs are
#: ~36 MB of the static buffer, so 32 objects hold ~1.1 GB for it, and the graphs' shared pool holds the
#: largest graph's intermediates besides (the 1024x1024 mask scores alone are 4 MB an object): several GB
#: at 32 objects (not measured); `max_objects` bounds it, and the stage frees it at `close`
STEP_GRAPH_CEILING = 32


def step_tensors(m: torch.nn.Module, curr: torch.Tensor, curr_pos: torch.Tensor, memory: torch.Tensor,
                 memory_pos: torch.Tensor, n_ptr: int, key_mask: Optional[torch.Tensor],
                 high_res: Sequence[torch.Tensor], sizes: Sequence[tuple[int, int]],
                 tick: Callable[[str], None] = lambda name: None) -> tuple[torch.Tensor, ...]:
    """(low-res mask logits (B, 1, h, w), object pointers (B, C), object scores (B, 1), mask memories
    (B, mem_dim, h', w'), their position encoding (B, mem_dim, h', w')) for B objects. `curr`, `curr_pos`:
    (HW, B, C); `memory`, `memory_pos`: (L, B, mem_dim) with `n_ptr` pointer tokens at the end; `high_res`:
    the finer feature levels (B, C_l, H_l, W_l); `tick(name)` after each sub-stage (the stage's timing)."""
    B = curr.shape[1]
    H, W = sizes[-1]
    pix = memory_attention(m.memory_attention, curr, curr_pos, memory, memory_pos, n_ptr, key_mask)
    pix = pix.permute(1, 2, 0).reshape(B, m.hidden_dim, H, W)
    tick("memory_attention")
    _, _, _, low, high, obj_ptr, score = m._forward_sam_heads(
        backbone_features=pix, point_inputs=None, mask_inputs=None, high_res_features=list(high_res),
        multimask_output=m._use_multimask(False, None))
    tick("mask_decoder")
    maskmem, pos = m._encode_new_memory(current_vision_feats=[curr], feat_sizes=list(sizes),
                                        pred_masks_high_res=high, object_score_logits=score, is_mask_from_pts=False)
    tick("memory_encoder")
    return low, obj_ptr, score, maskmem, pos[-1]


@dataclass(frozen=True)
class _Part:
    """One input of the step inside an object's packed row: where, its per-object shape and dtype."""

    start: int
    shape: tuple[int, ...]  # without the batch dimension, batch-first
    dtype: torch.dtype

    @property
    def size(self) -> int:
        return prod(self.shape)


class StepGraphs:
    """The steady-state tracking step of one input size as CUDA graphs, one per object count.

    Usage (the tracking stage, at warm-up and then per step):
        g = StepGraphs(model, sizes=[1, 2, 4], backend=CudaGraphBackend(dev), dtype=torch.bfloat16)
        g.capture(features_of_a_frame)            # after an eager step at this size (RoPE tables, caches)
        if g.serves(B, memory.shape[0], n_ptr, key_mask): outs = g.run(curr, curr_pos, memory, memory_pos, hr)
    The outputs are copies (they go into the banks), not views of the graph's buffers.
    """

    def __init__(self, model: torch.nn.Module, *, sizes: Sequence[int], backend: GraphBackend, dtype: torch.dtype,
                 key: str = "models.sam2.tracking_graphs"):
        self.model, self.dtype, self.key = model, dtype, key
        C, D = model.hidden_dim, model.mem_dim
        split = C // D if D < C else 1
        # the full bank (sam2_memory.py): the prompt frame and num_maskmem - 1 recent mask memories; the prompt
        # frame's pointer and max_obj_ptrs_in_encoder - 1 recent ones, each `split` tokens of mem_dim
        self.frames, self.max_ptrs = model.num_maskmem, model.max_obj_ptrs_in_encoder
        self.ptr_tokens = self.max_ptrs * split
        self.dispatcher = GraphDispatcher(self._forward, sizes, backend=backend, key=key, switch=key)
        self._parts: dict[str, _Part] = {}
        self._sizes: list[tuple[int, int]] = []
        self._keep: list[torch.Tensor] = []  # tensors the graphs read by address (RoPE tables): kept alive
        self._lock = threading.Lock()  # one step in the static buffers at a time (run)
        self.busy = 0  # steps that found the lock held and ran eager

    @property
    def replays(self) -> int:
        """Steps run by a graph's replay (an eager fallback inside the dispatcher is not one)."""
        return self.dispatcher.replays

    @property
    def captured(self) -> tuple[int, ...]:
        return self.dispatcher.sizes

    def full(self, plan) -> bool:
        """A sam2_gather.MemoryPlan that reads a full bank (the layout the graphs serve), once they are captured."""
        return bool(self.captured) and len(plan.frames) == self.frames and len(plan.ptrs) == self.max_ptrs

    def memory_length(self, hw: int) -> int:
        return self.frames * hw + self.ptr_tokens

    def serves(self, n: int, length: int, n_ptr: int, key_mask: Optional[torch.Tensor]) -> bool:
        """A step of n objects whose gathered memory has this layout replays a graph."""
        return (bool(self._parts) and key_mask is None and n_ptr == self.ptr_tokens
                and length == self._parts["memory"].shape[0] and self.dispatcher.dispatch(n) is not None)

    def capture(self, curr: torch.Tensor, curr_pos: torch.Tensor, high_res: Sequence[torch.Tensor],
                sizes: Sequence[tuple[int, int]]) -> bool:
        """Record the graphs from one frame's features (shapes and dtypes; the values do not matter): `curr`,
        `curr_pos` (HW, 1, C), `high_res` per finer level (1, C_l, H_l, W_l). True if every size was captured;
        False (and every step eager, the reason logged once) otherwise."""
        hw, D = curr.shape[0], self.model.mem_dim
        length = self.memory_length(hw)
        shapes = {"curr": ((hw, curr.shape[-1]), curr.dtype), "curr_pos": ((hw, curr_pos.shape[-1]), curr_pos.dtype),
                  "memory": ((length, D), torch.float32), "memory_pos": ((length, D), torch.float32),
                  **{f"high_res{i}": (tuple(h.shape[1:]), h.dtype) for i, h in enumerate(high_res)}}
        start = 0
        for name, (shape, dtype) in shapes.items():
            self._parts[name] = _Part(start, shape, dtype)
            start += prod(shape)
        self._sizes = [tuple(s) for s in sizes]
        ok = self.dispatcher.capture((start,), torch.float32, curr.device)
        if not ok:
            self._parts.clear()
            return False
        ma = self.model.memory_attention
        self._keep = [getattr(mod, "freqs_cis") for mod in ma.modules() if hasattr(mod, "freqs_cis")]
        return True

    def run(self, curr: torch.Tensor, curr_pos: torch.Tensor, memory: torch.Tensor, memory_pos: torch.Tensor,
            high_res: Sequence[torch.Tensor]) -> Optional[tuple[torch.Tensor, ...]]:
        """`step_tensors` for the B objects of a step `serves`, replayed; the outputs are the step's own copies.
        None, and nothing done, while another thread is in here: the caller runs the step eager.

        Two threads can step at once only after a hung step's output thread was replaced (output_stage's
        watchdog: the old one may still be running); both writing the one static input would corrupt each
        other's step, and waiting for a thread that hangs would hang the new one too. This guards a thread
        hung on the host only: one hung on the GPU holds the stage's stream, which the new one's work queues on.
        Releasing the lock once the replay is queued (not done) is safe because every step runs on the
        stage's one stream (Sam2Processor), in order: the next copy into the input waits for this replay."""
        if not self._lock.acquire(blocking=False):
            self.busy += 1
            if self.busy == 1:
                log.warning("%s: a step found the graphs in use by another thread (a replaced output thread "
                            "still running?): it runs eager, as every such step will (counted in `busy`)", self.key)
            return None
        try:
            B = curr.shape[1]
            rows = [curr.transpose(0, 1), curr_pos.transpose(0, 1), memory.transpose(0, 1),
                    memory_pos.transpose(0, 1), *high_res]
            x = torch.cat([r.reshape(B, -1).float() for r in rows], dim=1)
            out = self.dispatcher.run(x)
            return tuple(t.clone() for t in out)
        finally:
            self._lock.release()

    def _unpack(self, x: torch.Tensor, name: str) -> torch.Tensor:
        p = self._parts[name]
        return x[:, p.start:p.start + p.size].view(x.shape[0], *p.shape).to(p.dtype)

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seq = {n: self._unpack(x, n).transpose(0, 1) for n in ("curr", "curr_pos", "memory", "memory_pos")}
        high_res = [self._unpack(x, n) for n in self._parts if n.startswith("high_res")]
        with autocast(x.device, self.dtype, cache=False):
            return step_tensors(self.model, seq["curr"], seq["curr_pos"], seq["memory"], seq["memory_pos"],
                                self.ptr_tokens, None, high_res, self._sizes)

    def close(self) -> None:
        self.dispatcher.close()
        self._parts.clear()
        self._keep = []


def step_graph_sizes(max_objects: int) -> list[int]:
    """1, 2, 4, ... up to max_objects, at most STEP_GRAPH_CEILING (graphs.default_sizes)."""
    return default_sizes(min(max_objects, STEP_GRAPH_CEILING))
