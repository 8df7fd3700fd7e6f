"""SAM 2 tracking-stage tests: the padded memory layout of engine/models/sam2_attention.py built object by
object (the plain reference engine/models/sam2_gather.py's one-pass gather is compared with, and the input of
the attention tests), and the model and random frame features those tests step on.

`gather_one` repeats the memory selection of sam2_gather.plan_memory on purpose: it is the per-object gather
as the stage ran it before (Meta's order, op by op), kept as an independent reference."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.testing.sam2_ref import CONFIG, SIZE, make_checkpoint

#: one object's gathered memory: (tokens (L, 1, C), positions (L, 1, C), pointer tokens at the end of L)
Gathered = tuple[torch.Tensor, torch.Tensor, int]


def same_layout(gathered: Sequence[Gathered]) -> bool:
    """Every object has as many mask-memory and pointer tokens as the first: sam2's own call batches them."""
    first = gathered[0]
    return all(g[0].shape[0] == first[0].shape[0] and g[2] == first[2] for g in gathered)


def pad_memories(gathered: Sequence[Gathered], hw: int) -> tuple[torch.Tensor, torch.Tensor, int, Optional[torch.Tensor]]:
    """(memory (L, B, C), positions (L, B, C), pointer tokens, key mask (B, L) True = attend, or None).

    Objects of one layout are concatenated as they are (no mask: sam2's own path, bit for bit).
    """
    if same_layout(gathered):
        return (torch.cat([g[0] for g in gathered], dim=1), torch.cat([g[1] for g in gathered], dim=1),
                gathered[0][2], None)
    frames = []
    for mem, _, n_ptr in gathered:
        n_mem = mem.shape[0] - n_ptr
        if n_mem % hw:
            raise ValueError(f"a memory of {n_mem} mask-memory tokens is not whole frames of {hw} tokens")
        frames.append(n_mem // hw)
    f_max, p_max = max(frames), max(g[2] for g in gathered)
    first = gathered[0][0]
    length, batch, channels = f_max * hw + p_max, len(gathered), first.shape[-1]
    memory = first.new_zeros(length, batch, channels)
    pos = gathered[0][1].new_zeros(length, batch, channels)
    mask = torch.zeros(batch, length, dtype=torch.bool, device=first.device)
    ptr0 = f_max * hw  # where the pointer block starts
    for b, ((mem, mpos, n_ptr), nf) in enumerate(zip(gathered, frames)):
        n_mem = nf * hw
        memory[:n_mem, b], pos[:n_mem, b] = mem[:n_mem, 0], mpos[:n_mem, 0]
        memory[ptr0:ptr0 + n_ptr, b], pos[ptr0:ptr0 + n_ptr, b] = mem[n_mem:, 0], mpos[n_mem:, 0]
        mask[b, :n_mem] = True
        mask[b, ptr0:ptr0 + n_ptr] = True
    return memory, pos, p_max, mask


def gather_one(stage, bank, t: int) -> Gathered:
    """One object's memory tokens, in SAM 2's order: cond frames, recent mask memories, pointers; the
    tracking stage's per-object gather as it was before sam2_gather.py, op by op (Meta's order)."""
    from sam2.modeling.sam2_utils import get_1d_sine_pe, select_closest_cond_frames

    from engine.models.sam2_tracker import NUM_FRAMES
    m = stage._model(bank.image_size)
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
        mems.append(mem.maskmem.to(stage.device).float().flatten(2).permute(2, 0, 1))
        poss.append(stage._pos_enc[bank.image_size] + m.maskmem_tpos_enc[nm - t_pos - 1])
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
            obj_pos = get_1d_sine_pe(torch.tensor(pos_list).to(stage.device) / (max_ptrs - 1), dim=tpos_dim)
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


def biased_model(workdir):
    """hiera-t at 256 px on the CPU with the random biased checkpoint (engine/testing/sam2_ref.py)."""
    from engine.models.sam2_model import build_sam2_model
    return build_sam2_model(CONFIG, str(make_checkpoint(workdir / "biased.pt")), SIZE, torch.device("cpu"))[0]


def random_features(model, n: int, seed: int) -> list:
    """The encoder's features of n random frames (values in [-1, 1], as the normalised input)."""
    from engine.models.sam2_tracker import encode
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        return [encode(model, torch.rand(1, 3, SIZE, SIZE, generator=g) * 2 - 1)[0] for _ in range(n)]
