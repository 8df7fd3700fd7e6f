"""The SAM 2 pool: image-encoder worker instances (batched across streams) feeding one shared
decoder stage (batched across every due (stream, object) pair). See sam2_tracker.py."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from pydantic import ValidationError

from ..config import ObjectConfig, Sam2Config
from ..control import need
from ..errors import ControlError
from .base import OutputProcessor, Worker, time_batches
from .models import Preprocessor, resolve_device
from .registry import FAMILY_OPS, PoolSpec, instances
from .sam2_model import KEY, build_sam2_model, sam2_contract
from .sam2_tracker import DecoderStage, Prompt, encode, render


class Sam2EncoderWorker(Worker):
    """Stage (a): preprocess and encode frames; the features go on to the decoder stage."""

    kind = "sam2"

    def __init__(self, cfg: Sam2Config, *, model: torch.nn.Module | None = None, weights_tag: str | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.device, f"{KEY}.device")
        if model is None:
            model, weights_tag = build_sam2_model(cfg.config, cfg.checkpoint, cfg.image_size, self.device)
        self.model, self.weights_tag = model, weights_tag or "random"
        self.pre = Preprocessor(sam2_contract(self.model.image_size), cfg.preprocess, self.device)

    def prepare(self, frames: Sequence) -> torch.Tensor:
        x = self.pre([f.pixels for f in frames])
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # uploads done: the ring slots may be reused
        return x

    def infer(self, inputs: torch.Tensor) -> list[dict]:
        return [{"_features": f} for f in encode(self.model, inputs)]

    def warmup(self, batch_sizes: Sequence[int]) -> dict[int, float]:
        c, h, w = self.pre.data_config["input_size"]
        return time_batches(lambda x: encode(self.model, x), lambda b: torch.randn(b, c, h, w, device=self.device),
                            batch_sizes, self.device)

    def close(self) -> None:
        self.model = None


class Sam2Processor(OutputProcessor):
    """The SAM 2 pool's output processor, run on its output thread (the one owner of the tracking
    state): the shared decoder stage, then mask rendering, and the object control requests.

    Frames of one stream inside one encoder batch are tracked in order (one "wave" per frame),
    each wave one batched decoder call for all due pairs of all streams in it. All waves run on
    staged state; `commit` installs it (see DecoderStage).
    """

    ops = FAMILY_OPS["sam2"]

    def __init__(self, decoder: DecoderStage):
        self.stage = decoder

    def add_stream(self, stream: str) -> None:
        self.stage.add_stream(stream)

    def remove_stream(self, stream: str) -> None:
        self.stage.remove_stream(stream)

    def process(self, frames: Sequence, fields: list[dict]) -> tuple[list, Callable[[], None]]:
        staged = self.stage.begin([fv.meta.stream for fv in frames])
        events: list = []
        out: list = [None] * len(frames)
        for wave in _waves(frames):
            wave = [i for i in wave if frames[i].meta.stream in staged]
            batch = [(frames[i].meta.stream, fields[i]["_features"], (frames[i].meta.height, frames[i].meta.width))
                     for i in wave]
            tracked, ev = self.stage.track(staged, batch)
            events += ev
            for i, objs in zip(wave, tracked):
                out[i] = _render_frame(objs, frames[i].meta.height, frames[i].meta.width)
        for i, f in enumerate(out):
            if f is None:  # its stream left the stage (removed): the output stage drops such frames first
                out[i] = RuntimeError(f"stream {frames[i].meta.stream!r} is not tracked")
        return out, lambda: self.stage.commit(staged, events)

    def control(self, op: str, request: dict) -> dict:
        if op == "add_object":
            try:
                o = ObjectConfig.model_validate({k: v for k, v in request.items() if k != "op"})
            except ValidationError as err:
                e = err.errors()[0]
                raise ControlError(f"add_object: {'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}") from None
            self.stage.add_object(o.stream, Prompt(o.id, box=o.box, points=o.points))
        elif op == "remove_object":
            self.stage.remove_object(need(request, "stream", str), need(request, "id", int))
        elif op == "reset_stream":
            self.stage.reset_stream(need(request, "stream", str))
        else:
            raise ControlError(f"sam2: unknown op {op!r}")
        return {}

    def describe(self) -> dict[str, dict]:
        return {s: {"objects": d["objects"] + d["pending"], "frame": d["frame"]} for s, d in self.stage.snapshot.items()}

    def counters(self) -> dict[str, dict[str, int]]:
        return {"object_failures": dict(self.stage.object_failures)}

    def events(self) -> list[tuple[str, str, str]]:
        out = []
        while self.stage.events:
            out.append(self.stage.events.popleft())
        return out


def _waves(frames: Sequence) -> list[list[int]]:
    """Indices per wave: the k-th frame of every stream in the batch goes into wave k."""
    waves: list[list[int]] = []
    seen: dict[str, int] = {}
    for i, fv in enumerate(frames):
        w = seen.get(fv.meta.stream, 0)
        seen[fv.meta.stream] = w + 1
        if w == len(waves):
            waves.append([])
        waves[w].append(i)
    return waves


def _render_frame(objs: list[dict], height: int, width: int) -> dict:
    fields = {"objects": [render(r, height, width) for r in objs if "error" not in r]}
    errors = [{"id": r["id"], "error": r["error"]} for r in objs if "error" in r]
    if errors:
        fields["errors"] = errors
    return fields


def build_pool(cfg: Sam2Config, *, workers: list[Worker] | None = None,
               factory: Callable[[], Worker] | None = None) -> PoolSpec:
    """Encoder instances sharing one model, and the shared decoder stage as the output processor."""
    if workers is None:
        workers, more = instances(lambda **kw: Sam2EncoderWorker(cfg, **kw), cfg.encoders)
        factory = factory or more
    decoder = DecoderStage(workers[0].model, max_objects=cfg.max_objects)
    return PoolSpec("sam2", workers, factory, cfg.max_batch, cfg.threads, processor=Sam2Processor(decoder))
