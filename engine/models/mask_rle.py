"""Binary masks -> COCO RLE and bounding boxes, with the pixels left where they are (GPU or CPU).

COCO's RLE (what vidar publishes, `pycocotools.mask`) is the run lengths of the mask read in column-major
order, starting with a run of zeros. pycocotools computes them from a host array, so on a GPU every mask
would first cross to the host whole: 0.9 MB per object per 720p frame, on the tracking stage's thread,
which a pageable copy also makes wait for the GPU. Here the run boundaries are found with torch ops on
the mask's own device (`!=` of neighbours, `nonzero`) and only they cross (a few hundred integers for a
blob: two per column it spans), with the bounding boxes' row and column flags. pycocotools still writes
the string (`frPyObjects` on the uncompressed counts), so the format is its own, not ours.

The same torch ops run on CPU tensors: `tests/models/test_mask_rle.py` holds them equal to
`pycocotools.mask.encode` on the same masks.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

__all__ = ["encode_masks"]


def encode_masks(binary: torch.Tensor) -> tuple[list[dict], list[Optional[list[int]]]]:
    """binary: bool (N, H, W) on any device. Returns per mask its COCO RLE ({"size": [H, W], "counts": str})
    and its bbox [x0, y0, x1, y1] (exclusive ends; None for an empty mask)."""
    from pycocotools import mask as mask_utils

    if binary.dim() != 3 or binary.dtype != torch.bool:
        raise ValueError(f"encode_masks: expected a bool tensor (N, H, W), got {binary.dtype} {tuple(binary.shape)}")
    n, h, w = binary.shape
    if n == 0:
        return [], []
    flat = binary.transpose(1, 2).reshape(n, h * w)  # column-major, as COCO's RLE reads a mask
    # (mask k, p): pixel p + 1 differs from pixel p. One sync (nonzero's size), then a copy of the boundaries.
    change = (flat[:, 1:] != flat[:, :-1]).nonzero()
    # One copy for the small per-mask flags: the first pixel's value, which rows and which columns are set.
    flags = torch.cat([flat[:, :1], binary.any(dim=2), binary.any(dim=1)], dim=1).cpu().numpy()
    change = change.cpu().numpy()
    per_mask = np.searchsorted(change[:, 0], np.arange(n + 1))  # rows of `change` are ordered by mask
    rles, boxes = [], []
    for k in range(n):
        ends = change[per_mask[k]:per_mask[k + 1], 1].astype(np.int64) + 1  # where each run but the last ends
        bounds = np.concatenate([[0], ends, [h * w]])
        counts = np.diff(bounds)
        if flags[k, 0]:  # COCO's counts start with zeros: a mask that starts set begins with a run of 0
            counts = np.concatenate([[0], counts])
        rle = mask_utils.frPyObjects({"size": [h, w], "counts": counts.tolist()}, h, w)
        rles.append({"size": [h, w], "counts": rle["counts"].decode()})
        ys, xs = np.flatnonzero(flags[k, 1:1 + h]), np.flatnonzero(flags[k, 1 + h:])
        boxes.append([int(xs[0]), int(ys[0]), int(xs[-1]) + 1, int(ys[-1]) + 1] if xs.size else None)
    return rles, boxes
