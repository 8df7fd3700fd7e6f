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
from engine.models.graphs import CudaGraphBackend, GraphBackend, GraphDispatcher, HostCopy, default_sizes
from engine.models.batch_preprocess import BatchPreprocessor, frames_input
from engine.models.preprocess import InputContract, Preprocessor
from engine.models.weights import fetch_pretrained, load_strict, read_state_dict
from engine.models.device import model_stream, on_stream, resolve_device, resolve_dtype, wait_for_slots
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

    def __init__(self, cfg: ClassifyConfig, *, model: torch.nn.Module | None = None, weights_tag: str | None = None,
                 graph_backend: GraphBackend | None = None):
        """`graph_backend` replaces the CUDA one (tests drive the graph path on the CPU with a fake)."""
        self.cfg = cfg
        self.device = resolve_device(cfg.device, f"{KEY}.device")
        self.dtype = resolve_dtype(cfg.dtype, self.device, f"{KEY}.dtype")
        if model is None:
            model, weights_tag = build_classifier(cfg.name, cfg.weights)
        self.weights_tag = weights_tag or "random"
        self.model = model.eval().to(self.device, self.dtype)
        self.labels = class_labels(self.model)
        contract = timm_contract(self.model)
        self.pre = Preprocessor(contract, cfg.preprocess, self.device, self.dtype)
        # NV12 frames (NVDEC, in GPU slots) always, and on a GPU the host RGB frames of `fast` too: one batched
        # op per frame size, host frames up through one pinned staging buffer per batch (batch_preprocess.py)
        self.batch_pre = BatchPreprocessor(contract, self.device, self.dtype)
        self._slots_read_on_gpu = False  # the last prepare queued GPU work that reads NV12 slots
        # NVDEC's NV12 slots are read here only on a GPU (the batched op runs where the pixels are)
        # (`exact` promises timm's PIL transform of RGB frames, so it keeps them)
        self.accepts_nv12 = self.device.type == "cuda" and cfg.preprocess == "fast"
        self.topk = min(cfg.topk, self.model.num_classes)
        # One CUDA stream per instance, so instances sharing the GPU overlap uploads and compute (model_stream:
        # high priority, why)
        self.stream = model_stream(self.device)
        # results reach the host through pinned buffers and an event on a GPU; the CPU path reads them as is
        self._host = HostCopy() if self.device.type == "cuda" else None
        self.graphs: GraphDispatcher | None = None  # captured at warm-up (capture_graphs)
        if cfg.cuda_graphs and (graph_backend is not None or self.device.type == "cuda"):
            self.graphs = GraphDispatcher(self._eager_forward, cfg.graph_batch_sizes or default_sizes(cfg.batch_ceiling),
                                          backend=graph_backend or CudaGraphBackend(self.device), key=KEY)
        elif self.device.type == "cuda":
            log.info("%s: cuda_graphs is off: every batch runs eager", KEY)

    def prepare(self, frames: Sequence) -> torch.Tensor:
        """The model input from the frames' slots: RGB host slots (CPU decode) or NV12 GPU slots (NVDEC),
        mixed in one batch when a pool's streams decode differently. On a GPU nothing here waits on the
        host: this stream waits on each slot's write event, and the slots are released on the event
        `release_event` records after this work (the ring rewrites a slot only once it has fired)."""
        with on_stream(self.stream):
            self._slots_read_on_gpu = wait_for_slots(self.stream, frames)
            return frames_input(frames, self.batch_pre, self._rgb)[0]

    def _rgb(self, pixels: list[torch.Tensor]) -> torch.Tensor:
        """Host RGB frames: on a GPU (fast), one staging copy per batch; otherwise today's Preprocessor
        (exact: timm's PIL pipeline; fast on the CPU: uint8 tensor ops)."""
        if self.device.type == "cuda" and self.cfg.preprocess == "fast":
            return self.batch_pre(pixels, "rgb24")
        return self.pre(pixels)

    def release_event(self):
        """After a prepare that read NV12 slots on the GPU: an event after everything queued so far on this
        runner's stream (those reads included). None otherwise: prepare has read the slots already."""
        if not self._slots_read_on_gpu:
            return None
        # waited on by the ring's copy stream only (DeviceSlots: stream.wait_event), never by the host: torch's
        # default, non-blocking event (device.host_event says why host-waited ones are not)
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def capture_graphs(self) -> None:
        """Capture the forward's CUDA graphs (once; a no-op without graphs). Called by `warmup`, and for
        instances the pool never warms up by `build_pool`: at start, before any stream's thread starts
        (instances rebuilt after a failure run eager: build_pool)."""
        if self.graphs is not None and not self.graphs.attempted:
            self.graphs.capture(self.pre.data_config["input_size"], self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits float32, pooled embedding or None). Replayed from a CUDA graph when one was captured
        for this batch size or the next one up: then views of the graph's static outputs, which the next
        `forward` overwrites (read or copy them first); eager otherwise."""
        if self.graphs is not None:
            return self.graphs.run(x)
        return self._eager_forward(x)

    @torch.inference_mode()
    def _eager_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        feats = self.model.forward_features(x)
        logits = self.model.forward_head(feats).float()
        emb = self.model.forward_head(feats, pre_logits=True) if self.cfg.embedding else None
        return logits, emb

    def infer(self, inputs: torch.Tensor) -> list[dict]:
        with on_stream(self.stream):
            logits, emb = self.forward(inputs)
            probs = logits.softmax(dim=-1)
            top_p, top_i = probs.topk(self.topk, dim=-1)
            if self._host is not None:  # queued behind the batch's kernels; one event wait below
                host = self._host.copy([top_p, top_i] + ([emb.float().to(torch.float16)] if emb is not None else []),
                                       self.stream)
        if self._host is not None:
            self._host.wait()
            top_p, top_i = host[0].tolist(), host[1].tolist()
            e16 = host[2].numpy() if emb is not None else None
        else:
            top_p, top_i = top_p.cpu().tolist(), top_i.cpu().tolist()
            e16 = emb.float().cpu().to(torch.float16).numpy() if emb is not None else None
        out = []
        for r in range(len(top_i)):
            fields: dict[str, Any] = {"topk": [[i, self.labels[i], p] for i, p in zip(top_i[r], top_p[r])]}
            if e16 is not None:
                fields["embedding"] = e16[r].tobytes()
            out.append(fields)
        return out

    def warmup(self, batch_sizes: Sequence[int]) -> dict[int, float]:
        """Capture the graphs, then seconds per batch size. Eager: the sizes asked for. With graphs, also
        every size up to the largest graph, each the time of the size it is padded to (3 costs what 4
        does), so the latency model learns the steps instead of interpolating across them; a size over
        the largest graph runs eager and is measured as itself."""
        c, h, w = self.pre.data_config["input_size"]
        self.capture_graphs()

        def make(b: int) -> torch.Tensor:
            return torch.randn(b, c, h, w, device=self.device).to(self.dtype)
        if self.graphs is None or not self.graphs.sizes:
            return time_batches(self.forward, make, batch_sizes, self.device)
        wanted = sorted(set(batch_sizes) | set(range(1, min(max(batch_sizes), self.graphs.sizes[-1]) + 1)))
        runs = {b: self.graphs.dispatch(b) or b for b in wanted}
        seen = time_batches(self.forward, make, sorted(set(runs.values())), self.device)
        return {b: seen[runs[b]] for b in wanted}

    def close(self) -> None:
        if self.graphs is not None:  # before the weights go: a replay would read freed memory
            self.graphs.close()
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def build_pool(cfg: ClassifyConfig, *, models: list[ModelRunner] | None = None,
               factory: Callable[[], ModelRunner] | None = None) -> PoolSpec:
    """`cfg.workers` instances sharing one copy of the model; a failed one is rebuilt from the same model."""
    if models is None:
        def make(capture: bool = True, **kw: Any) -> ModelRunner:
            # every instance captures its own graphs (own buffers, own stream), not only the one the pool
            # warms up: here, at start, before any stream's thread starts
            runner = ClassifierRunner(cfg, **kw)
            if capture:
                runner.capture_graphs()
            return runner
        models, _ = instances(make, cfg.workers or 1)

        def rebuilt() -> ModelRunner:
            # No capture at run time: torch.cuda.graph() synchronises the device and empties the caching
            # allocator on entry, which would stall the rebuilding thread (the core's, for the watchdog) for
            # seconds, or for ever on a hung GPU. A rebuilt instance runs eager, and says so.
            runner = make(capture=False, model=models[0].model, weights_tag=models[0].weights_tag)
            if runner.graphs is not None:
                runner.graphs.eager_reason = "rebuilt after a failure: graphs are captured only at start"
                log.warning("%s: a rebuilt instance runs eager (%s)", KEY, runner.graphs.eager_reason)
            return runner
        factory = factory or rebuilt
    return PoolSpec("classify", models, factory, cfg.batch_ceiling, cfg.threads, auto_batch=cfg.max_batch == "auto")


def auto_plan(cfg: ClassifyConfig, *, cores: int, pools: int, live: bool) -> tuple[ClassifyConfig, ThreadPlan]:
    """Fill in `workers`/`threads` the config left unset (engine/tuning.py says why)."""
    cuda = resolve_device(cfg.device, f"{KEY}.device").type == "cuda"
    plan = plan_classify(cores=cores, pools=pools, cuda=cuda, live=live, workers=cfg.workers, threads=cfg.threads)
    return cfg.model_copy(update={"workers": plan.workers, "threads": plan.threads}), plan
