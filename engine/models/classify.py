"""Image classification worker for any timm classifier (ViT by default).

The preprocessing contract (input size, interpolation, crop, mean, std) comes from the model's
own pretrained config through timm (`resolve_data_config` + `create_transform`): `timm_contract`
keeps the geometric steps of timm's eval transform as they are, and the shared `Preprocessor`
(models/preprocess.py) runs them `exact` (timm's PIL pipeline bit for bit) or `fast` (uint8
tensors, on the GPU when there is one), then normalises with timm's ToTensor + Normalize float ops.
"""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from engine.config import ClassifyConfig
from engine.errors import ConfigError
from engine.models.base import ModelRunner, time_batches
from engine.models.preprocess import InputContract, Preprocessor
from engine.models.weights import fetch_pretrained, load_strict, read_state_dict
from engine.models.device import resolve_device, resolve_dtype
from engine.sched.tuning import ThreadPlan, plan_classify
from engine.models.registry import PoolSpec, instances

log = logging.getLogger("vidar.classify")

KEY = "models.classify"
#: the steps of timm's eval transform that are not geometry: the Preprocessor's batched normalisation does them
_TENSOR_STEPS = ("ToTensor", "MaybeToTensor", "Normalize", "MaybePILToTensor")


def build_classifier(name: str, weights: str) -> tuple[torch.nn.Module, str]:
    """Create the timm model and load its weights. Returns (model, weights tag)."""
    import timm

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=8, cutoff=0.6)
        raise ConfigError(f"{KEY}.name: {name!r} is not a timm model; close names: {close}")
    if weights == "random":
        log.warning("%s: %s runs on RANDOM weights: its labels mean nothing; "
                    "every result is marked weights='random'", KEY, name)
        return timm.create_model(name, pretrained=False), "random"
    if weights == "pretrained":
        return fetch_pretrained(lambda: timm.create_model(name, pretrained=True), f"{KEY}.weights",
                                what=f"pretrained weights for {name!r}"), "pretrained"
    path = Path(weights)
    sd = read_state_dict(path, f"{KEY}.weights")
    probe = timm.create_model(name, pretrained=False)
    head = probe.pretrained_cfg.get("classifier", "head")
    head_w = sd.get(f"{head}.weight")
    kwargs = {"num_classes": int(head_w.shape[0])} if head_w is not None else {}
    model = timm.create_model(name, pretrained=False, **kwargs) if kwargs else probe
    load_strict(model, sd, f"{KEY}.weights", source=path.name, target=name)
    return model, path.name


def timm_contract(model: torch.nn.Module) -> InputContract:
    """The model's own preprocessing (its pretrained config through timm), as an InputContract:
    the geometric steps of timm's eval transform as they are; ToTensor + Normalize in the Preprocessor."""
    from timm.data import create_transform, resolve_data_config

    data_config = resolve_data_config(model=model)
    full = create_transform(**data_config, is_training=False)
    return InputContract(data_config, tuple(t for t in full.transforms if type(t).__name__ not in _TENSOR_STEPS))


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


class ClassifierRunner(ModelRunner):
    """Top-k classes (and optionally the pooled embedding) per frame."""

    kind = "classify"

    def __init__(self, cfg: ClassifyConfig, *, model: torch.nn.Module | None = None, weights_tag: str | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.device, f"{KEY}.device")
        self.dtype = resolve_dtype(cfg.dtype, self.device, f"{KEY}.dtype")
        if model is None:
            model, weights_tag = build_classifier(cfg.name, cfg.weights)
        self.weights_tag = weights_tag or "random"
        self.model = model.eval().to(self.device, self.dtype)
        self.labels = class_labels(self.model)
        self.pre = Preprocessor(timm_contract(self.model), cfg.preprocess, self.device, self.dtype)
        self.topk = min(cfg.topk, self.model.num_classes)
        # One CUDA stream per instance, so instances sharing the GPU overlap uploads and compute.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _on_stream(self):
        import contextlib
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def prepare(self, frames: Sequence) -> torch.Tensor:
        with self._on_stream():
            x = self.pre([f.pixels() for f in frames])
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


def build_pool(cfg: ClassifyConfig, *, models: list[ModelRunner] | None = None,
               factory: Callable[[], ModelRunner] | None = None) -> PoolSpec:
    """`cfg.workers` instances sharing one copy of the model; a failed one is rebuilt from the same model."""
    if models is None:
        models, more = instances(lambda **kw: ClassifierRunner(cfg, **kw), cfg.workers or 1)
        factory = factory or more
    return PoolSpec("classify", models, factory, cfg.max_batch, cfg.threads)


def auto_plan(cfg: ClassifyConfig, *, cores: int, pools: int, live: bool) -> tuple[ClassifyConfig, ThreadPlan]:
    """Fill in `workers`/`threads` the config left unset (engine/tuning.py says why)."""
    cuda = resolve_device(cfg.device, f"{KEY}.device").type == "cuda"
    plan = plan_classify(cores=cores, pools=pools, cuda=cuda, live=live, workers=cfg.workers, threads=cfg.threads)
    return cfg.model_copy(update={"workers": plan.workers, "threads": plan.threads}), plan
