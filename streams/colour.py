"""A stream's colour metadata: which matrix and range its YUV pixels were coded with.

Read from PyAV's frame or codec-context properties (AVColorSpace / AVColorRange) the way the CPU decode
path converts them (PyAV 18's `to_ndarray(format="rgb24")` passes the frame's own tags to swscale;
measured, see engine/models/colour.py): unspecified is BT.601, limited range; a `yuvj*` pixel format is
full range. NVDEC sources (nvdec.py) stamp it on every frame; the NV12 -> RGB conversion
(engine/models/colour.py) applies it. Here, not in engine/models, because streams may not import the
engine's models and this needs no torch.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

Matrix = Literal["bt601", "bt709"]
Range = Literal["limited", "full"]
MATRICES: tuple[str, ...] = get_args(Matrix)
RANGES: tuple[str, ...] = get_args(Range)

#: FFmpeg's AVColorSpace values (libavutil/pixfmt.h) that the two matrices cover, as swscale reads them:
#: unspecified -> swscale's default, BT.601 (SWS_CS_DEFAULT = SWS_CS_ITU601).
_AVCOL_SPC: dict[int, str] = {1: "bt709", 2: "bt601", 5: "bt601", 6: "bt601"}
#: names of the others, for the error message
_AVCOL_SPC_OTHER = {0: "RGB", 3: "RESERVED", 4: "FCC", 7: "SMPTE240M", 8: "YCGCO", 9: "BT2020_NCL",
                    10: "BT2020_CL", 11: "SMPTE2085", 12: "CHROMA_DERIVED_NCL", 13: "CHROMA_DERIVED_CL", 14: "ICTCP"}
#: AVColorRange: 0 unspecified (limited, as swscale assumes), 1 MPEG (limited), 2 JPEG (full)
_AVCOL_RANGE: dict[int, str] = {0: "limited", 1: "limited", 2: "full"}


class UnsupportedColourError(ValueError):
    """The stream's colour metadata names a matrix or range the NV12 path does not convert."""


def colour_from_av(colorspace: Any, color_range: Any, pix_fmt: str | None = None) -> tuple[str, str]:
    """(matrix, range) of a stream from PyAV's colour properties, as the CPU reference converts it.

    Args:
        colorspace: `frame.colorspace` or `codec_context.colorspace` (an AVColorSpace int or IntEnum; None
            when unknown = unspecified).
        color_range: `frame.color_range` / `codec_context.color_range` (AVColorRange; None = unspecified).
        pix_fmt: the pixel format's name, if known: `yuvj*` formats are full range whatever the tag says.

    Returns:
        ("bt601" | "bt709", "limited" | "full"), with swscale's defaults for unspecified values:
        BT.601, limited range.

    Raises:
        UnsupportedColourError: another matrix (BT.2020, SMPTE 240M, FCC, YCgCo, ...) or an unknown range.

    Example: `colour_from_av(frame.colorspace, frame.color_range, frame.format.name)`.
    """
    spc = 2 if colorspace is None else int(colorspace)
    rng = 0 if color_range is None else int(color_range)
    if spc not in _AVCOL_SPC:
        name = _AVCOL_SPC_OTHER.get(spc, "unknown")
        raise UnsupportedColourError(
            f"colour matrix {spc} (AVCOL_SPC_{name}) is not converted by the NV12 path, which supports "
            f"{MATRICES} (AVColorSpace 1, 2 unspecified, 5, 6): decode this stream on the CPU (decode: cpu)")
    if rng not in _AVCOL_RANGE:
        raise UnsupportedColourError(f"colour range {rng} is not an AVColorRange the NV12 path knows "
                                     f"(0 unspecified, 1 limited, 2 full): decode this stream on the CPU (decode: cpu)")
    full = rng == 2 or (pix_fmt is not None and pix_fmt.startswith("yuvj"))
    return _AVCOL_SPC[spc], "full" if full else "limited"


def frame_colour(obj: Any) -> tuple[str, str]:
    """`colour_from_av` of a PyAV VideoFrame or codec context (anything with colorspace, color_range, format)."""
    fmt = getattr(obj, "format", None)
    return colour_from_av(getattr(obj, "colorspace", None), getattr(obj, "color_range", None),
                          getattr(fmt, "name", None))
