"""SAM 2 streaming tracker: bounded per-object memory banks and a decoder stage batched across
every (stream, object) pair that is due.

Per processed frame SAM 2 runs (a) the image encoder (see `Sam2EncoderWorker`), then per object
(b) memory attention over the object's memory, (c) the mask decoder, (d) the memory encoder.
Meta's `SAM2VideoPredictor` does (b)-(d) one object at a time and keeps every frame's outputs
for ever. Here (b)-(d) run as one batched call for all due pairs whose memories have the same
shape (at steady state: all of them), and each object keeps only what SAM 2's memory selection
can ever read again (sam2_base.py `_prepare_memory_conditioned_features`, eval mode, stride 1):
its conditioning (prompt) frame, the last `num_maskmem - 1` mask memories and the last
`max_obj_ptrs_in_encoder - 1` object pointers. Memory per object is therefore constant.

Frame indices are per-stream counts of *processed* frames: a frame dropped for its deadline
never reaches the tracker, so it leaves no hole in the memory.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import VidarError
from .sam2_model import has_hole_filling

# SAM2VideoPredictor passes the video length as `num_frames`; min(num_frames, 16) shapes the
# pointers' time encoding. A live stream has no length: any value >= max_obj_ptrs_in_encoder
# gives the same encoding as a reference video of that many frames or more.
NUM_FRAMES = 1 << 30


class PromptError(VidarError):
    """A prompt names an unknown stream, lies outside the frame, or is malformed."""


@dataclass
class Prompt:
    obj_id: int
    box: Optional[list[float]] = None          # [x0, y0, x1, y1] in pixels
    points: Optional[list[list[float]]] = None  # [[x, y, label], ...]; label 1 foreground, 0 background

    def check(self, width: int, height: int, where: str) -> None:
        coords = []
        if self.box is not None:
            if len(self.box) != 4 or not (self.box[0] < self.box[2] and self.box[1] < self.box[3]):
                raise PromptError(f"{where}: box {self.box} must be [x0, y0, x1, y1] with x0 < x1 and y0 < y1")
            coords += [(self.box[0], self.box[1]), (self.box[2], self.box[3])]
        for p in self.points or []:
            if len(p) != 3 or p[2] not in (0, 1):
                raise PromptError(f"{where}: point {p} must be [x, y, label] with label 1 (foreground) or 0")
            coords.append((p[0], p[1]))
        if not coords:
            raise PromptError(f"{where}: give a box or at least one point")
        for x, y in coords:
            if not (0 <= x <= width and 0 <= y <= height):
                raise PromptError(f"{where}: ({x}, {y}) lies outside the {width}x{height} frame")


@dataclass
class Memory:
    maskmem: Optional[torch.Tensor]  # (1, mem_dim, h, w) bfloat16, as the predictor stores it
    obj_ptr: torch.Tensor            # (1, C)


@dataclass
class ObjectBank:
    """What SAM 2 can still read for one object. Bounded by construction."""

    num_maskmem: int
    max_ptrs: int
    cond: dict[int, Memory] = field(default_factory=dict)  # the prompt frame (re-prompting restarts the bank)
    maskmems: deque = field(init=False)                    # (t, Memory) of the last num_maskmem - 1 frames
    ptrs: deque = field(init=False)                        # (t, obj_ptr) of the last max_ptrs - 1 frames

    def __post_init__(self) -> None:
        self.maskmems = deque(maxlen=self.num_maskmem - 1)
        self.ptrs = deque(maxlen=self.max_ptrs - 1)

    def push(self, t: int, mem: Memory) -> None:
        self.maskmems.append((t, mem))
        self.ptrs.append((t, mem.obj_ptr))

    def entries(self) -> int:
        return len(self.cond) + len(self.maskmems) + len(self.ptrs)

    def bound(self) -> int:
        return 1 + self.maskmems.maxlen + self.ptrs.maxlen


@dataclass
class StreamTrack:
    frame_idx: int = 0  # index of the next processed frame
    objects: dict[int, ObjectBank] = field(default_factory=dict)
    pending: dict[int, Prompt] = field(default_factory=dict)  # applied on the next processed frame
    size: Optional[tuple[int, int]] = None  # (height, width) of the stream's frames


@dataclass
class FrameFeatures:
    """The image encoder's output for one frame (batch of 1), flattened as SAM 2 uses it."""

    vision_feats: list[torch.Tensor]  # per level (HW, 1, C)
    vision_pos: list[torch.Tensor]
    feat_sizes: list[tuple[int, int]]


