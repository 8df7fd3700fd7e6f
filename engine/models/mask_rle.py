"""Binary masks -> COCO RLE and bounding boxes, with the pixels left where they are (GPU or CPU).

COCO's RLE (what vidar publishes, `pycocotools.mask`) is the run lengths of the mask read in column-major
order, starting with a run of zeros. pycocotools computes them from a host array, so on a GPU every mask
would first cross to the host whole: 0.9 MB per object per 720p frame, on the tracking stage's thread.
Here the run boundaries are found with torch ops on the mask's own device (`!=` of neighbours, `nonzero`)
and only they cross, 4 bytes each (a blob has two per column it spans: ~3 KB for a 400-column blob), with
H + W + 1 flag bytes per mask for the first pixel and the bounding box. The host waits for the GPU twice
per frame: `nonzero` must know its size, then one transfer brings the flags, the boundaries and whatever
the caller carries along (`carry`: the tracker's scores) to the host together (`to_host`), where a
`.cpu()` each would sync once per tensor. pycocotools still writes the string (`frPyObjects` on the uncompressed
counts), so the format is its own, not ours.

The same torch ops run on CPU tensors: `tests/models/test_mask_rle.py` holds them equal to
`pycocotools.mask.encode` on the same masks. On the CPU pycocotools' own C encoder is faster
(`encode_masks_host`, what render_frame runs there).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["encode_masks", "encode_masks_host", "to_host"]


def to_host(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Tensors of any dtypes, on one device, as host arrays through ONE transfer (on a GPU one sync, where a
    `.cpu()` each is one each): their bytes back to back in one uint8 tensor, split on the host. Widest
    dtypes first, so every part starts aligned to its own item size."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    flat = [tensors[i].contiguous().reshape(-1) for i in order]
    packed = torch.cat([t.view(torch.uint8) for t in flat]).cpu().numpy()
    out: list = [None] * len(tensors)
    offset = 0
    for i, t in zip(order, flat):
        n = t.numel() * t.element_size()
        dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
        out[i] = packed[offset:offset + n].view(dtype).reshape(tuple(tensors[i].shape))
        offset += n
    return out


def encode_masks(binary: torch.Tensor, carry: Sequence[torch.Tensor] = ()
                 ) -> tuple[list[dict], list[Optional[list[int]]]] | tuple[list[dict], list, list[np.ndarray]]:
    """binary: bool (N, H, W) on any device. Returns per mask its COCO RLE ({"size": [H, W], "counts": str})
    and its bbox [x0, y0, x1, y1] (exclusive ends; None for an empty mask). `carry`: tensors on the same
    device brought to the host in the same transfer, returned third as numpy arrays (only when given)."""
    from pycocotools import mask as mask_utils

    if binary.dim() != 3 or binary.dtype != torch.bool:
        raise ValueError(f"encode_masks: expected a bool tensor (N, H, W), got {binary.dtype} {tuple(binary.shape)}")
    n, h, w = binary.shape
    if n == 0:
        return ([], [], to_host(carry)) if carry else ([], [])
    flat = binary.transpose(1, 2).reshape(n, h * w)  # column-major, as COCO's RLE reads a mask
    # Per mask: its first pixel, which rows and which columns are set. Queued before `nonzero`, whose wait for
    # its size then covers them: the copies after it wait for nothing new.
    flags = torch.cat([flat[:, :1], binary.any(dim=2), binary.any(dim=1)], dim=1)
    # i = k * (H*W - 1) + p: pixel p + 1 of mask k differs from pixel p. One flat index (int32 when it fits)
    # is half the bytes of nonzero's (k, p) pairs.
    step = h * w - 1
    change = (flat[:, 1:] != flat[:, :-1]).reshape(-1).nonzero().squeeze(1)
    if n * step < 2 ** 31:
        change = change.to(torch.int32)
    # one transfer for all (nonzero's sync above already waited for the kernels they need)
    flags, change, *carried = to_host([flags, change, *carry])
    change = change.astype(np.int64)
    mask_of, pos = np.divmod(change, max(step, 1))
    per_mask = np.searchsorted(mask_of, np.arange(n + 1))  # nonzero's indices are ascending: mask by mask
    rles, boxes = [], []
    for k in range(n):
        ends = pos[per_mask[k]:per_mask[k + 1]] + 1  # where each run but the last ends
        bounds = np.concatenate([[0], ends, [h * w]])
        counts = np.diff(bounds)
        if flags[k, 0]:  # COCO's counts start with zeros: a mask that starts set begins with a run of 0
            counts = np.concatenate([[0], counts])
        rle = mask_utils.frPyObjects({"size": [h, w], "counts": counts.tolist()}, h, w)
        rles.append({"size": [h, w], "counts": rle["counts"].decode()})
        boxes.append(_bbox(flags[k, 1:1 + h], flags[k, 1 + h:]))
    return (rles, boxes, carried) if carry else (rles, boxes)


def encode_masks_host(binary: torch.Tensor) -> tuple[list[dict], list[Optional[list[int]]]]:
    """`encode_masks` by pycocotools on the whole masks, copied to the host first if they are not there."""
    from pycocotools import mask as mask_utils

    n, h, w = binary.shape
    masks = binary.cpu().numpy()  # (N, H, W) bool
    rles = [{"size": [h, w], "counts": r["counts"].decode()}
            for r in mask_utils.encode(np.asfortranarray(masks.transpose(1, 2, 0).astype(np.uint8)))]
    rows, cols = masks.any(axis=2), masks.any(axis=1)  # (N, H), (N, W)
    return rles, [_bbox(rows[k], cols[k]) for k in range(n)]


def _bbox(rows: np.ndarray, cols: np.ndarray) -> Optional[list[int]]:
    """[x0, y0, x1, y1] (exclusive ends) from which rows and which columns are set; None when none is."""
    ys, xs = np.flatnonzero(rows), np.flatnonzero(cols)
    return [int(xs[0]), int(ys[0]), int(xs[-1]) + 1, int(ys[-1]) + 1] if xs.size else None
