"""Shared fixtures: generated clips, free ports, and the GPU marker. Plain helpers live elsewhere, so that no
test module imports this one: tests/support/ (engine configs, ports, subscribers, ...) and engine/testing/
(clips, the SAM 2 reference, wait_for), which benchmarks use too.

GPU tests are marked `gpu`: skipped without CUDA, and failing loudly when VIDAR_REQUIRE_GPU=1
(so a GPU run can never pass by skipping them).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.testing.clips import write_clip
from tests.support.net import free_port


def pytest_runtest_setup(item):
    if "gpu" in item.keywords and not torch.cuda.is_available():
        if os.environ.get("VIDAR_REQUIRE_GPU") == "1":
            pytest.fail("VIDAR_REQUIRE_GPU=1 but torch.cuda.is_available() is False", pytrace=False)
        pytest.skip("needs a CUDA GPU (set VIDAR_REQUIRE_GPU=1 to fail instead of skipping)")


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def clip48(tmp_path_factory) -> Path:
    return write_clip(tmp_path_factory.mktemp("clips") / "clip48.mp4", 48)
