"""A CPU-decoded frame (PyAV's VideoFrame) as the host array a ring slot takes: RGB, or NV12 left unconverted.

Measured on a 2-core host, 320x240 H.264 in the decode loop (CPU per frame): decode 0.25 ms; + swscale's
yuv420p -> rgb24 (`to_ndarray(format="rgb24")`) 0.60 ms; + OpenCV's I420 -> RGB 0.41 ms; + I420 -> NV12 (no colour
maths) 0.31 ms. So:
  * rgb24: OpenCV's SIMD conversion where its maths is the frame's (BT.601, limited range: what swscale assumes
    for untagged streams, and what most cameras send); swscale (PyAV) for anything else, which honours the
    frame's colour tags. On BT.601 limited frames OpenCV is the closer of the two to the exact conversion (mean
    0.25 levels against swscale's 1.1; they differ by at most 4: tests/streams/test_convert.py).
  * nv12: no colour conversion at all: the pool converts in its batched preprocessing (engine/models/colour.py),
    or reads no pixels (the null pool). The frame's colour tags travel with it (FrameMeta.colour).
OpenCV runs single-threaded here: one conversion per decoder thread, and its thread pool would wake for each
small frame (the view does the same, engine/view/hub.py).
"""

from __future__ import annotations

import logging
from typing import Any

import cv2
import numpy as np

from streams.colour import UnsupportedColourError, frame_colour

log = logging.getLogger("vidar.source")

cv2.setNumThreads(1)

PIXEL_FORMATS = ("rgb24", "nv12")
_I420 = ("yuv420p", "yuvj420p")  # the planar 4:2:0 layouts to_ndarray() returns as (H * 3 // 2, W)


def to_rgb(frame: Any) -> np.ndarray:
    """(H, W, 3) uint8 RGB of a PyAV VideoFrame."""
    if frame.format.name == "yuv420p" and not (frame.width | frame.height) & 1:
        try:
            colour = frame_colour(frame)
        except UnsupportedColourError:
            colour = None
        if colour == ("bt601", "limited"):
            return cv2.cvtColor(frame.to_ndarray(), cv2.COLOR_YUV2RGB_I420)
    return frame.to_ndarray(format="rgb24")


def to_nv12(frame: Any) -> tuple[np.ndarray, tuple[str, str]]:
    """(H * 3 // 2, W) uint8 NV12 of a PyAV VideoFrame (the Y plane, then U and V interleaved), and its colour
    (matrix, range) for the conversion downstream. Odd sizes lose their last row or column (NV12 needs even
    ones); other pixel formats (4:2:2, 4:4:4, 10-bit) go through swscale."""
    h, w = frame.height & ~1, frame.width & ~1
    colour = _colour(frame)
    if frame.format.name in _I420 and (h, w) == (frame.height, frame.width):
        i420 = frame.to_ndarray().reshape(-1)  # Y (h x w), then U and V (h/2 x w/2 each), packed
        out = np.empty((h * 3 // 2, w), np.uint8)
        y, c = h * w, (h // 2) * (w // 2)
        out.reshape(-1)[:y] = i420[:y]
        uv = out[h:].reshape(h // 2, w // 2, 2)
        uv[..., 0] = i420[y:y + c].reshape(h // 2, w // 2)
        uv[..., 1] = i420[y + c:y + 2 * c].reshape(h // 2, w // 2)
        return out, colour
    return frame.reformat(width=w, height=h, format="nv12").to_ndarray(), colour


def _colour(frame: Any) -> tuple[str, str]:
    try:
        return frame_colour(frame)
    except UnsupportedColourError as err:
        # A matrix the NV12 path does not convert (BT.2020: HDR cameras): converted as BT.709, the nearest, said once
        # per process. Only pools that convert NV12 themselves or read no pixels get NV12 (stream_table.py).
        if not _warned:
            _warned.append(True)
            log.warning("%s; converting as bt709", err)
        return ("bt709", "full" if frame.format.name.startswith("yuvj") else "limited")


_warned: list = []
