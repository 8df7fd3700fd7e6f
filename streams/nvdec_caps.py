"""What this GPU's NVDEC decodes: PyNvVideoCodec's GetDecoderCaps, asked once per (GPU, codec), and the
checks a stream must pass before NVDEC is chosen for it (streams/nvdec.py resolve_decode).

Why before: `CreateDecoder` only creates NVIDIA's parser. The capability check and `cuvidCreateDecoder` run
in the parser's sequence callback, inside the first `Decode` that carries a sequence header ("Codec not
supported on this GPU", "Resolution not supported on this GPU", "MBCount not supported on this GPU" are
strings of PyNvVideoCodec 2.2.4's extension, NvDecoder.cpp). Without this check such a stream opens "on
NVDEC" and never yields a frame. The first-Decode failure stays the backstop (streams/nvdec.py falls back
to the CPU when it happens before a stream's first frame): what the caps do not say (a profile, a level)
still shows there.

GetDecoderCaps, as PyNvVideoCodec 2.2.4 defines it (src/PyNvVideoCodec/src/PyNvDecoder.cpp, the
`GetDecoderCaps` binding and `PyNvDecoderCaps`; the same key strings are in the wheel's
PyNvVideoCodec_130 extension): `GetDecoderCaps(gpuid=0, codec=H264, chromaformat=420, bitdepth=8)` returns a
dict of unsigned ints copied from CUVIDDECODECAPS: codec_id, chromaformat_id, bitdepth (the query echoed),
supported (bIsSupported), num_decoder_engines, width_max, height_max, mb_num_max, width_min, height_min.
Each call creates and destroys a CUDA context (hence once per GPU and codec), and 2.2.4 queries device 0
whatever `gpuid` says (it validates gpuid, then `cuDeviceGet(&dev, 0)`): on a machine of mixed GPUs the
caps are GPU 0's. None of this has run on a GPU here; the keys are read defensively (a missing one is not
checked, and the first-Decode backstop remains).
"""

from __future__ import annotations

import math
import threading
import weakref
from types import ModuleType
from typing import Any, Mapping, Optional, Union

#: PyAV codec name -> PyNvVideoCodec's cudaVideoCodec member: the codecs NVDEC decodes (cuviddec.h) whose
#: packets PyAV hands out in a form NVDEC parses (after Annex-B conversion for H.264/HEVC). MPEG-4 part 2
#: and VC-1 are left out: NVDEC wants their headers (container extradata) prepended, which is not done here.
NVDEC_CODECS: dict[str, str] = {
    "h264": "H264", "hevc": "HEVC", "av1": "AV1", "vp9": "VP9", "vp8": "VP8",
    "mpeg1video": "MPEG1", "mpeg2video": "MPEG2",
}

_lock = threading.Lock()
#: module -> {(gpu, codec name): caps, or why they could not be read}; keyed weakly by the module so a
#: test's fake and its answers go together
_asked: "weakref.WeakKeyDictionary[Any, dict[tuple[int, str], Union[Mapping, str]]]" = weakref.WeakKeyDictionary()


def decoder_caps(nvc: ModuleType, gpu: int, codec_name: str) -> Union[Mapping, str]:
    """GetDecoderCaps for 8-bit 4:2:0 `codec_name` on `gpu` (the only frames vidar sends NVDEC: NV12),
    asked once per process and remembered, failures included; a str says why the query failed."""
    with _lock:
        known = _asked.setdefault(nvc, {})
        if (gpu, codec_name) not in known:
            try:
                # chromaformat and bitdepth left at the binding's defaults: 4:2:0, 8 bits (PyNvDecoder.cpp)
                known[(gpu, codec_name)] = nvc.GetDecoderCaps(
                    gpuid=gpu, codec=getattr(nvc.cudaVideoCodec, NVDEC_CODECS[codec_name]))
            except Exception as err:  # pybind11's errors and std::runtime_error (no libnvcuvid): not one base
                first = (str(err).strip().splitlines() or [""])[0][:200]
                known[(gpu, codec_name)] = f"{type(err).__name__}: {first}"
        return known[(gpu, codec_name)]


def odd_size(size: Optional[tuple[int, int]]) -> Optional[str]:
    """Why an odd frame size is not sent to NVDEC (None: even, or not known yet). NV12 halves both chroma
    dimensions: NVDEC's surface of an odd height is not 3/2 of it in rows (its DLPack shape is then no NV12
    this code reads), and the SDK rounds an odd width up, so the frame would come out a pixel wider. VP9, AV1
    and MPEG-2 allow odd sizes; PyAV on the CPU decodes them exactly."""
    if not size or not all(size):
        return None
    w, h = size
    if w % 2 or h % 2:
        return f"odd frame size {w}x{h} (NVDEC's NV12 frames here need an even width and height)"
    return None


def caps_refusal(caps: Mapping, codec_name: str, size: Optional[tuple[int, int]]) -> Optional[str]:
    """Why this GPU's NVDEC, by its caps, cannot decode an 8-bit 4:2:0 `codec_name` stream of `size`
    (None: nothing in the caps refuses it). The checks NvDecoder's sequence callback makes, made early."""
    if not isinstance(caps, Mapping):  # an unknown shape (another PyNvVideoCodec): no verdict from it
        return None
    if "supported" in caps and not caps["supported"]:
        return f"this GPU's NVDEC does not decode 8-bit 4:2:0 {codec_name} (GetDecoderCaps)"
    if not size or not all(size):
        return None
    w, h = size
    w_max, h_max = caps.get("width_max") or 0, caps.get("height_max") or 0
    if w_max and h_max and (w > w_max or h > h_max):
        return f"{w}x{h} is over this GPU's NVDEC limit for {codec_name}, {w_max}x{h_max} (GetDecoderCaps)"
    mbs, mb_max = math.ceil(w / 16) * math.ceil(h / 16), caps.get("mb_num_max") or 0
    if mb_max and mbs > mb_max:
        return f"{w}x{h} is {mbs} macroblocks, over this GPU's NVDEC limit for {codec_name}, {mb_max} (GetDecoderCaps)"
    w_min, h_min = caps.get("width_min") or 0, caps.get("height_min") or 0
    if w < w_min or h < h_min:
        return f"{w}x{h} is under this GPU's NVDEC minimum for {codec_name}, {w_min}x{h_min} (GetDecoderCaps)"
    return None
