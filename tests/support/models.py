"""Classification models in tests: timm's tiny ViT with seeded random weights, timm's own pipeline as the
reference, frames handed to a runner, and the relative error the fidelity checks use."""

from __future__ import annotations

import numpy as np
import timm
import torch
from PIL import Image

from engine.frames.ref import LooseFrames

MODEL = "test_vit"  # timm's registered tiny ViT: the real architecture, 160 px, fast on a CPU


def seeded_model(name=MODEL, seed=0):
    torch.manual_seed(seed)
    return timm.create_model(name, pretrained=False).eval()


def views(frames):
    return LooseFrames([torch.from_numpy(np.ascontiguousarray(f)) for f in frames]).refs()


def timm_reference(model, frames):
    """timm's own resolve_data_config + create_transform + model, one PIL image at a time."""
    cfg = timm.data.resolve_data_config(model=model)
    tf = timm.data.create_transform(**cfg)
    with torch.inference_mode():
        return torch.cat([model(tf(Image.fromarray(f)).unsqueeze(0)) for f in frames])


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())
