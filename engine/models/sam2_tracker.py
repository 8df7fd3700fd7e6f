"""SAM 2 streaming tracker: a tracking stage batched across every (stream, object) pair that is due.

Per processed frame SAM 2 runs (a) the image encoder (see `Sam2EncoderRunner`), then per object
(b) memory attention over the object's memory, (c) the mask decoder, (d) the memory encoder.
Meta's `SAM2VideoPredictor` does (b)-(d) one object at a time and keeps every frame's outputs
for ever. Here (b)-(d) run as one batched call for all due pairs at one input size: the memories of
all objects are gathered in one pass (sam2_gather.py: a fixed number of tensor ops however many objects),
memories of different lengths (the first frames after a prompt) are padded and masked
(sam2_attention.py), and each object keeps a bounded bank (sam2_memory.py).

Frame indices are per-stream counts of *processed* frames: a frame dropped for its deadline
never reaches the tracker, so it leaves no hole in the memory. Nor does a frame that was not
encoded: a stream whose last processed frame had no objects and no prompts is `idle`, the
encoders skip its frames (no features), and a prompt given meanwhile starts on the next frame
that is encoded.

Encoder input sizes: the stage holds one model per size (weights shared) and each bank remembers
the size its memories were made at. A frame encoded at another size (the pool stepped its size
down or up) restarts each object at the new size from its last mask, as a mask prompt (what
Meta's predictor does for `add_new_mask`): same id, no gap in the results.

One owner: the SAM 2 pool's output thread runs every method (control requests included), so
there are no locks. Transactional: a step works on staged copies of its streams' state (`begin`)
and nothing changes until `commit`. A batched call that raises is retried object by object, so
an exception in one object's step fails only that object on that frame (its result says so, and
`object_failures` counts it) and leaves its bank as it was; after `max_attempts` failures in a row
the object (or its pending prompt) is dropped with an event. A bank is created only by a
successful prompt step, so it is never empty.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from engine.models.graphs import CudaGraphBackend, GraphBackend
from engine.models.device import model_stream
from engine.models.mask_rle import encode_masks, encode_masks_host
from engine.models.sam2_gather import MemoryPlan, gather, plan_memory
from engine.models.sam2_step import StepGraphs, step_graph_sizes, step_tensors
from engine.models.sam2_memory import FrameFeatures, Memory, ObjectBank, Prompt, PromptError, StreamTrack
from engine.models.sam2_model import autocast, has_hole_filling

__all__ = ["TrackingStage", "FrameFeatures", "Memory", "ObjectBank", "Prompt", "PromptError", "StreamTrack",
           "encode", "render", "render_frame"]

# SAM2VideoPredictor passes the video length as `num_frames`; min(num_frames, 16) shapes the
# pointers' time encoding. A live stream has no length: any value >= max_obj_ptrs_in_encoder
# gives the same encoding as a reference video of that many frames or more.
NUM_FRAMES = 1 << 30
MAX_ATTEMPTS = 3  # failed steps in a row before an object (or a prompt that cannot start) is dropped


@dataclass
class _Due:
    stream: str
    obj_id: int
    bank: Optional[ObjectBank]  # None for a prompt frame (the bank is made by the step)
    t: int
    feats: FrameFeatures
    prompt: Optional[Prompt] = None
    carry: bool = False  # the bank was made at another input size: restart it at this one from its last mask

    @property
    def starts(self) -> bool:
        """A frame that (re)starts the object's bank rather than stepping it."""
        return self.prompt is not None or self.carry


