"""Helpers of the NVDEC tests (tests/streams/test_nvdec*.py): the fake PyNvVideoCodec installed into
streams.nvdec, reading a source whole, PyAV's own NV12 for comparison, and tiny clips of a given codec."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from engine.testing.fake_nvdec import FakeNvdec
from streams import nvdec


@dataclass(frozen=True)
class Fails:
    """A table row that raises: the error and the pattern its message matches."""
    error: type
    match: str


def install(monkeypatch, fake: FakeNvdec) -> FakeNvdec:
    monkeypatch.setattr(nvdec, "load_pynvvideocodec", lambda: fake)
    monkeypatch.setattr(nvdec, "cuda_ops", fake.cuda)
    return fake


def pyav_nv12(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="nv12") for f in c.decode(video=0)]


def read_all(source) -> list:
    source.open()
    try:
        return list(source.frames())
    finally:
        source.close()


def solid_clip(path: Path, codec: str, pix_fmt: str, options: dict | None = None, size: tuple[int, int] = (32, 32)) -> Path:
    """Three flat frames of `size` (w, h) encoded with `codec` (and its options)."""
    (w, h) = size
    with av.open(str(path), "w") as out:
        st = out.add_stream(codec, rate=10)
        st.width, st.height, st.pix_fmt = w, h, pix_fmt
        st.options = options or {}
        frames = [av.VideoFrame.from_ndarray(np.full((h, w, 3), 40 * i, np.uint8), format="rgb24") for i in range(3)]
        for frame in frames + [None]:  # None flushes the encoder
            for pkt in st.encode(frame):
                out.mux(pkt)
    return path
