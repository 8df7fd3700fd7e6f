"""Colour-tagged H.264 frames for the NV12 tests: the synthetic pattern and two photographs encoded with
libx264 under a given matrix and range (written into the stream's VUI, as a camera does) and decoded back
by PyAV, so the frames carry the tags our CPU decode path (streams/pyav.py) converts with."""

from __future__ import annotations

import io

import av
import numpy as np
import torch

from streams.synthetic import SyntheticSource

#: AVColorSpace / AVColorRange values written for each (matrix, range): BT.601 as SMPTE 170M (what
#: 525-line and most SD cameras write), BT.709 as itself; limited = MPEG, full = JPEG.
AVCOL_SPC = {"bt601": 6, "bt709": 1}
AVCOL_RANGE = {"limited": 1, "full": 2}


def tagged_frames(matrix: str | None, range_: str | None, n: int = 4, size=(320, 240), seed: int = 0,
                  crf: int = 18) -> list[av.VideoFrame]:
    """`n` decoded frames of the synthetic pattern, tagged with (matrix, range); None leaves a tag unspecified."""
    w, h = size
    src = SyntheticSource("colour", f"synthetic://shapes?size={w}x{h}&fps=30&seed={seed}")
    return encode_decode([src.render(i) for i in range(n)], matrix, range_, crf)


def photo_frames(matrix: str | None, range_: str | None) -> list[av.VideoFrame]:
    """scikit-image's astronaut (512x512) and coffee (600x400) photographs, each through H.264 with the tags:
    real edges, highlights and skin tones, which the synthetic pattern lacks."""
    import skimage.data

    return [encode_decode([img], matrix, range_)[0] for img in (skimage.data.astronaut(), skimage.data.coffee())]


def encode_decode(images: list[np.ndarray], matrix: str | None, range_: str | None, crf: int = 18) -> list[av.VideoFrame]:
    """RGB images (one size, even) through libx264 (yuv420p, tagged as asked) and PyAV's decoder."""
    h, w = images[0].shape[:2]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        st = out.add_stream("libx264", rate=30)
        st.width, st.height, st.pix_fmt = w, h, "yuv420p"
        if matrix is not None:
            st.codec_context.colorspace = AVCOL_SPC[matrix]
        if range_ is not None:
            st.codec_context.color_range = AVCOL_RANGE[range_]
        st.options = {"bf": "0", "preset": "ultrafast", "crf": str(crf)}
        for img in images:
            for pkt in st.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(pkt)
        for pkt in st.encode():
            out.mux(pkt)
    buf.seek(0)
    with av.open(buf) as c:
        return list(c.decode(video=0))


def nv12_of(frame: av.VideoFrame) -> torch.Tensor:
    """The frame's planes as NV12 (H * 3 // 2, W) uint8, as NVDEC hands them: Y, then interleaved U, V.
    Built from the decoded planes themselves (no swscale), so nothing but the layout changes."""
    h, w = frame.height, frame.width
    planar = frame.to_ndarray()  # yuv420p / yuvj420p: Y rows, then U, then V, each plane row-major
    u = planar[h:h + h // 4].reshape(h // 2, w // 2)
    v = planar[h + h // 4:].reshape(h // 2, w // 2)
    uv = np.stack([u, v], axis=-1).reshape(h // 2, w)
    return torch.from_numpy(np.concatenate([planar[:h], uv]))


def rgb_of(frame: av.VideoFrame) -> np.ndarray:
    """The CPU reference: exactly what streams/pyav.py does with a decoded frame."""
    return frame.to_ndarray(format="rgb24")