class TrackingStage:
    """Memory attention + mask decoder + memory encoder for every due (stream, object) pair."""

    def __init__(self, model: torch.nn.Module, *, sized: Optional[dict[int, torch.nn.Module]] = None,
                 max_objects: int = 32, max_attempts: int = MAX_ATTEMPTS, dtype: torch.dtype = torch.float32,
                 graphs: bool = False, graph_backend: Optional[GraphBackend] = None):
        """model: SAM 2 at its configured input size; sized: the same weights built at other sizes; dtype: the
        autocast dtype of every step (bfloat16 on a GPU, as Meta runs it; results are float32 either way);
        graphs: the steady-state step at the model's size as CUDA graphs, captured by `warmup` (on a GPU, or
        with `graph_backend`, a fake in the CPU tests)."""
        self.model, self.dtype = model, dtype
        self.models = {model.image_size: model, **(sized or {})}
        self.device = next(model.parameters()).device
        self.max_objects, self.max_attempts = max_objects, max_attempts
        self._streams: dict[str, StreamTrack] = {}
        self._pos_enc: dict[int, torch.Tensor] = {}  # per input size: maskmem_pos_enc[-1], the same every frame
        self.calls: deque = deque(maxlen=10_000)  # batch size of each batched mask-decoder call (tests, benchmarks)
        self.padded_calls = 0  # batched calls whose memories differed in length (padded and masked)
        # seconds per batched call of each sub-stage, for benchmarks (bounded)
        self.stage_s: dict[str, deque] = {k: deque(maxlen=10_000)
                                          for k in ("memory_attention", "mask_decoder", "memory_encoder",
                                                    "graphed_step")}
        self.graphs: dict[int, StepGraphs] = {}  # per input size (the model's own only): captured at warm-up
        if graphs and (graph_backend is not None or self.device.type == "cuda"):
            self.graphs[model.image_size] = StepGraphs(model, sizes=step_graph_sizes(max_objects), dtype=dtype,
                                                       backend=graph_backend or CudaGraphBackend(self.device))
        # the stage's own CUDA stream (None on the CPU), not an encoder's: the encoder and the stage overlap on
        # the GPU; Sam2Processor runs the stage's work (warm-up, steps) on it
        self.cuda_stream = model_stream(self.device)
        self.timed = False  # on a GPU, sync between sub-stages to time them (benchmarks only: it costs)
        self.events: deque = deque(maxlen=1000)  # (stream, kind, reason) to publish
        self.object_failures: Counter = Counter()  # per stream: object steps that failed (committed)
        self.snapshot: dict[str, dict] = {}        # per stream: frame, objects, pending (read by any thread)

    # -- control ----------------------------------------------------------------------------
    def add_stream(self, stream: str) -> None:
        self._streams.setdefault(stream, StreamTrack())
        self._refresh()

    @torch.inference_mode()
    def warmup(self, steps: int = 3) -> float:
        """At every input size, on an encoded blank frame: object 0 prompted on the first step, object 1 on the
        second (unless max_objects is 1), then tracked for `steps` steps in all, so the prompt path, the batched
        step of one object and the padded, masked step of two objects whose banks differ all run once before the
        first camera frame (allocations, kernel selection; on a GPU cuDNN's autotuning); then the steady-state
        step's CUDA graphs are captured (`graphs`). Nothing of the steps stays: the stream is removed, and the counters and
        events are as they were. Returns the seconds it took (the GPU waited for)."""
        if steps < 3:
            raise ValueError(f"warmup: steps must be >= 3 to reach a padded step, got {steps}")
        t0 = time.perf_counter()
        stream, calls, padded, events = "\x00warmup", len(self.calls), self.padded_calls, len(self.events)
        blank: dict[int, FrameFeatures] = {}
        for size, m in self.models.items():
            with autocast(self.device, self.dtype):
                feats = encode(m, torch.zeros(1, 3, size, size, device=self.device))[0]
            blank[size] = feats
            self.add_stream(stream)
            try:
                for k in range(steps):
                    if k < min(2, self.max_objects):  # max_objects 1 never pads a step: one object suffices
                        lo, hi = size // (4 + k), size - size // (4 + k)
                        self.add_object(stream, Prompt(k, box=[lo, lo, hi, hi]))
                    self.step([(stream, feats, (size, size))])
            finally:
                self.remove_stream(stream)
        while len(self.events) > events:
            self.events.pop()
        while len(self.calls) > calls:
            self.calls.pop()
        self.padded_calls = padded
        for lst in self.stage_s.values():
            lst.clear()
        for size, graphs in self.graphs.items():  # after the eager steps: RoPE tables and caches exist
            f = blank[size]
            high_res = [f.vision_feats[lvl].permute(1, 2, 0).reshape(1, -1, *f.feat_sizes[lvl])
                        for lvl in range(len(f.feat_sizes) - 1)]
            graphs.capture(f.vision_feats[-1], f.vision_pos[-1], high_res, f.feat_sizes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Free the steady-state graphs (their static buffers and memory pool) once no step can run."""
        for graphs in self.graphs.values():
            graphs.close()
        self.graphs.clear()

    def remove_stream(self, stream: str) -> None:
        self._streams.pop(stream, None)
        self.object_failures.pop(stream, None)
        self._refresh()

    def reset_stream(self, stream: str) -> None:
        """Forget every object and prompt of a stream (its frame count goes on)."""
        st = self._track(stream)
        st.objects.clear()
        st.pending.clear()
        st.failures.clear()
        self._refresh()

    def _track(self, stream: str) -> StreamTrack:
        st = self._streams.get(stream)
        if st is None:
            raise PromptError(f"unknown stream {stream!r} (or it does not feed the sam2 pool); "
                              f"known: {sorted(self._streams)}")
        return st

    def add_object(self, stream: str, prompt: Prompt) -> None:
        """Track `prompt.obj_id` from the stream's next processed frame (an existing id restarts)."""
        st = self._track(stream)
        new = prompt.obj_id not in st.objects and prompt.obj_id not in st.pending
        if new and sum(s.count() for s in self._streams.values()) >= self.max_objects:
            raise PromptError(f"models.sam2.max_objects={self.max_objects} objects are tracked already: remove one "
                              "(remove_object, reset_stream) or raise models.sam2.max_objects")
        if st.size is not None:
            prompt.check(st.size[1], st.size[0], f"stream {stream!r} object {prompt.obj_id}")
        st.pending[prompt.obj_id] = prompt
        st.failures.pop(prompt.obj_id, None)
        st.idle = False  # encode its frames again from now on
        self._refresh()

    def remove_object(self, stream: str, obj_id: int) -> None:
        st = self._track(stream)
        if obj_id not in st.objects and obj_id not in st.pending:
            raise PromptError(f"stream {stream!r} has no object {obj_id}; objects: {sorted(st.objects)}")
        st.objects.pop(obj_id, None)
        st.pending.pop(obj_id, None)
        st.failures.pop(obj_id, None)
        self._refresh()

    def _refresh(self) -> None:
        self.snapshot = {s: {"frame": st.frame_idx, "objects": sorted(st.objects), "pending": sorted(st.pending),
                             "idle": st.idle} for s, st in self._streams.items()}

    def wants_frames(self, stream: str) -> bool:
        """Whether a frame of this stream should be encoded (any thread: reads the snapshot). False only
        for a stream whose last processed frame had nothing to track and that got no prompt since."""
        d = self.snapshot.get(stream)
        return d is None or not d["idle"]

    def list(self) -> dict[str, dict]:
        return self.snapshot

    def bank_entries(self) -> dict[tuple[str, int], int]:
        return {(s, o): b.entries() for s, st in self._streams.items() for o, b in st.objects.items()}

    # -- data plane -------------------------------------------------------------------------
    def step(self, frames: list[tuple[str, FrameFeatures, tuple[int, int]]]) -> list[list[dict]]:
        """begin + track + commit: for a caller that owns the stage alone (tests, benchmarks)."""
        for stream, _, _ in frames:
            self._track(stream)  # an unknown stream is an error here, not a skipped frame
        staged = self.begin([s for s, _, _ in frames])
        out, events = self.track(staged, frames)
        self.commit(staged, events)
        return out

    def begin(self, streams: list[str]) -> dict[str, StreamTrack]:
        """Staged copies of these streams' state (unknown streams are left out)."""
        return {s: self._streams[s].staged() for s in dict.fromkeys(streams) if s in self._streams}

    def commit(self, staged: dict[str, StreamTrack], events: list[tuple[str, str, str]]) -> None:
        for stream, st in staged.items():
            if stream in self._streams:  # a stream removed meanwhile stays removed
                if st.step_failures:
                    self.object_failures[stream] += st.step_failures
                st.step_failures = 0
                self._streams[stream] = st
        self.events.extend(events)
        self._refresh()

    @torch.inference_mode()
    def track(self, staged: dict[str, StreamTrack], frames: list[tuple[str, FrameFeatures, tuple[int, int]]]
              ) -> tuple[list[list[dict]], list[tuple[str, str, str]]]:
        """Track every object of each given frame on the staged state. `frames`: (stream, features or None
        for a frame that was not encoded, (H, W)), at most one frame per stream per call. Returns per frame
        a list sorted by object id of {id, logits (1, 1, h, w) float32 low-res mask scores, score} or
        {id, error}, and the events to publish."""
        with autocast(self.device, self.dtype):
            return self._track_frames(staged, frames)

    def _track_frames(self, staged: dict[str, StreamTrack], frames: list[tuple[str, FrameFeatures, tuple[int, int]]]
                      ) -> tuple[list[list[dict]], list[tuple[str, str, str]]]:
        events: list[tuple[str, str, str]] = []
        due = self._due(staged, frames, events)
        results: dict[int, dict] = {}
        for i, d in enumerate(due):
            if d.starts:
                try:
                    results[i], bank = self._init_object(d, staged[d.stream].size)
                except Exception as err:
                    results[i] = self._failed(staged[d.stream], d, err, events)
                    continue
                st = staged[d.stream]
                st.objects[d.obj_id] = bank
                st.pending.pop(d.obj_id, None)
                st.failures.pop(d.obj_id, None)
        for idxs, outs in self._track_groups(due):
            for i, out in zip(idxs, outs):
                d, st = due[i], staged[due[i].stream]
                if isinstance(out, BaseException):
                    results[i] = self._failed(st, d, out, events)
                    continue
                d.bank.push(d.t, out.pop("memory"))
                d.bank.last_logits = out["logits"]
                st.failures.pop(d.obj_id, None)
                results[i] = out
        out: list[list[dict]] = [[] for _ in frames]
        order = {s: k for k, (s, _, _) in enumerate(frames)}
        for i, d in enumerate(due):
            out[order[d.stream]].append(dict(results[i], id=d.obj_id))
        for k, (stream, feats, _) in enumerate(frames):
            if feats is None:  # objects added while this frame was skipped (several encoders raced): say so
                out[k] += [{"id": o, "error": "frame not encoded: the stream had nothing to track when it was "
                                              "dispatched"} for o in staged[stream].objects]
        for lst in out:
            lst.sort(key=lambda r: r["id"])
        return out, events

    def _due(self, staged: dict[str, StreamTrack], frames: list, events: list) -> list[_Due]:
        due: list[_Due] = []
        for stream, feats, size in frames:
            st = staged[stream]
            st.size = size
            for obj_id, prompt in list(st.pending.items()):
                try:  # prompts given before the first frame are checked once its size is known
                    prompt.check(size[1], size[0], f"stream {stream!r} object {obj_id}")
                except PromptError as err:
                    st.pending.pop(obj_id)
                    events.append((stream, "error", f"object {obj_id} rejected: {err}"))
            if feats is None:
                continue  # not encoded: not a processed frame (prompts wait for the next one)
            st.idle = not st.objects and not st.pending
            for obj_id in sorted(set(st.objects) | set(st.pending)):
                prompt = st.pending.get(obj_id)
                bank = None if prompt else st.objects[obj_id]
                carry = bank is not None and bank.image_size != feats.image_size
                due.append(_Due(stream, obj_id, bank, st.frame_idx, feats, prompt, carry))
            st.frame_idx += 1
        return due

    def _track_groups(self, due: list[_Due]):
        """(indices, outputs) per group: one batched call per input size, memories of different lengths padded
        and masked (sam2_attention.py); if it raises, each object of the group alone, so only the failing ones
        fail.
        Where the size has steady-state graphs, the objects with full banks are a call of their own (replayed)
        and those still filling another (eager, padded): one new object does not send every other eager."""
        groups: dict[tuple[int, bool], list[int]] = {}
        plans = {}
        for i, d in enumerate(due):
            if not d.starts:
                try:
                    plans[i] = plan_memory(self._model(d.bank.image_size), d.bank, d.t, NUM_FRAMES)
                except Exception as err:
                    yield [i], [err]
                    continue
                graphs = self.graphs.get(d.bank.image_size)
                full = graphs is not None and graphs.full(plans[i])
                groups.setdefault((d.bank.image_size, full), []).append(i)
        for idxs in groups.values():
            try:
                outs = self._track_batch([due[i] for i in idxs], [plans[i] for i in idxs])
            except Exception as err:
                outs = [err] if len(idxs) == 1 else [self._track_one(due[i], plans[i]) for i in idxs]
            yield idxs, outs

    def _track_one(self, d: _Due, plan: MemoryPlan) -> dict | BaseException:
        try:
            return self._track_batch([d], [plan])[0]
        except Exception as err:
            return err

    def _failed(self, st: StreamTrack, d: _Due, err: BaseException, events: list) -> dict:
        """One object's step failed: its bank (or pending prompt) stays as it was."""
        st.step_failures += 1
        n = st.failures[d.obj_id] = st.failures.get(d.obj_id, 0) + 1
        why = f"{type(err).__name__}: {err}"
        if n >= self.max_attempts:
            st.objects.pop(d.obj_id, None)
            st.pending.pop(d.obj_id, None)
            st.failures.pop(d.obj_id, None)
            what = "prompt rejected" if d.prompt is not None else "dropped"
            events.append((d.stream, "error", f"object {d.obj_id} {what} after {n} failed steps in a row: {why}"))
        return {"error": why}

    def _model(self, image_size: int) -> torch.nn.Module:
        m = self.models.get(image_size)
        if m is None:
            raise ValueError(f"features at input size {image_size}: the tracking stage has models for {sorted(self.models)}")
        return m

    def _init_object(self, d: _Due, size: tuple[int, int]) -> tuple[dict, ObjectBank]:
        """A prompt frame (points / box, or the object's last mask when its bank was made at another
        input size): SAM on this frame alone, then its memory (as the predictor's preflight does).
        Returns the result and the object's new bank."""
        f = d.feats
        m = self._model(f.image_size)
        if d.prompt is not None:
            point_inputs, mask_inputs = self._point_inputs(d.prompt, size, m.image_size), None
        else:
            point_inputs, mask_inputs = None, self._mask_inputs(d.bank, size, m.image_size)
        out = m.track_step(frame_idx=d.t, is_init_cond_frame=True, current_vision_feats=f.vision_feats,
                           current_vision_pos_embeds=f.vision_pos, feat_sizes=f.feat_sizes, point_inputs=point_inputs,
                           mask_inputs=mask_inputs, output_dict={"cond_frame_outputs": {}, "non_cond_frame_outputs": {}},
                           num_frames=NUM_FRAMES, run_mem_encoder=False)
        masks = self._fill_holes(out["pred_masks"].float())
        high = F.interpolate(masks, size=(m.image_size, m.image_size), mode="bilinear", align_corners=False)
        # the predictor encodes every frame the user prompted (points or mask) with is_mask_from_pts=True
        maskmem, pos = m._encode_new_memory(current_vision_feats=f.vision_feats, feat_sizes=f.feat_sizes,
                                            pred_masks_high_res=high, object_score_logits=out["object_score_logits"],
                                            is_mask_from_pts=True)
        self._remember_pos(pos[-1], m.image_size)
        bank = ObjectBank(m.num_maskmem, m.max_obj_ptrs_in_encoder,
                          {d.t: Memory(maskmem.to(torch.bfloat16), out["obj_ptr"])}, m.image_size, masks)
        return {"logits": masks, "score": out["object_score_logits"].float()}, bank

    def _point_inputs(self, prompt: Prompt, size: tuple[int, int], image_size: int) -> dict:
        h, w = size
        coords, labels = [], []
        if prompt.box is not None:
            coords += [prompt.box[:2], prompt.box[2:]]
            labels += [2, 3]
        for x, y, lab in prompt.points or []:
            coords.append([x, y])
            labels.append(int(lab))
        pts = torch.tensor(coords, dtype=torch.float32)[None] / torch.tensor([w, h]) * image_size
        return {"point_coords": pts.to(self.device),
                "point_labels": torch.tensor([labels], dtype=torch.int32, device=self.device)}

    @staticmethod
    def _mask_inputs(bank: ObjectBank, size: tuple[int, int], image_size: int) -> torch.Tensor:
        """The object's last mask as published (at the stream's resolution), resized to the new input size
        as the predictor's add_new_mask resizes a user's mask: (1, 1, S, S) float 0/1."""
        video = F.interpolate(bank.last_logits.float(), size=size, mode="bilinear", align_corners=False) > 0
        mask = F.interpolate(video.float(), size=(image_size, image_size), mode="bilinear", align_corners=False,
                             antialias=True)
        return (mask >= 0.5).float()

    def _fill_holes(self, masks: torch.Tensor) -> torch.Tensor:
        # Needs sam2's compiled CUDA extension; without it the predictor skips this step too (with a
        # warning per frame). We check once at start-up (sam2_model.has_hole_filling) and skip quietly.
        if self.model.fill_hole_area > 0 and has_hole_filling():
            from sam2.utils.misc import fill_holes_in_mask_scores
            return fill_holes_in_mask_scores(masks, self.model.fill_hole_area)
        return masks

    def _sync_time(self) -> float:
        # Per-stage timings need this stage's queue drained (its stream, not the device: the encoder's work
        # overlaps); on the CPU this is just a clock read.
        if self.device.type == "cuda" and self.timed:
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def _remember_pos(self, pos: torch.Tensor, image_size: int) -> None:
        """`pos`: the memory encoder's position encoding (B, mem_dim, h, w), the same for every frame."""
        if image_size not in self._pos_enc:
            self._pos_enc[image_size] = pos[0:1].flatten(2).permute(2, 0, 1).clone()  # (HW, 1, mem_dim)

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        """A step's host numbers on the device without waiting: `torch.tensor(values, device="cuda")` copies
        from pageable memory synchronously, i.e. waits until the GPU has run everything queued before it
        (Meta's predictor does that once per object per step); from pinned memory the copy is queued."""
        host = torch.from_numpy(values)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _track_batch(self, items: list[_Due], plans: list[MemoryPlan]) -> list[dict]:
        """(b) memory attention, (c) mask decoder, (d) memory encoder: one call each for the group, or one
        graph replay in the steady state (sam2_step.py). Returns per item {logits, score, memory}; the banks
        are not touched (the caller pushes)."""
        m = self._model(items[0].feats.image_size)
        B = len(items)
        self.calls.append(B)
        feats = [d.feats for d in items]
        sizes = feats[0].feat_sizes
        curr = torch.cat([f.vision_feats[-1] for f in feats], dim=1)  # (HW, B, C)
        curr_pos = torch.cat([f.vision_pos[-1] for f in feats], dim=1)
        t0 = time.perf_counter()
        memory, memory_pos, n_ptr, key_mask = gather(m, plans, self._pos_enc[m.image_size], NUM_FRAMES, self._upload)
        self.padded_calls += key_mask is not None
        high_res = [torch.cat([f.vision_feats[lvl] for f in feats], dim=1).permute(1, 2, 0).reshape(B, -1, *sizes[lvl])
                    for lvl in range(len(sizes) - 1)]
        graphs = self.graphs.get(m.image_size)
        replayed = None
        if graphs is not None and graphs.serves(B, memory.shape[0], n_ptr, key_mask):
            replayed = graphs.run(curr, curr_pos, memory, memory_pos, high_res)  # None: the graphs are busy
        if replayed is not None:
            low, obj_ptr, score, maskmem, pos = replayed
            self.stage_s["graphed_step"].append(self._sync_time() - t0)
        else:
            last = [t0]

            def tick(name: str) -> None:
                now = self._sync_time()
                self.stage_s[name].append(now - last[0])
                last[0] = now
            low, obj_ptr, score, maskmem, pos = step_tensors(m, curr, curr_pos, memory, memory_pos, n_ptr, key_mask,
                                                             high_res, sizes, tick)
        self._remember_pos(pos, m.image_size)
        maskmem = maskmem.to(torch.bfloat16)
        filled, score = self._fill_holes(low.float()), score.float()
        return [{"logits": filled[i:i + 1], "score": score[i:i + 1], "memory": Memory(maskmem[i:i + 1], obj_ptr[i:i + 1])}
                for i in range(len(items))]

def render(result: dict, height: int, width: int) -> dict:
    """Low-res mask scores -> the published object: COCO RLE at the stream's resolution, bbox, score."""
    from pycocotools import mask as mask_utils

    video = F.interpolate(result["logits"].float(), size=(height, width), mode="bilinear", align_corners=False)
    binary = (video[0, 0] > 0).cpu().numpy()
    rle = mask_utils.encode(np.asfortranarray(binary.astype(np.uint8)))
    ys, xs = np.nonzero(binary)
    bbox = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1] if xs.size else None
    return {"id": int(result["id"]), "mask": {"size": [int(height), int(width)], "counts": rle["counts"].decode()},
            "bbox": bbox, "score": float(torch.sigmoid(result["score"].float()).item())}


