"""The preprocessing contract a model carries, run in one of two modes.

A contract is the model's own eval pipeline split in two: geometric steps (resize, crop), written
for PIL images as the reference pipeline runs them, then `x / 255` and `(x - mean) / std`. Each
family derives its contract from the model (classify.py: timm's `resolve_data_config` +
`create_transform`; sam2_model.py: SAM 2's frame loader). `Preprocessor` runs it:
  * exact: the reference pipeline bit for bit: PIL for the geometry, the reference's float ops on
           the CPU (~6 ms a 720p frame on 2 cores), then one upload;
  * fast:  the same steps on uint8 tensors where the pixels are (torchvision v2's antialiased
           resize; the GPU when there is one), ~0.9 ms a 720p frame on the CPU; at most one
           intensity level off PIL on well under 1 % of pixels (logits within ~1e-3 relative, measured).
Geometry is per frame (frames differ in size); normalisation is one batched op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

MODES = ("fast", "exact")


@dataclass(frozen=True)
class InputContract:
    """What a model expects of its input.

    Attributes:
        data_config: timm's data config format: `input_size` (C, H, W), `interpolation`, `mean`, `std`, ...
        geometric: the geometric steps, PIL image in, PIL image out (torchvision v1 or timm transforms).
    """

    data_config: dict
    geometric: tuple[Callable[[Any], Any], ...]


def _tensor_step(t: Any) -> Any:
    """The same step with the same parameters, for uint8 tensors. torchvision v1 transforms (and timm's,
    which call v1 functions) resize uint8 tensors in float (~8 ms a 720p frame here, and off PIL on ~15 %
    of pixels) while v2 has a native uint8 antialiased kernel (~0.9 ms). timm's CenterCropOrPad fails on
    tensors with its per-channel fill (v1 `pad` takes one number). Crop-only steps work as they are."""
    from timm.data.transforms import CenterCropOrPad, ResizeKeepRatio
    from torchvision.transforms import CenterCrop, Resize, v2

    if type(t) is Resize:
        return v2.Resize(t.size, interpolation=t.interpolation, max_size=t.max_size, antialias=True)
    if type(t) is CenterCrop:
        return v2.CenterCrop(t.size)
    if type(t) is ResizeKeepRatio and not isinstance(t.interpolation, (tuple, list)):  # a list: train-time random
        return _KeepRatioResize(t)
    if type(t) is CenterCropOrPad:
        return _CenterCropOrPad(t)
    return t


class _KeepRatioResize:
    """timm's ResizeKeepRatio (crop_mode 'border', non-square inputs): its size rule, v2's uint8 resize."""

    def __init__(self, t: Any):
        self.t = t

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as F

        t = self.t
        size = t.get_params(img, t.size, t.longest, t.random_scale_prob, t.random_scale_range, t.random_scale_area,
                            t.random_aspect_prob, t.random_aspect_range)
        return F.resize(img, size, interpolation=t.interpolation, antialias=True)


class _CenterCropOrPad:
    """timm's CenterCropOrPad (its padding split, its fill) with v2's pad, which takes a per-channel fill."""

    def __init__(self, t: Any):
        self.size, self.padding_mode = list(t.size), t.padding_mode
        self.fill = list(t.fill) if isinstance(t.fill, (tuple, list)) else t.fill

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as F

        (h, w), (ch, cw) = img.shape[-2:], self.size
        dw, dh = max(cw - w, 0), max(ch - h, 0)
        if dw or dh:
            img = F.pad(img, [dw // 2, dh // 2, (dw + 1) // 2, (dh + 1) // 2], fill=self.fill,
                        padding_mode=self.padding_mode)
        return F.center_crop(img, self.size)


class Preprocessor:
    """(H, W, 3) uint8 RGB frames (ring slots) -> one normalised NCHW batch on `device`, in `dtype`.

    Example: `Preprocessor(contract, "fast", torch.device("cuda"), torch.bfloat16)(frames)`.
    """

    def __init__(self, contract: InputContract, mode: str, device: torch.device, dtype: torch.dtype = torch.float32):
        if mode not in MODES:
            raise ValueError(f"preprocess mode {mode!r}: use one of {MODES}")
        self.mode, self.device, self.dtype = mode, device, dtype
        self.data_config = contract.data_config
        self.geometric = list(contract.geometric)
        if mode == "fast":
            self.geometric = [_tensor_step(t) for t in self.geometric]
        # exact normalises on the CPU like the reference: CUDA divides by a scalar as a multiplication
        # by its reciprocal, which is not bit for bit a division.
        where = torch.device("cpu") if mode == "exact" else device
        self.mean = torch.tensor(contract.data_config["mean"], dtype=torch.float32, device=where).view(1, -1, 1, 1)
        self.std = torch.tensor(contract.data_config["std"], dtype=torch.float32, device=where).view(1, -1, 1, 1)

    def _geometry(self, img: Any) -> Any:
        for t in self.geometric:
            img = t(img)
        return img

    def __call__(self, frames: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.mode == "exact":
            from PIL import Image
            x = torch.stack([torch.from_numpy(np.array(self._geometry(Image.fromarray(f.numpy())))).permute(2, 0, 1)
                             for f in frames])
            return self.normalise(x).to(self.device, self.dtype)
        # Host slots are pageable (engine/frames/storage.py): on CUDA the copy is staged by the driver before
        # it returns, so the slot may be released at once (a GPU runner takes BatchPreprocessor's pinned staging
        # instead). Resizing runs where the pixels are.
        x = torch.stack([self._geometry(f.to(self.device, non_blocking=True).permute(2, 0, 1)) for f in frames])
        return self.normalise(x).to(self.dtype)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW -> float32, with the references' float ops in their order: /255, - mean, / std.

        One path serves both families: torchvision's ToTensor divides in float32 (timm), sam2's loader
        in float64 (numpy) and rounds to float32, and the two agree on all 256 uint8 values (tested).
        """
        return x.float().div(255).sub(self.mean).div(self.std)
