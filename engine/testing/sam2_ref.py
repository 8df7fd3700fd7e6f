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
                    timing: dict | None = None, *, device: str = "cpu", image_size: int = SIZE,
                    bf16: bool = False) -> dict:
    """Meta's SAM2VideoPredictor: init_state + add_new_points_or_box (at frame `start`) + propagate_in_video.
    prompts: {obj_id: {"box": [...]} or {"points": [[x, y, label], ...]}}. Returns {frame: {obj_id: bool mask}}.
    timing: if given, gets "propagate_s", the seconds of propagate_in_video alone (frames preloaded), and
    "frame_s", the seconds of each frame (the GPU synchronised at each). bf16: under bf16 autocast, as Meta
    runs it on a GPU (its notebooks: `torch.autocast("cuda", dtype=torch.bfloat16)`)."""
    import contextlib

    from sam2.build_sam import build_sam2_video_predictor
    pred = build_sam2_video_predictor(config_path(CONFIG), ckpt_path=str(ckpt), device=device,
                                      hydra_overrides_extra=size_overrides(image_size))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    amp = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    folder = workdir / "frames"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for i, f in enumerate(frames):
        # The predictor only reads "<n>.jpg" folders; PNG data keeps the pixels exact (PIL reads by content).
        Image.fromarray(f).save(folder / f"{i:05d}.jpg", format="PNG")
    out, frame_s = {}, []
    with warnings.catch_warnings(), torch.inference_mode(), amp:
        warnings.simplefilter("ignore")
        state = pred.init_state(str(folder))
        for obj_id, p in prompts.items():
            if "box" in p:
                pred.add_new_points_or_box(state, frame_idx=start, obj_id=obj_id, box=p["box"])
            else:
                pts = p["points"]
                pred.add_new_points_or_box(state, frame_idx=start, obj_id=obj_id, points=[q[:2] for q in pts],
                                           labels=[q[2] for q in pts])
        sync()
        t0 = t = time.perf_counter()
        for fi, ids, masks in pred.propagate_in_video(state):
            out[fi] = {oid: (masks[k, 0] > 0).cpu().numpy() for k, oid in enumerate(ids)}
            now = time.perf_counter()  # .cpu() above waited for the frame's GPU work
            frame_s.append(now - t)
            t = now
        if timing is not None:
            timing["propagate_s"] = time.perf_counter() - t0
            timing["frame_s"] = frame_s
    return out


def iou(a: np.ndarray, b: np.ndarray) -> float:
    union = (a | b).sum()
    return float((a & b).sum() / union) if union else 1.0