@dataclass
class _Due:
    stream: str
    obj_id: int
    bank: ObjectBank
    t: int
    feats: FrameFeatures
    prompt: Optional[Prompt] = None


class DecoderStage:
    """Memory attention + mask decoder + memory encoder for every due (stream, object) pair.

    One instance is shared by all streams. Thread-safe: prompts arrive from the control plane
    while `step` runs on the data plane.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        self._streams: dict[str, StreamTrack] = {}
        self._lock = threading.RLock()
        self._pos_enc: Optional[torch.Tensor] = None  # maskmem_pos_enc[-1]: the same for every frame
        self.calls: deque = deque(maxlen=10_000)  # batch size of each batched decoder call (tests, benchmarks)
        # seconds per batched call of each sub-stage, for benchmarks (bounded)
        self.stage_s: dict[str, deque] = {k: deque(maxlen=10_000)
                                          for k in ("memory_attention", "mask_decoder", "memory_encoder")}
        self.timed = False  # on a GPU, sync between sub-stages to time them (benchmarks only: it costs)
        self.rejected: list[tuple[str, int, str]] = []  # prompts found invalid when applied (reported as events)

    # -- control ----------------------------------------------------------------------------
    def add_stream(self, stream: str) -> None:
        with self._lock:
            self._streams.setdefault(stream, StreamTrack())

    def remove_stream(self, stream: str) -> None:
        with self._lock:
            self._streams.pop(stream, None)

    def reset_stream(self, stream: str) -> None:
        """Forget every object and prompt of a stream (its frame count goes on)."""
        with self._lock:
            st = self._track(stream)
            st.objects.clear()
            st.pending.clear()

    def _track(self, stream: str) -> StreamTrack:
        st = self._streams.get(stream)
        if st is None:
            raise PromptError(f"unknown stream {stream!r}; known: {sorted(self._streams)}")
        return st

    def add_object(self, stream: str, prompt: Prompt) -> None:
        """Track `prompt.obj_id` from the stream's next processed frame (an existing id restarts)."""
        with self._lock:
            st = self._track(stream)
            if st.size is not None:
                prompt.check(st.size[1], st.size[0], f"stream {stream!r} object {prompt.obj_id}")
            st.pending[prompt.obj_id] = prompt

    def remove_object(self, stream: str, obj_id: int) -> None:
        with self._lock:
            st = self._track(stream)
            if obj_id not in st.objects and obj_id not in st.pending:
                raise PromptError(f"stream {stream!r} has no object {obj_id}; objects: {sorted(st.objects)}")
            st.objects.pop(obj_id, None)
            st.pending.pop(obj_id, None)

    def list(self) -> dict[str, dict]:
        with self._lock:
            return {s: {"frame": st.frame_idx, "objects": sorted(st.objects), "pending": sorted(st.pending)}
                    for s, st in self._streams.items()}

    def bank_entries(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return {(s, o): b.entries() for s, st in self._streams.items() for o, b in st.objects.items()}

    # -- data plane -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, frames: list[tuple[str, FrameFeatures, tuple[int, int]]]) -> list[list[dict]]:
        """Track every object of each given frame. `frames`: (stream, features, (H, W)), at most
        one frame per stream per call, in stream order. Returns per frame a list of
        {id, logits (1, 1, h, w) low-res mask scores, score}, to be rendered by `render`."""
        with self._lock:
            due: list[_Due] = []
            for stream, feats, size in frames:
                st = self._track(stream)
                st.size = size
                for obj_id, prompt in list(st.pending.items()):
                    try:  # prompts given before the first frame are checked once its size is known
                        prompt.check(size[1], size[0], f"stream {stream!r} object {obj_id}")
                    except PromptError as err:
                        st.pending.pop(obj_id)
                        self.rejected.append((stream, obj_id, str(err)))
                for obj_id in set(st.objects) | set(st.pending):
                    prompt = st.pending.pop(obj_id, None)
                    if prompt is not None:
                        st.objects[obj_id] = ObjectBank(self.model.num_maskmem, self.model.max_obj_ptrs_in_encoder)
                    due.append(_Due(stream, obj_id, st.objects[obj_id], st.frame_idx, feats, prompt))
                st.frame_idx += 1
            results: dict[int, dict] = {}
            for i, d in enumerate(due):
                if d.prompt is not None:
                    results[i] = self._init_object(d)
            groups: dict[tuple[int, int], list[int]] = {}
            gathered = {}
            for i, d in enumerate(due):
                if d.prompt is None:
                    gathered[i] = self._gather(d.bank, d.t)
                    mem = gathered[i]
                    groups.setdefault((mem[0].shape[0], mem[2]), []).append(i)
            for idxs in groups.values():
                for i, r in zip(idxs, self._track_batch([due[i] for i in idxs], [gathered[i] for i in idxs])):
                    results[i] = r
            out: list[list[dict]] = [[] for _ in frames]
            order = {s: k for k, (s, _, _) in enumerate(frames)}
            for i, d in enumerate(due):
                out[order[d.stream]].append(dict(results[i], id=d.obj_id))
            for lst in out:
                lst.sort(key=lambda r: r["id"])
            return out

    def _init_object(self, d: _Due) -> dict:
        """A prompt frame: SAM on this frame alone, then its memory (as the predictor's preflight does)."""
        m = self.model
        h, w = self._streams[d.stream].size
        coords, labels = [], []
        if d.prompt.box is not None:
            coords += [d.prompt.box[:2], d.prompt.box[2:]]
            labels += [2, 3]
        for x, y, lab in d.prompt.points or []:
            coords.append([x, y])
            labels.append(int(lab))
        pts = torch.tensor(coords, dtype=torch.float32)[None] / torch.tensor([w, h]) * m.image_size
        point_inputs = {"point_coords": pts.to(self.device), "point_labels": torch.tensor([labels], dtype=torch.int32,
                                                                                            device=self.device)}
        f = d.feats
        out = m.track_step(frame_idx=d.t, is_init_cond_frame=True, current_vision_feats=f.vision_feats,
                           current_vision_pos_embeds=f.vision_pos, feat_sizes=f.feat_sizes, point_inputs=point_inputs,
                           mask_inputs=None, output_dict={"cond_frame_outputs": {}, "non_cond_frame_outputs": {}},
                           num_frames=NUM_FRAMES, run_mem_encoder=False)
        masks = self._fill_holes(out["pred_masks"])
        high = F.interpolate(masks, size=(m.image_size, m.image_size), mode="bilinear", align_corners=False)
        maskmem, pos = m._encode_new_memory(current_vision_feats=f.vision_feats, feat_sizes=f.feat_sizes,
                                            pred_masks_high_res=high, object_score_logits=out["object_score_logits"],
                                            is_mask_from_pts=True)
        self._remember_pos(pos)
        d.bank.cond = {d.t: Memory(maskmem.to(torch.bfloat16), out["obj_ptr"])}
        return {"logits": masks, "score": out["object_score_logits"]}

    def _fill_holes(self, masks: torch.Tensor) -> torch.Tensor:
        # Needs sam2's compiled CUDA extension; without it the predictor skips this step too (with a
        # warning per frame). We check once at start-up (sam2_model.has_hole_filling) and skip quietly.
        if self.model.fill_hole_area > 0 and has_hole_filling():
            from sam2.utils.misc import fill_holes_in_mask_scores
            return fill_holes_in_mask_scores(masks, self.model.fill_hole_area)
        return masks

    def _sync_time(self) -> float:
        # Per-stage timings need the GPU's queue drained; on the CPU this is just a clock read.
        if self.device.type == "cuda" and self.timed:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _remember_pos(self, pos: list[torch.Tensor]) -> None:
        if self._pos_enc is None:
            self._pos_enc = pos[-1][0:1].flatten(2).permute(2, 0, 1).clone()  # (HW, 1, mem_dim)

    def _gather(self, bank: ObjectBank, t: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One object's memory tokens, in SAM 2's order: cond frames, recent mask memories, pointers."""
        from sam2.modeling.sam2_utils import get_1d_sine_pe, select_closest_cond_frames
        m = self.model
        C, nm = m.hidden_dim, m.num_maskmem
        selected, unselected = select_closest_cond_frames(t, bank.cond, m.max_cond_frames_in_attn)
        recent = dict(bank.maskmems)
        prevs = [(0, mem) for mem in selected.values()]
        for t_pos in range(1, nm):
            prev = t - (nm - t_pos)
            prevs.append((t_pos, recent.get(prev, unselected.get(prev))))
        mems, poss = [], []
        for t_pos, mem in prevs:
            if mem is None:
                continue
            mems.append(mem.maskmem.to(self.device).float().flatten(2).permute(2, 0, 1))
            poss.append(self._pos_enc + m.maskmem_tpos_enc[nm - t_pos - 1])
        n_ptr_tokens = 0
        max_ptrs = min(NUM_FRAMES, m.max_obj_ptrs_in_encoder)
        pos_and_ptrs = [((t - ct) if m.use_signed_tpos_enc_to_obj_ptrs else abs(t - ct), mem.obj_ptr)
                        for ct, mem in selected.items() if ct <= t]
        ptrs = dict(bank.ptrs)
        for t_diff in range(1, max_ptrs):
            tt = t - t_diff
            if tt < 0:
                break
            p = ptrs.get(tt)
            if p is None and tt in unselected:
                p = unselected[tt].obj_ptr
            if p is not None:
                pos_and_ptrs.append((t_diff, p))
        if pos_and_ptrs:
            pos_list, ptr_list = zip(*pos_and_ptrs)
            obj_ptrs = torch.stack(ptr_list, dim=0)  # (n, 1, C)
            if m.add_tpos_enc_to_obj_ptrs:
                tpos_dim = C if m.proj_tpos_enc_in_obj_ptrs else m.mem_dim
                obj_pos = get_1d_sine_pe(torch.tensor(pos_list, device=self.device) / (max_ptrs - 1), dim=tpos_dim)
                obj_pos = m.obj_ptr_tpos_proj(obj_pos).unsqueeze(1).expand(-1, 1, m.mem_dim)
            else:
                obj_pos = obj_ptrs.new_zeros(len(pos_list), 1, m.mem_dim)
            if m.mem_dim < C:
                obj_ptrs = obj_ptrs.reshape(-1, 1, C // m.mem_dim, m.mem_dim).permute(0, 2, 1, 3).flatten(0, 1)
                obj_pos = obj_pos.repeat_interleave(C // m.mem_dim, dim=0)
            mems.append(obj_ptrs)
            poss.append(obj_pos)
            n_ptr_tokens = obj_ptrs.shape[0]
        return torch.cat(mems, dim=0), torch.cat(poss, dim=0), n_ptr_tokens

    def _track_batch(self, items: list[_Due], gathered: list) -> list[dict]:
        """(b) memory attention, (c) mask decoder, (d) memory encoder: one call each for the group."""
        m = self.model
        B = len(items)
        self.calls.append(B)
        feats = [d.feats for d in items]
        sizes = feats[0].feat_sizes
        curr = torch.cat([f.vision_feats[-1] for f in feats], dim=1)  # (HW, B, C)
        curr_pos = torch.cat([f.vision_pos[-1] for f in feats], dim=1)
        memory = torch.cat([g[0] for g in gathered], dim=1)
        memory_pos = torch.cat([g[1] for g in gathered], dim=1)
        H, W = sizes[-1]
        t0 = time.perf_counter()
        pix = m.memory_attention(curr=[curr], curr_pos=[curr_pos], memory=memory, memory_pos=memory_pos,
                                 num_obj_ptr_tokens=gathered[0][2])
        pix = pix.permute(1, 2, 0).view(B, m.hidden_dim, H, W)
        high_res = [torch.cat([f.vision_feats[lvl] for f in feats], dim=1).permute(1, 2, 0).view(B, -1, *sizes[lvl])
                    for lvl in range(len(sizes) - 1)]
        t1 = self._sync_time()
        _, _, _, low, high, obj_ptr, score = m._forward_sam_heads(
            backbone_features=pix, point_inputs=None, mask_inputs=None, high_res_features=high_res,
            multimask_output=m._use_multimask(False, None))
        t2 = self._sync_time()
        maskmem, pos = m._encode_new_memory(current_vision_feats=[curr], feat_sizes=sizes, pred_masks_high_res=high,
                                            object_score_logits=score, is_mask_from_pts=False)
        t3 = self._sync_time()
        self.stage_s["memory_attention"].append(t1 - t0)
        self.stage_s["mask_decoder"].append(t2 - t1)
        self.stage_s["memory_encoder"].append(t3 - t2)
        self._remember_pos(pos)
        maskmem = maskmem.to(torch.bfloat16)
        filled = self._fill_holes(low)
        out = []
        for i, d in enumerate(items):
            d.bank.push(d.t, Memory(maskmem[i:i + 1], obj_ptr[i:i + 1]))
            out.append({"logits": filled[i:i + 1], "score": score[i:i + 1]})
        return out


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


@torch.inference_mode()
def encode(model: torch.nn.Module, images: torch.Tensor) -> list[FrameFeatures]:
    """(a) the image encoder on a batch of frames (any streams); features split per frame."""
    out = model.forward_image(images)
    feats = []
    for i in range(images.shape[0]):
        one = {"backbone_fpn": [x[i:i + 1] for x in out["backbone_fpn"]],
               "vision_pos_enc": [x[i:i + 1] for x in out["vision_pos_enc"]]}
        _, vision_feats, vision_pos, sizes = model._prepare_backbone_features(one)
        feats.append(FrameFeatures(vision_feats, vision_pos, sizes))
    return feats
