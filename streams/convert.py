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
    planes, colour = nv12_planes(frame)
    return (np.asarray(planes) if isinstance(planes, NV12Planes) else planes), colour


def nv12_planes(frame: Any) -> tuple["NV12Planes | np.ndarray", tuple[str, str]]:
    """What a CPU decoder hands out for an NV12 slot, and its colour (matrix, range): the frame's planes still
    unwritten (NV12Planes) where the frame is 8-bit 4:2:0 planar of even size (what cameras send), else the array
    swscale makes. swscale makes limited range of a full-range "yuvj" frame (measured: 15 -> 29, 255 -> 235), so
    such an array says limited."""
    colour = frame_colour_or_nearest(frame)
    if frame.format.name in _I420 and not (frame.width | frame.height) & 1:
        return NV12Planes(frame), colour
    h, w = frame.height & ~1, frame.width & ~1
    if frame.format.name.startswith("yuvj"):
        colour = (colour[0], "limited")
    return frame.reformat(width=w, height=h, format="nv12").to_ndarray(), colour


class NV12Planes:
    """A decoded I420 frame as NV12, not written yet: `write_into` writes it straight from the decoder's planes
    into its destination (an ingest process's slot: engine/ingest/process.py), one pass; `np.asarray` makes the
    (H * 3 // 2, W) array for anyone else.

    Why not an array first, as before: PyAV's `to_ndarray()` stacks the three planes into a new array (np.hstack),
    the interleave wrote a second, and the slot took a third copy. Measured on this 2-core host, a decoded frame
    into an NV12 slot: 1280x720 1.16 ms -> 0.25 ms, 320x240 0.036 -> 0.019 ms (before the interleave by cv2.merge).
    The frame (and its decoder buffer, which FFmpeg refcounts) lives until this object goes."""

    __slots__ = ("frame", "shape")
    dtype = np.dtype(np.uint8)
    ndim = 2

    def __init__(self, frame: Any):
        self.frame = frame
        self.shape = (frame.height * 3 // 2, frame.width)

    def write_into(self, dst: np.ndarray) -> None:
        """dst: an (H * 3 // 2, W) uint8 array, C-contiguous rows (a slot): Y, then U and V interleaved."""
        f = self.frame
        h, w = f.height, f.width
        y, u, v = f.planes[0], f.planes[1], f.planes[2]
        # each plane's rows are line_size apart (FFmpeg pads them for SIMD): read through that stride, no copy
        dst[:h] = _rows(y, h, w)
        # U and V interleaved by OpenCV's merge (SIMD) into the slot's UV rows: numpy's two strided assignments
        # took twice as long (this 2-core host, best of 5: 320x240 22.6 -> 12.9 us, 1280x720 224-287 -> 105-132 us)
        uv = dst[h:].reshape(h // 2, w // 2, 2)
        if cv2.merge((_rows(u, h // 2, w // 2), _rows(v, h // 2, w // 2)), uv) is not uv:
            # OpenCV writes a new array when dst does not fit: never a slot left unwritten in silence
            raise ValueError(f"NV12 destination {dst.shape} does not take a {w}x{h} frame")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.empty(self.shape, np.uint8)
        self.write_into(out)
        return out if dtype is None else out.astype(dtype, copy=False)


def _rows(plane: Any, rows: int, width: int) -> np.ndarray:
    """A plane's first `width` bytes of each of its `rows` rows, a view of the decoder's buffer."""
    return np.frombuffer(plane, np.uint8, count=rows * plane.line_size).reshape(rows, plane.line_size)[:, :width]


def frame_colour_or_nearest(frame: Any) -> tuple[str, str]:
    """The frame's (matrix, range) for an NV12 -> RGB conversion downstream; BT.709 for a matrix it does not take."""
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