def render_frame(results: list[dict], height: int, width: int) -> list[dict]:
    """`render` for all objects of one frame at once: one resize for all their masks, the bbox from row and
    column maxima (no pixel list), one RLE call; the same output as `render` on each. On a GPU the masks
    stay there: only their run boundaries come to the host (mask_rle.py)."""
    if not results:
        return []
    if len({r["logits"].shape for r in results}) > 1:  # masks at different sizes cannot share one resize
        return [obj for r in results for obj in render_frame([r], height, width)]
    logits = torch.cat([r["logits"] for r in results]).float()
    video = F.interpolate(logits, size=(height, width), mode="bilinear", align_corners=False)[:, 0] > 0
    scores_t = torch.sigmoid(torch.cat([r["score"].reshape(-1)[:1] for r in results]).float())
    on_device = video.device.type != "cpu" if RLE_ON_DEVICE is None else RLE_ON_DEVICE
    if on_device:  # the scores ride along with the RLE's one transfer (mask_rle.py): no sync of their own
        rles, boxes, (scores,) = encode_masks(video, carry=[scores_t])
        scores = scores.tolist()  # a numpy array on the host
    else:  # on the CPU pycocotools' C encoder is faster: a 720p frame's 2 masks 8 ms against 16 (RESULTS.md)
        rles, boxes = encode_masks_host(video)
        scores = scores_t.tolist()  # on the host already (a GPU takes this branch only for RLE_ON_DEVICE=False)
    return [{"id": int(r["id"]), "mask": rles[k], "bbox": boxes[k], "score": float(scores[k])}
            for k, r in enumerate(results)]


