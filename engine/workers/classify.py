"""Image classification worker for any timm classifier (ViT by default).

The preprocessing contract (input size, interpolation, crop, mean, std) comes from the model's
own pretrained config through timm (`resolve_data_config` + `create_transform`). We take the
geometric steps of timm's eval transform as they are and run them either:
  * exact: on PIL images, i.e. timm's own pipeline bit for bit (~6 ms a 720p frame on 2 cores);
  * fast:  on uint8 tensors (torchvision's antialiased resize; on the GPU when there is one),
           ~0.9 ms a 720p frame on the CPU; differs from PIL by at most one intensity level on
           well under 1 % of pixels (logits within ~1e-3 relative, measured).
Normalisation is batched on tensors with the same float ops as timm's ToTensor + Normalize.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..config import ClassifyConfig
from ..errors import ConfigError, WeightsError
from .base import Worker, time_batches
from .registry import PoolSpec

log = logging.getLogger("vidar.vit")

_TENSOR_STEPS = ("ToTensor", "MaybeToTensor", "Normalize", "MaybePILToTensor")


def resolve_device(device: str) -> torch.device:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("models.vit.device: 'cuda' asked for but no CUDA GPU is available; use 'auto' or 'cpu'")
        return torch.device("cuda")
    return torch.device("cpu")


def _load_state_dict(path: Path) -> dict:
    if not path.is_file():
        raise WeightsError(f"models.vit.weights: file {str(path)!r} not found (use 'pretrained', 'random' or a path)")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            sd = load_file(str(path))
        else:
            sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # the loaders raise many types; the message names the file
        raise WeightsError(f"models.vit.weights: cannot read {str(path)!r}: {err}") from err
    for key in ("state_dict", "model"):  # common checkpoint wrappers
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        raise WeightsError(f"models.vit.weights: {str(path)!r} does not hold a state_dict")
    return sd


def build_classifier(name: str, weights: str) -> tuple[torch.nn.Module, str]:
    """Create the timm model and load its weights. Returns (model, weights tag)."""
    import timm

    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:8]
        raise ConfigError(f"models.vit.name: {name!r} is not a timm model; close names: {close}")
    if weights == "random":
        log.warning("models.vit: %s runs on RANDOM weights: its labels mean nothing; "
                    "every result is marked weights='random'", name)
        return timm.create_model(name, pretrained=False), "random"
    if weights == "pretrained":
        try:
            return timm.create_model(name, pretrained=True), "pretrained"
        except Exception as err:  # hub/network errors come in many types
            raise WeightsError(
                f"models.vit.weights: could not download pretrained weights for {name!r} ({type(err).__name__}: "
                f"{str(err)[:200]}). Without internet, set models.vit.weights to a local state_dict file "
                "or to 'random'") from err
    path = Path(weights)
    sd = _load_state_dict(path)
    probe = timm.create_model(name, pretrained=False)
    head = probe.pretrained_cfg.get("classifier", "head")
    head_w = sd.get(f"{head}.weight")
    kwargs = {"num_classes": int(head_w.shape[0])} if head_w is not None else {}
    model = timm.create_model(name, pretrained=False, **kwargs) if kwargs else probe
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise WeightsError(f"models.vit.weights: {path.name} does not fit {name}: "
                           f"missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                           f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    return model, path.name


def class_labels(model: torch.nn.Module) -> list[str]:
    """Human-readable labels; ImageNet ones ship with timm (offline)."""
    from timm.data import ImageNetInfo, infer_imagenet_subset

    n = model.num_classes
    subset = infer_imagenet_subset(model)
    if subset:
        info = ImageNetInfo(subset)
        if info.num_classes() == n:
            return [info.index_to_description(i) for i in range(n)]
    return [f"class_{i}" for i in range(n)]


def _tensor_step(t: Any) -> Any:
    """timm builds torchvision v1 transforms; on uint8 tensors v1 resizes bicubic in float (~8 ms
    a 720p frame here) while v2 has a native uint8 kernel (~0.9 ms). Same parameters, v2 class."""
    from torchvision.transforms import CenterCrop, Resize, v2

    if type(t) is Resize:
        return v2.Resize(t.size, interpolation=t.interpolation, max_size=t.max_size, antialias=True)
    if type(t) is CenterCrop:
        return v2.CenterCrop(t.size)
    return t  # timm's own steps (ResizeKeepRatio, CenterCropOrPad) work on tensors as they are


class Preprocessor:
    """The model's eval transform, split into geometric steps (per frame) and normalisation (batched)."""

    def __init__(self, model: torch.nn.Module, mode: str, device: torch.device, dtype: torch.dtype):
        from timm.data import create_transform, resolve_data_config

        self.data_config = resolve_data_config(model=model)
        full = create_transform(**self.data_config, is_training=False)
        self.geometric = [t for t in full.transforms if type(t).__name__ not in _TENSOR_STEPS]
        if mode == "fast":
            self.geometric = [_tensor_step(t) for t in self.geometric]
        self.mode, self.device, self.dtype = mode, device, dtype
        self.mean = torch.tensor(self.data_config["mean"], device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(self.data_config["std"], device=device).view(1, -1, 1, 1)

    def _geometry(self, img: Any) -> Any:
        for t in self.geometric:
            img = t(img)
        return img

    def __call__(self, frames: Sequence[torch.Tensor]) -> torch.Tensor:
        """frames: (H, W, 3) uint8 RGB tensors (ring slots). Returns a normalised NCHW batch."""
        if self.mode == "exact":
            from PIL import Image
            crops = [torch.from_numpy(np.array(self._geometry(Image.fromarray(f.numpy())))).permute(2, 0, 1)
                     for f in frames]
            x = torch.stack(crops).to(self.device)
        else:
            # On CUDA the slot is pinned, so the upload is an async DMA; the caller syncs before
            # releasing the slot. Resizing runs where the pixels are.
            crops = [self._geometry(f.to(self.device, non_blocking=True).permute(2, 0, 1)) for f in frames]
            x = torch.stack(crops)
        # Same float ops, in the same order, as timm's ToTensor (div 255) + Normalize (sub, div).
        x = x.float().div(255).sub(self.mean).div(self.std)
        return x.to(self.dtype)


class ClassifierWorker(Worker):
    """Top-k classes (and optionally the pooled embedding) per frame."""

    kind = "classify"

    def __init__(self, cfg: ClassifyConfig, *, model: torch.nn.Module | None = None, weights_tag: str | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if cfg.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = getattr(torch, cfg.dtype)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if model is None:
            model, weights_tag = build_classifier(cfg.name, cfg.weights)
        self.weights_tag = weights_tag or "random"
        self.model = model.eval().to(self.device, self.dtype)
        self.labels = class_labels(self.model)
        self.pre = Preprocessor(self.model, cfg.preprocess, self.device, self.dtype)
        self.topk = min(cfg.topk, self.model.num_classes)
        # One CUDA stream per instance, so instances sharing the GPU overlap uploads and compute.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _on_stream(self):
        import contextlib
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def prepare(self, frames: Sequence) -> torch.Tensor:
        with self._on_stream():
            x = self.pre([f.pixels for f in frames])
        if self.stream is not None:
            self.stream.synchronize()  # uploads done: the ring slots may be reused
        return x

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits float32, pooled embedding or None)."""
        feats = self.model.forward_features(x)
        logits = self.model.forward_head(feats).float()
        emb = self.model.forward_head(feats, pre_logits=True) if self.cfg.embedding else None
        return logits, emb

    def infer(self, inputs: torch.Tensor) -> list[dict]:
        with self._on_stream():
            logits, emb = self.forward(inputs)
            probs = logits.softmax(dim=-1)
            top_p, top_i = probs.topk(self.topk, dim=-1)
            top_p, top_i = top_p.cpu().tolist(), top_i.cpu().tolist()
        out = []
        for r in range(len(top_i)):
            fields: dict[str, Any] = {"topk": [[i, self.labels[i], p] for i, p in zip(top_i[r], top_p[r])]}
            out.append(fields)
        if emb is not None:
            with self._on_stream():
                e16 = emb.float().cpu().to(torch.float16).numpy()
            for r, fields in enumerate(out):
                fields["embedding"] = e16[r].tobytes()
        return out

    def warmup(self, batch_sizes: Sequence[int]) -> dict[int, float]:
        c, h, w = self.pre.data_config["input_size"]
        return time_batches(self.forward, lambda b: torch.randn(b, c, h, w, device=self.device).to(self.dtype),
                            batch_sizes, self.device)

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def build_pool(cfg: ClassifyConfig, *, workers: list[Worker] | None = None,
               factory: Callable[[], Worker] | None = None) -> PoolSpec:
    """`cfg.workers` instances sharing one copy of the model; a failed one is rebuilt from the same model."""
    if workers is None:
        first = ClassifierWorker(cfg)
        workers = [first] + [ClassifierWorker(cfg, model=first.model, weights_tag=first.weights_tag)
                             for _ in range(cfg.workers - 1)]
        factory = factory or (lambda: ClassifierWorker(cfg, model=first.model, weights_tag=first.weights_tag))
    return PoolSpec("classify", workers, factory, cfg.max_batch, cfg.threads)
