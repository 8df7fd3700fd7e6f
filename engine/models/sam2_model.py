"""Building SAM 2 for streaming: config by name, official or local checkpoints loaded strictly, the
model's input contract.

The model is built exactly as `sam2.build_sam.build_sam2_video_predictor` builds it (same class,
same post-processing options), so vidar's masks can be compared with Meta's predictor. Only
the input size differs when asked (`image_size`), with the memory attention's feature sizes
following it (size / 16).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from importlib import resources
from pathlib import Path
from typing import Sequence

import torch

from engine.errors import ConfigError
from engine.models.preprocess import InputContract, Preprocessor
from engine.models.weights import hub_file, load_strict, read_state_dict

log = logging.getLogger("vidar.sam2")

KEY = "models.sam2"


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
        raise ConfigError(f"{KEY}.config: {name!r} is not a config of the installed sam2 package; "
                          f"available: {sorted(configs)}")
    return configs[key]


def size_overrides(image_size: int) -> list[str]:
    f = image_size // 16
    return [f"++model.image_size={image_size}",
            f"++model.memory_attention.layer.self_attention.feat_sizes=[{f},{f}]",
            f"++model.memory_attention.layer.cross_attention.feat_sizes=[{f},{f}]"]


@functools.lru_cache(maxsize=1)
def official_checkpoints() -> dict[str, tuple[str, str]]:
    """Config path (`configs/sam2.1/sam2.1_hiera_t.yaml`) -> (Hugging Face model id, checkpoint file name),
    from sam2's own table (`sam2.build_sam.HF_MODEL_ID_TO_FILENAMES`), so the two cannot drift apart."""
    from sam2.build_sam import HF_MODEL_ID_TO_FILENAMES

    return {cfg: (model_id, filename) for model_id, (cfg, filename) in HF_MODEL_ID_TO_FILENAMES.items()}


def pretrained_checkpoint(config: str) -> str:
    """The official checkpoint of a config: from the Hugging Face cache, or downloaded into it. Returns its path."""
    official = official_checkpoints()
    path = config_path(config)
    if path not in official:
        names = sorted(Path(c).stem for c in official)
        raise ConfigError(f"{KEY}.checkpoint: 'pretrained', but config {config!r} has no official checkpoint "
                          f"(official: {names}); set {KEY}.checkpoint to a local checkpoint file or to 'random'")
    repo_id, filename = official[path]
    return hub_file(repo_id, filename, f"{KEY}.checkpoint", what=f"the official checkpoint {repo_id}/{filename}",
                    local="checkpoint file ({'model': state_dict})")


def sam2_contract(image_size: int) -> InputContract:
    """SAM 2's video input, as its video predictor reads frames (sam2/utils/misc.py: `load_video_frames`,
    called with its defaults): a square bicubic PIL resize to image_size, `/ 255`, then the loader's
    default mean and std, read from its signature so they cannot drift apart."""
    from sam2.utils.misc import load_video_frames
    from torchvision.transforms import InterpolationMode, Resize

    params = inspect.signature(load_video_frames).parameters
    mean, std = tuple(params["img_mean"].default), tuple(params["img_std"].default)
    data_config = {"input_size": (3, image_size, image_size), "interpolation": "bicubic", "mean": mean, "std": std,
                   "crop_pct": 1.0, "crop_mode": "squash"}
    # v1 Resize on a PIL image is `img.resize((S, S), BICUBIC)`, the loader's call (bicubic is PIL's default)
    resize = Resize((image_size, image_size), interpolation=InterpolationMode.BICUBIC)
    return InputContract(data_config, (resize,))


def build_sam2_model(config: str, checkpoint: str, image_size: int, device: torch.device) -> tuple[torch.nn.Module, str]:
    """Returns (model, weights tag). `checkpoint`: 'pretrained' (the config's official checkpoint, from the
    Hugging Face cache or downloaded), 'random', or the path of a checkpoint in the official format."""
    from sam2.build_sam import build_sam2_video_predictor

    path = config_path(config)
    # the checkpoint first: no internet fails in a moment, before the model is built
    ckpt = pretrained_checkpoint(config) if checkpoint == "pretrained" else checkpoint
    model = build_sam2_video_predictor(path, ckpt_path=None, device="cpu",
                                       hydra_overrides_extra=size_overrides(image_size))
    if model.non_overlap_masks_for_mem_enc:  # it mixes objects along the batch: unsafe for batched decoding
        raise ConfigError(f"{KEY}.config: {config} sets non_overlap_masks_for_mem_enc, which vidar's "
                          "batched decoder cannot honour")
    if checkpoint == "random":
        log.warning("%s: %s runs on RANDOM weights: masks mean nothing; every result is marked "
                    "weights='random'", KEY, config)
        tag = "random"
    else:
        sd = read_state_dict(ckpt, f"{KEY}.checkpoint", wrapper="model")
        load_strict(model, sd, f"{KEY}.checkpoint", source=Path(ckpt).name, target="this config")
        tag = "pretrained" if checkpoint == "pretrained" else Path(ckpt).name
    return model.to(device).eval(), tag


def resized_model(main: torch.nn.Module, config: str, image_size: int) -> torch.nn.Module:
    """SAM 2 built for another input size, sharing `main`'s weights (the same tensors, no copy).

    The size lives outside the weights: the model's image_size, the prompt encoder's grid, the memory
    attention's RoPE tables (size / 16; a module recomputes them in place when the size changes, so
    sizes cannot share one module tree). Built on the CPU with throw-away random weights (~1-2 s for
    hiera-t), which `load_state_dict(assign=True)` replaces by main's tensors."""
    from sam2.build_sam import build_sam2_video_predictor

    model = build_sam2_video_predictor(config_path(config), ckpt_path=None, device="cpu",
                                       hydra_overrides_extra=size_overrides(image_size))
    model.load_state_dict(main.state_dict(), strict=True, assign=True)
    device = next(main.parameters()).device
    return model.to(device).eval()


def autocast(device: torch.device, dtype: torch.dtype, *, cache: bool = True) -> contextlib.AbstractContextManager:
    """SAM 2 under autocast at `dtype` (Meta runs its predictor under bf16 autocast on a GPU, weights in
    float32); float32: no autocast, every op as built. `cache=False` inside a CUDA graph: autocast's cache of
    cast weights is freed when the context exits, and a graph would replay reads of that freed memory
    (PyTorch's CUDA-graph notes say to capture autocast with cache_enabled=False)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


@functools.lru_cache(maxsize=8)
def _preprocessor(image_size: int, mode: str, device: torch.device) -> Preprocessor:
    return Preprocessor(sam2_contract(image_size), mode, device)


def preprocess(frames: Sequence[torch.Tensor], image_size: int, mode: str, device: torch.device) -> torch.Tensor:
    """(H, W, 3) uint8 RGB frames -> normalised (N, 3, S, S) float32, SAM 2's video input contract
    (for tests and benchmarks; the encoder worker keeps its own Preprocessor).

    exact: PIL resize (bicubic) then /255, as sam2's frame loader does, bit for bit.
    fast:  torchvision's uint8 antialiased bicubic resize (GPU when present); <= 1 level off PIL.
    """
    return _preprocessor(image_size, mode, device)(frames)
