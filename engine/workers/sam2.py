"""The SAM 2 pool: image-encoder worker instances (batched across streams) feeding one shared
decoder stage (batched across every due (stream, object) pair). See sam2_tracker.py."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..config import Sam2Config
from .base import Worker, time_batches
from .models import Preprocessor, resolve_device
from .sam2_model import KEY, build_sam2_model, sam2_contract
from .sam2_tracker import DecoderStage, encode, render


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


class Sam2Stage:
    """Pool stage 2, run in dispatch order: the shared decoder stage, then rendering.

    Frames of one stream inside one encoder batch are tracked in order (one "wave" per frame),
    each wave one batched decoder call for all due pairs of all streams in it.
    """

    def __init__(self, decoder: DecoderStage, emit: Callable[[str, str, str], None]):
        self.decoder, self._emit = decoder, emit

    def __call__(self, frames: Sequence, outputs: list[dict]) -> list[dict]:
        waves: list[list[int]] = []
        seen: dict[str, int] = {}
        for i, fv in enumerate(frames):
            w = seen.get(fv.meta.stream, 0)
            seen[fv.meta.stream] = w + 1
            if w == len(waves):
                waves.append([])
            waves[w].append(i)
        fields: list[dict] = [{} for _ in frames]
        for wave in waves:
            batch = [(frames[i].meta.stream, outputs[i]["_features"], (frames[i].meta.height, frames[i].meta.width))
                     for i in wave]
            for i, objs in zip(wave, self.decoder.step(batch)):
                h, w = frames[i].meta.height, frames[i].meta.width
                fields[i] = {"objects": [render(r, h, w) for r in objs]}
        while self.decoder.rejected:
            stream, obj_id, why = self.decoder.rejected.pop(0)
            self._emit(stream, "error", f"object {obj_id} rejected: {why}")
        return fields