#: where render_frame finds the RLE: None = with the masks' device (torch ops on a GPU, pycocotools on the CPU);
#: True = the torch ops anywhere (tests run the GPU path's ops on CPU tensors); False = the whole masks copied to
#: the host for pycocotools (gpu_check times it against the device path: what the GPU path did before)
RLE_ON_DEVICE: Optional[bool] = None


def backbone(model: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The image encoder's outputs the tracking stage reads, as a flat tuple (what a CUDA graph captures):
    the FPN levels, then their position encodings."""
    out = model.forward_image(images)
    return (*out["backbone_fpn"], *out["vision_pos_enc"])


@torch.inference_mode()
def encode(model: torch.nn.Module, images: torch.Tensor, outputs: Optional[tuple[torch.Tensor, ...]] = None
           ) -> list[FrameFeatures]:
    """(a) the image encoder on a batch of frames (any streams); features split per frame. `outputs`: the
    encoder's outputs computed already (`backbone`, replayed from a CUDA graph): views of the graph's static
    buffers, which the next replay overwrites, so each frame's features are copied out of them."""
    copy = outputs is not None
    if outputs is None:
        outputs = backbone(model, images)
    levels = len(outputs) // 2
    fpn, pos = outputs[:levels], outputs[levels:]
    feats = []
    for i in range(images.shape[0]):
        one = {"backbone_fpn": [x[i:i + 1].clone() if copy else x[i:i + 1] for x in fpn],
               "vision_pos_enc": [x[i:i + 1].clone() if copy else x[i:i + 1] for x in pos]}
        _, vision_feats, vision_pos, sizes = model._prepare_backbone_features(one)
        feats.append(FrameFeatures(vision_feats, vision_pos, sizes, images.shape[-1]))
    return feats
