"""Building SAM 2 for streaming: config by name, strict checkpoints, the model's input contract.

The model is built exactly as `sam2.build_sam.build_sam2_video_predictor` builds it (same class,
same post-processing options), so vidar's masks can be compared with Meta's predictor. Only
the input size differs when asked (`image_size`), with the memory attention's feature sizes
following it (size / 16).
"""

from __future__ import annotations

import functools
import logging
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..errors import ConfigError, WeightsError

log = logging.getLogger("vidar.sam2")

# The predictor's own normalisation (sam2/utils/misc.py: load_video_frames).
IMG_MEAN = (0.485, 0.456, 0.406)
IMG_STD = (0.229, 0.224, 0.225)


@functools.lru_cache(maxsize=1)
def has_hole_filling() -> bool:
    """sam2's optional compiled extension (`sam2._C`) fills small holes in masks; pure-Python wheels lack it."""
    try:
        import sam2._C  # noqa: F401
        return True
    except ImportError:
        log.warning("sam2's compiled extension (sam2._C) is not installed: small holes in masks are not "
                    "filled (fill_hole_area), exactly as Meta's predictor does without it")
        return False


def available_configs() -> dict[str, str]:
    """Config names shipped in the sam2 package -> their path for hydra (`configs/sam2.1/x.yaml`)."""
    root = resources.files("sam2") / "configs"
    out = {}
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        for f in sorted(sub.iterdir()):
            if f.name.endswith(".yaml"):
                out[f.name[:-5]] = f"configs/{sub.name}/{f.name}"
    return out


def config_path(name: str) -> str:
    configs = available_configs()
    key = Path(name).name.removesuffix(".yaml")
    if key not in configs:
        raise ConfigError(f"models.sam2.config: {name!r} is not a config of the installed sam2 package; "
                          f"available: {sorted(configs)}")
    return configs[key]


def size_overrides(image_size: int) -> list[str]:
    f = image_size // 16
    return [f"++model.image_size={image_size}",
            f"++model.memory_attention.layer.self_attention.feat_sizes=[{f},{f}]",
            f"++model.memory_attention.layer.cross_attention.feat_sizes=[{f},{f}]"]


def load_checkpoint_strict(model: torch.nn.Module, path: str) -> None:
    """The official format, {"model": state_dict}; missing or unexpected keys fail at start-up."""
    p = Path(path)
    if not p.is_file():
        raise WeightsError(f"models.sam2.checkpoint: file {path!r} not found "
                           "(download the official checkpoint, or use 'random')")
    try:
        ckpt = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types; the message names the file
        raise WeightsError(f"models.sam2.checkpoint: cannot read {path!r}: {err}") from err
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        raise WeightsError(f"models.sam2.checkpoint: {p.name} is not in the official format {{'model': state_dict}}")
    missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
    if missing or unexpected:
        raise WeightsError(f"models.sam2.checkpoint: {p.name} does not fit this config: "
                           f"missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                           f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")


def build_sam2_model(config: str, checkpoint: str, image_size: int, device: torch.device) -> tuple[torch.nn.Module, str]:
    """Returns (model, weights tag). `checkpoint` is a path or 'random'."""
    from sam2.build_sam import build_sam2_video_predictor

    model = build_sam2_video_predictor(config_path(config), ckpt_path=None, device="cpu",
                                       hydra_overrides_extra=size_overrides(image_size))
    if checkpoint == "random":
        log.warning("models.sam2: %s runs on RANDOM weights: masks mean nothing; every result is marked "
                    "weights='random'", config)
        tag = "random"
    else:
        load_checkpoint_strict(model, checkpoint)
        tag = Path(checkpoint).name
    if model.non_overlap_masks_for_mem_enc:  # it mixes objects along the batch: unsafe for batched decoding
        raise ConfigError(f"models.sam2.config: {config} sets non_overlap_masks_for_mem_enc, which vidar's "
                          "batched decoder cannot honour")
    return model.to(device).eval(), tag


def preprocess(frames: Sequence[torch.Tensor], image_size: int, mode: str, device: torch.device) -> torch.Tensor:
    """(H, W, 3) uint8 RGB frames -> normalised (N, 3, S, S) float32, SAM 2's video input contract.

    exact: PIL resize (bicubic) then /255 in float64, as sam2's JPEG loader does, bit for bit.
    fast:  torchvision's uint8 antialiased bicubic resize (GPU when present); <= 1 level off PIL.
    """
    mean = torch.tensor(IMG_MEAN, dtype=torch.float32, device=device)[:, None, None]
    std = torch.tensor(IMG_STD, dtype=torch.float32, device=device)[:, None, None]
    if mode == "exact":
        from PIL import Image
        out = torch.empty(len(frames), 3, image_size, image_size, dtype=torch.float32)
        for i, f in enumerate(frames):
            arr = np.array(Image.fromarray(f.numpy()).resize((image_size, image_size))) / 255.0
            out[i] = torch.from_numpy(arr).permute(2, 0, 1)
        x = out.to(device)
    else:
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2 import functional as F
        x = torch.stack([F.resize(f.to(device, non_blocking=True).permute(2, 0, 1), [image_size, image_size],
                                  interpolation=InterpolationMode.BICUBIC, antialias=True) for f in frames])
        x = x.float() / 255.0
    x -= mean
    x /= std
    return x
