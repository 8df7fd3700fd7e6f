"""Shared fixtures: generated clips, free ports, engine configs, and the GPU marker.

GPU tests are marked `gpu`: skipped without CUDA, and failing loudly when VIDAR_REQUIRE_GPU=1
(so a GPU run can never pass by skipping them).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from engine.config import build_config
from streams.synthetic import SyntheticSource


def pytest_runtest_setup(item):
    if "gpu" in item.keywords and not torch.cuda.is_available():
        if os.environ.get("VIDAR_REQUIRE_GPU") == "1":
            pytest.fail("VIDAR_REQUIRE_GPU=1 but torch.cuda.is_available() is False", pytrace=False)
        pytest.skip("needs a CUDA GPU (set VIDAR_REQUIRE_GPU=1 to fail instead of skipping)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def write_clip(path: Path, frames: int, size=(320, 240), fps: int = 30, *, seed: int = 0, gop: int = 15,
               fmt: str | None = None) -> Path:
    """An H.264 clip of the synthetic pattern, `frames` long (mp4; or fmt="h264": a raw Annex-B stream)."""
    w, h = size
    src = SyntheticSource("clip", f"synthetic://shapes?size={w}x{h}&fps={fps}&seed={seed}")
    with av.open(str(path), "w", format=fmt) as out:
        st = out.add_stream("libx264", rate=fps)
        st.width, st.height, st.pix_fmt = w, h, "yuv420p"
        st.options = {"g": str(gop), "bf": "0", "preset": "ultrafast"}
        for n in range(frames):
            for pkt in st.encode(av.VideoFrame.from_ndarray(src.render(n), format="rgb24")):
                out.mux(pkt)
        for pkt in st.encode():
            out.mux(pkt)
    return path


@pytest.fixture(scope="session")
def clip48(tmp_path_factory) -> Path:
    return write_clip(tmp_path_factory.mktemp("clips") / "clip48.mp4", 48)


def decode_all(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def wait_for(cond, timeout: float, step: float = 0.05) -> bool:
    """Poll `cond` until it is true or `timeout` seconds pass; whether it came true."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return False


def engine_config(streams: list[dict], endpoint: str, **sections):
    tree = {"streams": streams,
            "models": {"classify": {"name": "test_vit", "weights": "random", "max_batch": 4, "device": "cpu"}},
            "publish": {"endpoint": endpoint}, "metrics": {"enabled": False}, "status": {"interval_s": 1},
            "control": {"enabled": False},  # engines in tests run without the runtime's control socket
            "view": {"enabled": False}}     # nor its live view (tests/test_view*.py turn it on)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            for k, v in value.items():
                if isinstance(v, dict) and isinstance(tree[key].get(k), dict):
                    tree[key][k].update(v)
                else:
                    tree[key][k] = v
        else:
            tree[key] = value
    cfg, _ = build_config(tree, cuda_available=True)
    return cfg
