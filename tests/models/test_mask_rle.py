"""encode_masks (run boundaries found with torch ops, on the GPU in production) equals pycocotools' own
encoder, string for string, on CPU tensors: the same ops the GPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils

from engine.models.mask_rle import encode_masks

pytestmark = pytest.mark.timeout(60)


def _reference(masks: np.ndarray) -> tuple[list[dict], list]:
    rles = mask_utils.encode(np.asfortranarray(masks.transpose(1, 2, 0).astype(np.uint8)))
    boxes = []
    for m in masks:
        ys, xs = np.nonzero(m)
        boxes.append([int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1] if xs.size else None)
    return [{"size": list(r["size"]), "counts": r["counts"].decode()} for r in rles], boxes


def _blob(h: int, w: int, cy: float, cx: float, r: float) -> np.ndarray:
    yy, xx = np.mgrid[:h, :w]
    return (yy - cy) ** 2 + (xx - cx) ** 2 < r * r


def _cases() -> list[np.ndarray]:
    h, w = 45, 64
    rng = np.random.default_rng(0)
    empty, full = np.zeros((h, w), bool), np.ones((h, w), bool)
    corner = np.zeros((h, w), bool)
    corner[0, 0] = True  # the first pixel set: COCO's counts then start with a run of 0
    last = np.zeros((h, w), bool)
    last[-1, -1] = True  # the last pixel set: the final run ends at H * W
    column = np.zeros((h, w), bool)
    column[:, 7] = True  # one whole column: a single run in column-major order
    return [empty, full, corner, last, column, _blob(h, w, 20, 30, 12), _blob(h, w, 0, 0, 9),
            rng.random((h, w)) < 0.5, rng.random((h, w)) < 0.02]


def test_equal_to_pycocotools_on_every_kind_of_mask():
    masks = np.stack(_cases())
    rles, boxes = encode_masks(torch.from_numpy(masks))
    ref_rles, ref_boxes = _reference(masks)
    assert rles == ref_rles
    assert boxes == ref_boxes
    for rle, m in zip(rles, masks):  # and the string decodes back to the mask
        assert np.array_equal(mask_utils.decode(rle).astype(bool), m)


@pytest.mark.parametrize("k", range(9))
def test_each_mask_alone_as_in_a_batch(k):
    """A mask's result does not depend on the masks beside it (the boundaries are split per mask)."""
    masks = np.stack(_cases())
    alone = encode_masks(torch.from_numpy(masks[k:k + 1]))
    batch = encode_masks(torch.from_numpy(masks))
    assert alone[0][0] == batch[0][k] and alone[1][0] == batch[1][k]


def test_a_720p_frame_of_objects_and_a_non_contiguous_view():
    h, w = 720, 1280
    masks = np.stack([_blob(h, w, 300, 500, 200), _blob(h, w, 700, 1270, 90), np.zeros((h, w), bool)])
    t = torch.from_numpy(masks.transpose(0, 2, 1).copy()).transpose(1, 2)  # same values, not contiguous
    assert encode_masks(t) == _reference(masks)


def test_no_masks_and_bad_input():
    assert encode_masks(torch.zeros(0, 4, 4, dtype=torch.bool)) == ([], [])
    with pytest.raises(ValueError, match="bool tensor"):
        encode_masks(torch.zeros(1, 4, 4))


def _objects(shapes: list[tuple[int, int]], seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (h, w) in enumerate(shapes):
        logits = torch.randn(1, 1, h, w, generator=g) * 4 + torch.linspace(-6, 6, w)  # a mask with an edge
        out.append({"id": i + 1, "logits": logits, "score": torch.randn(1, 1, generator=g)})
    out.append({"id": 99, "logits": torch.full((1, 1, *shapes[0]), -5.0), "score": torch.zeros(1, 1)})  # empty
    return out


@pytest.mark.parametrize("device_rle", [False, True], ids=["pycocotools", "torch-ops"])
@pytest.mark.parametrize("shapes", [[(64, 64), (64, 64)], [(64, 64), (32, 32)]], ids=["one-size", "two-sizes"])
def test_render_frame_equals_render_per_object(monkeypatch, device_rle, shapes):
    """The published objects are the same whichever encoder runs (the CPU's pycocotools, or the torch ops a
    GPU runs), and the same as rendering each object alone."""
    from engine.models import sam2_tracker

    monkeypatch.setattr(sam2_tracker, "RLE_ON_DEVICE", device_rle)
    objs = _objects(shapes)
    got = sam2_tracker.render_frame(objs, 90, 160)
    assert got == [sam2_tracker.render(o, 90, 160) for o in objs]
    assert got[-1]["bbox"] is None and got[0]["bbox"] is not None
