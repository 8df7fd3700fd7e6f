"""The memories of every object in a tracking step, gathered in a fixed number of tensor ops.

SAM 2 reads, per object, its prompt frame's mask memory, its last `num_maskmem - 1` mask memories and up
to `max_obj_ptrs_in_encoder` object pointers, each with a time encoding (sam2_base.py
`_prepare_memory_conditioned_features`). Doing that object by object, as Meta's predictor does, costs
about 30 small tensor ops per object per step (a convert, a flatten and a position add per memory frame,
a stack, a sine encoding and a projection for the pointers): hundreds of kernel launches a step for 16
objects, on a host whose launches are the bottleneck (on an H200 the eager decoder stage of 8 streams took
322.8 ms a step, ../shared/gpu/README.md). Here the choice of what to read stays per object and on the
host (`plan_memory`: no tensor op), and the tensors of all objects are built together (`gather`): one
concatenation of every memory frame, one of every pointer, one upload of the host-side numbers, one sine
encoding and projection, two index gathers into the padded layout of sam2_attention.py

    [mask-memory frames, padded with whole zero frames to the longest][pointer tokens, padded to the most]

and the key mask when the layouts differ. The values are those of the per-object path (the same
elementwise ops on the same inputs; the projection runs on all pointers at once); the tests compare
the two and the stage's masks with Meta's predictor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from engine.models.sam2_memory import Memory, ObjectBank


@dataclass(frozen=True)
class MemoryPlan:
    """What one object reads at frame t, chosen on the host: (time slot, memory) per mask-memory frame in
    SAM 2's order (prompt frames first, then the recent frames oldest first), and (time offset, pointer
    (1, C)) per object pointer."""

    frames: tuple[tuple[int, Memory], ...]
    ptrs: tuple[tuple[int, torch.Tensor], ...]


def plan_memory(model: torch.nn.Module, bank: ObjectBank, t: int, num_frames: int) -> MemoryPlan:
    """sam2's memory selection for one object (eval mode, stride 1), without touching a tensor.
    `num_frames`: the video length SAM 2's pointer encoding is given (see sam2_tracker.NUM_FRAMES)."""
    from sam2.modeling.sam2_utils import select_closest_cond_frames

    nm = model.num_maskmem
    selected, unselected = select_closest_cond_frames(t, bank.cond, model.max_cond_frames_in_attn)
    recent = dict(bank.maskmems)
    frames = [(0, mem) for mem in selected.values()]
    for t_pos in range(1, nm):
        prev = t - (nm - t_pos)
        mem = recent.get(prev, unselected.get(prev))
        if mem is not None:
            frames.append((t_pos, mem))
    max_ptrs = min(num_frames, model.max_obj_ptrs_in_encoder)
    ptrs = [((t - ct) if model.use_signed_tpos_enc_to_obj_ptrs else abs(t - ct), mem.obj_ptr)
            for ct, mem in selected.items() if ct <= t]
    kept = dict(bank.ptrs)
    for t_diff in range(1, max_ptrs):
        tt = t - t_diff
        if tt < 0:
            break
        p = kept.get(tt)
        if p is None and tt in unselected:
            p = unselected[tt].obj_ptr
        if p is not None:
            ptrs.append((t_diff, p))
    return MemoryPlan(tuple(frames), tuple(ptrs))


