"""SAM 2's memory attention for objects whose memory banks differ in length, in one batched call.

An object's memory is [its mask-memory frames, HW tokens each][its object-pointer tokens], and the number
of each differs between objects for the first frames after a prompt (up to `num_maskmem` frames and
`max_obj_ptrs_in_encoder` pointers), or when cond frames age differently. sam2's `MemoryAttention` takes one
memory length for the whole batch and its `RoPEAttention` has no key mask, so the tracking stage used to
split such a step into one call per length. Here the memories are padded to one layout (built by sam2_gather.py),

    [mask-memory frames, padded with whole zero frames to the longest][pointer tokens, padded to the most]

and a boolean key mask keeps each object's attention on its own tokens. The key rotation of RoPE repeats
one HW table per memory frame (`rope_k_repeat`), so frame j of every object gets the rotation it gets in
its own call as long as the padding is whole frames; the pointer block is excluded from RoPE as sam2 does
(`num_k_exclude_rope`). Padded keys are rotated or not arbitrarily, and masked. Every object has at least
its prompt frame's memory and pointer, so no row is all masked.

Why hand-written: sam2 (Meta's code, as rf-sam-2 ships it) has no mask argument; `memory_attention` and
`_rope_cross_attention` below follow `MemoryAttention.forward`, `MemoryAttentionLayer.forward` and
`RoPEAttention.forward` line by line with the mask added, reading the modules' own weights. The tests
compare them with sam2's modules on equal lengths (all-True mask: identical) and with one call per object on
different lengths (within 1e-4; ~1e-6 seen), so a change in sam2 that this copy misses shows up there.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def memory_attention(ma: torch.nn.Module, curr: torch.Tensor, curr_pos: torch.Tensor, memory: torch.Tensor,
                     memory_pos: torch.Tensor, num_obj_ptr_tokens: int, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """sam2's `MemoryAttention.forward(curr=[curr], ...)`, with `key_mask` (B, L) on the cross-attention.
    Without a mask it is sam2's own call."""
    if key_mask is None:
        return ma(curr=[curr], curr_pos=[curr_pos], memory=memory, memory_pos=memory_pos,
                  num_obj_ptr_tokens=num_obj_ptr_tokens)
    if not ma.batch_first or not all(getattr(layer.cross_attn_image, "rope_k_repeat", False) for layer in ma.layers):
        # what every SAM 2 / 2.1 config builds; another layout would need its own copy of sam2's forward
        raise NotImplementedError("masked memory attention expects batch_first layers with a RoPE cross-attention "
                                  "that repeats its key rotation per memory frame (rope_k_repeat)")
    output = curr
    if ma.pos_enc_at_input and curr_pos is not None:
        output = output + 0.1 * curr_pos
    if ma.batch_first:
        output, curr_pos = output.transpose(0, 1), curr_pos.transpose(0, 1)
        memory, memory_pos = memory.transpose(0, 1), memory_pos.transpose(0, 1)
    attn_mask = key_mask[:, None, None, :]  # (B, heads, queries, keys), broadcast
    for layer in ma.layers:
        output = layer._forward_sa(output, curr_pos)
        # MemoryAttentionLayer._forward_ca, the cross-attention masked
        tgt2 = layer.norm2(output)
        tgt2 = _rope_cross_attention(layer.cross_attn_image,
                                     q=tgt2 + curr_pos if layer.pos_enc_at_cross_attn_queries else tgt2,
                                     k=memory + memory_pos if layer.pos_enc_at_cross_attn_keys else memory,
                                     v=memory, num_k_exclude_rope=num_obj_ptr_tokens, attn_mask=attn_mask)
        output = output + layer.dropout2(tgt2)
        tgt2 = layer.norm3(output)
        tgt2 = layer.linear2(layer.dropout(layer.activation(layer.linear1(tgt2))))
        output = output + layer.dropout3(tgt2)
    normed = ma.norm(output)
    return normed.transpose(0, 1) if ma.batch_first else normed


def _rope_cross_attention(attn: torch.nn.Module, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          num_k_exclude_rope: int, attn_mask: torch.Tensor) -> torch.Tensor:
    """sam2's `RoPEAttention.forward` with an attention mask (eval: no dropout)."""
    from sam2.modeling.position_encoding import apply_rotary_enc

    q, k, v = attn.q_proj(q), attn.k_proj(k), attn.v_proj(v)
    q, k, v = (attn._separate_heads(x, attn.num_heads) for x in (q, k, v))
    w = h = math.sqrt(q.shape[-2])
    attn.freqs_cis = attn.freqs_cis.to(q.device)
    if attn.freqs_cis.shape[0] != q.shape[-2]:
        attn.freqs_cis = attn.compute_cis(end_x=w, end_y=h).to(q.device)
    num_k_rope = k.size(-2) - num_k_exclude_rope
    q, k[:, :, :num_k_rope] = apply_rotary_enc(q, k[:, :, :num_k_rope], freqs_cis=attn.freqs_cis,
                                               repeat_freqs_k=attn.rope_k_repeat)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return attn.out_proj(attn._recombine_heads(out))
