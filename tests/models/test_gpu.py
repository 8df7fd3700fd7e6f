"""GPU paths: ring host slots on a GPU machine, preprocessing on the GPU, bf16 inference.

Marked `gpu`: skipped without CUDA, and failing when VIDAR_REQUIRE_GPU=1 (see conftest.py).
These have NOT run on the CPU-only machines vidar is developed on; benchmarks/gpu_check.py
runs them on a GPU machine.
"""

import math
import time

import numpy as np
import pytest
import torch

from engine.frames.accounting import Accounting
from engine.config import ClassifyConfig as VitConfig
from engine.frames.lifecycle import FrameMeta
from engine.frames.ring import FrameRing
from engine.models.classify import ClassifierRunner
from engine.testing.clips import decode_all
from tests.support.models import rel_err, seeded_model, timm_reference, views

pytestmark = pytest.mark.gpu


def test_ring_host_slots_stay_pageable_with_cuda():
    """Host slots are never pinned, also with CUDA (engine/frames/storage.py HostSlots: no upload reads a slot, and
    pinning 48 720p streams' rings locked ~3 GB outside the ring budget); the CPU side: test_host_slot_memory.py."""
    r = FrameRing("g", live=True, accounting=Accounting("classify"), memory_bytes=2**20, min_slots=2, max_slots=4,
                  max_frame_pixels=10**8)
    r.write(FrameMeta("g", 0, 0.0, time.time(), deadline=math.inf), np.zeros((32, 32, 3), np.uint8))
    (fv,) = r.take_ready()
    assert not fv.pixels().is_pinned()


def test_cuda_fast_preprocessing_and_bf16_match_timm(clip48):
    frames = decode_all(clip48)[::6]
    model = seeded_model()
    ref = timm_reference(model, frames)
    for dtype in ("float32", "bfloat16"):
        w = ClassifierRunner(VitConfig(name="test_vit", weights="random", device="cuda", dtype=dtype),
                             model=seeded_model(), weights_tag="random")
        x = w.prepare(views(frames))
        assert x.is_cuda and x.dtype == getattr(torch, dtype)
        # prepare queued x on the runner's own stream (infer reads it there); forward here runs on the current
        # one, which must wait for it
        torch.cuda.current_stream().wait_stream(w.stream)
        out = w.forward(x)[0].cpu()
        assert rel_err(out, ref) <= (5e-3 if dtype == "float32" else 5e-2), dtype
        assert torch.equal(out.argmax(-1), ref.argmax(-1)), dtype