def gather(model: torch.nn.Module, plans: Sequence[MemoryPlan], pos_enc: torch.Tensor, num_frames: int,
           upload: Callable[[np.ndarray], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int, Optional[torch.Tensor]]:
    """(memory (L, B, C), positions (L, B, C), pointer tokens, key mask (B, L) True = attend, or None when
    every object has the same layout: then the tensors are sam2's own concatenation and no mask is needed).

    `pos_enc`: the mask memories' spatial position encoding (HW, 1, mem_dim) at this input size; `upload`:
    host int64 numbers -> a tensor on the device, without waiting (the stage's pinned copy)."""
    from sam2.modeling.sam2_utils import get_1d_sine_pe

    if not plans:
        raise ValueError("gather: no objects")
    if any(not p.frames for p in plans):  # every bank holds its prompt frame (sam2_memory.py)
        raise ValueError("gather: an object with no mask memory to read")
    nm, C, D = model.num_maskmem, model.hidden_dim, model.mem_dim
    hw = pos_enc.shape[0]
    split = C // D if D < C else 1  # a pointer of C channels is `split` tokens of mem_dim
    n_frames = [len(p.frames) for p in plans]
    n_ptrs = [len(p.ptrs) for p in plans]
    K, P, B = sum(n_frames), sum(n_ptrs), len(plans)
    f_max, p_max = max(n_frames), max(n_ptrs)

    # the host-side numbers of the whole step, one upload: each frame's time slot, each pointer's time
    # offset, and where each object's frames and pointer tokens sit in the padded layout (K and P*split:
    # the zero frame and the zero pointer token appended to the sources)
    slots = np.array([nm - t_pos - 1 for p in plans for t_pos, _ in p.frames], dtype=np.int64)
    offsets = np.array([dt for p in plans for dt, _ in p.ptrs], dtype=np.int64)
    frame_idx = np.full((B, f_max), K, dtype=np.int64)
    ptr_idx = np.full((B, p_max * split), P * split, dtype=np.int64)
    f0 = p0 = 0
    for b, (nf, npt) in enumerate(zip(n_frames, n_ptrs)):
        frame_idx[b, :nf] = np.arange(f0, f0 + nf)
        ptr_idx[b, :npt * split] = np.arange(p0 * split, (p0 + npt) * split)
        f0, p0 = f0 + nf, p0 + npt
    host = np.concatenate([slots, offsets, frame_idx.ravel(), ptr_idx.ravel()])
    dev = upload(host)
    cut = np.cumsum([K, P, frame_idx.size])
    slots_d, offsets_d = dev[:cut[0]], dev[cut[0]:cut[1]]
    frame_idx_d = dev[cut[1]:cut[2]].view(B, f_max)
    ptr_idx_d = dev[cut[2]:].view(B, p_max * split)

    # mask memories: (K, HW, D) tokens, the position encoding plus each frame's time slot
    mems = torch.cat([mem.maskmem for p in plans for _, mem in p.frames]).to(pos_enc.device)
    tokens = mems.float().flatten(2).permute(0, 2, 1)
    tpos = model.maskmem_tpos_enc.reshape(nm, 1, D)  # (nm, 1, 1, D) in sam2
    tok_pos = pos_enc.reshape(1, hw, D) + tpos.index_select(0, slots_d)
    zero_frame = tokens.new_zeros(1, hw, D)
    frames = torch.cat([tokens, zero_frame]).index_select(0, frame_idx_d.flatten()).view(B, f_max * hw, D)
    frames_pos = torch.cat([tok_pos, zero_frame]).index_select(0, frame_idx_d.flatten()).view(B, f_max * hw, D)

    # object pointers: (P * split, D) tokens and their time encodings
    if P:
        ptrs = torch.cat([ptr for p in plans for _, ptr in p.ptrs]).reshape(P, 1, C)
        if model.add_tpos_enc_to_obj_ptrs:
            max_ptrs = min(num_frames, model.max_obj_ptrs_in_encoder)
            tpos_dim = C if model.proj_tpos_enc_in_obj_ptrs else D
            ptr_pos = get_1d_sine_pe(offsets_d / (max_ptrs - 1), dim=tpos_dim)
            ptr_pos = model.obj_ptr_tpos_proj(ptr_pos).unsqueeze(1).expand(-1, 1, D)
        else:
            ptr_pos = ptrs.new_zeros(P, 1, D)
        if D < C:
            ptrs = ptrs.reshape(-1, 1, split, D).permute(0, 2, 1, 3).flatten(0, 1)
            ptr_pos = ptr_pos.repeat_interleave(split, dim=0)
        ptr_tokens, ptr_pos = ptrs.reshape(P * split, D), ptr_pos.reshape(P * split, D)
    else:
        ptr_tokens = ptr_pos = tokens.new_zeros(0, D)
    zero_ptr = ptr_tokens.new_zeros(1, D)
    pointers = torch.cat([ptr_tokens, zero_ptr]).index_select(0, ptr_idx_d.flatten()).view(B, p_max * split, D)
    pointers_pos = torch.cat([ptr_pos, zero_ptr]).index_select(0, ptr_idx_d.flatten()).view(B, p_max * split, D)

    memory = torch.cat([frames, pointers.to(frames.dtype)], dim=1).transpose(0, 1)  # (L, B, D)
    memory_pos = torch.cat([frames_pos, pointers_pos.to(frames_pos.dtype)], dim=1).transpose(0, 1)
    if len(set(n_frames)) == 1 and len(set(n_ptrs)) == 1:
        return memory, memory_pos, p_max * split, None
    mask = torch.cat([(frame_idx_d < K).repeat_interleave(hw, dim=1), ptr_idx_d < P * split], dim=1)
    return memory, memory_pos, p_max * split, mask
