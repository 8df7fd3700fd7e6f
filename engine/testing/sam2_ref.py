"""The SAM 2 reference for tests and benchmarks: a random checkpoint with non-empty masks, and Meta's
predictor (SAM2VideoPredictor) as the reference the engine's masks are compared with."""

from __future__ import annotations

import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from engine.models.sam2_model import config_path, size_overrides

CONFIG, SIZE = "sam2.1_hiera_t", 256


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """Random weights in the official format, with the object-score head biased to "object present":
    with plain random weights SAM 2 says "no object" on every frame and every mask is empty."""
    from sam2.build_sam import build_sam2_video_predictor
    torch.manual_seed(seed)
    m = build_sam2_video_predictor(config_path(CONFIG), ckpt_path=None, device="cpu",
                                   hydra_overrides_extra=size_overrides(SIZE))
    with torch.no_grad():
        m.sam_mask_decoder.pred_obj_score_head.layers[-1].bias += 8
    torch.save({"model": m.state_dict()}, path)
    return path


def reference_masks(ckpt: Path, frames: list[np.ndarray], prompts: dict, workdir: Path, start: int = 0,
                    timing: dict | None = None) -> dict:
    """Meta's SAM2VideoPredictor: init_state + add_new_points_or_box (at frame `start`) + propagate_in_video.
    prompts: {obj_id: {"box": [...]} or {"points": [[x, y, label], ...]}}. Returns {frame: {obj_id: bool mask}}.
    timing: if given, gets "propagate_s", the seconds of propagate_in_video alone (frames preloaded)."""
    from sam2.build_sam import build_sam2_video_predictor
    pred = build_sam2_video_predictor(config_path(CONFIG), ckpt_path=str(ckpt), device="cpu",
                                      hydra_overrides_extra=size_overrides(SIZE))
    folder = workdir / "frames"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for i, f in enumerate(frames):
        # The predictor only reads "<n>.jpg" folders; PNG data keeps the pixels exact (PIL reads by content).
        Image.fromarray(f).save(folder / f"{i:05d}.jpg", format="PNG")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = pred.init_state(str(folder))
        for obj_id, p in prompts.items():
            if "box" in p:
                pred.add_new_points_or_box(state, frame_idx=start, obj_id=obj_id, box=p["box"])
            else:
                pts = p["points"]
                pred.add_new_points_or_box(state, frame_idx=start, obj_id=obj_id, points=[q[:2] for q in pts],
                                           labels=[q[2] for q in pts])
        t0 = time.perf_counter()
        for fi, ids, masks in pred.propagate_in_video(state):
            out[fi] = {oid: (masks[k, 0] > 0).numpy() for k, oid in enumerate(ids)}
        if timing is not None:
            timing["propagate_s"] = time.perf_counter() - t0
    return out


def iou(a: np.ndarray, b: np.ndarray) -> float:
    union = (a | b).sum()
    return float((a & b).sum() / union) if union else 1.0
