"""open_source: the table from a URL's scheme to the Source that reads it (synthetic, network, file), and
where its video is decoded (`decode`: PyAV on the CPU, or NVDEC, streams/nvdec.py)."""

from __future__ import annotations

from engine.errors import SourceOpenError
import streams.nvdec as nvdec  # module attributes read at call time: tests replace its seams
from streams.base import Source
from streams.pyav import FileSource, NetworkSource
from streams.synthetic import SyntheticSource
from streams.urls import NETWORK_SCHEMES, file_path, scheme_error, url_scheme


def open_source(stream_id: str, url: str, *, open_timeout_s: float = 5.0, read_timeout_s: float = 2.5,
                max_frame_pixels: int = 8192 * 8192, decode: nvdec.Decode = "cpu") -> Source:
    """The Source for a URL: synthetic://..., a network URL (NETWORK_SCHEMES), or a file path (`file:` and
    `file://` accepted), decoded where `decode` says (the config's `streams[].decode`, else `source.decode`).

    The source's `decode_device` ("cpu" | "cuda"; None until it opens when NVDEC is still possible) and
    `decode_reason` say what was chosen and why. Synthetic streams are generated on the CPU ("synthetic").
    decode: auto on a machine without CUDA is settled here (plain PyAV, nothing else tried at open);
    otherwise the codec decides when the stream opens (streams/nvdec.py resolve_decode). The default, cpu,
    is what callers that predate NVDEC get.

    Raises SourceOpenError naming the stream for anything else FFmpeg would read as a protocol
    (scheme_error): opened by FFmpeg's own protocols it would have no timeout and no reconnect. Whether a
    file exists is checked when it opens (a per-stream error: a file may appear after the config is read).
    decode: cuda on a machine that cannot decode with NVDEC at all (no CUDA, no PyNvVideoCodec) is refused
    here, naming the stream and the fix; a codec NVDEC does not decode is refused when the stream opens.
    ValueError for a `decode` other than auto, cpu, cuda.
    """
    why = scheme_error(url)
    if why:
        raise SourceOpenError(stream_id, why)
    if decode not in nvdec.DECODE_CHOICES:
        raise ValueError(f"decode={decode!r}: allowed: {', '.join(nvdec.DECODE_CHOICES)}")
    scheme = url_scheme(url)
    if scheme == "synthetic":
        source = SyntheticSource(stream_id, url)
        source.decode_reason = "synthetic"  # generated on the CPU
        return source
    network = scheme in NETWORK_SCHEMES
    target = url if network else file_path(url)
    kwargs = {"open_timeout_s": open_timeout_s, "read_timeout_s": read_timeout_s, "max_frame_pixels": max_frame_pixels}
    if decode != "cpu":
        # the machine first (no codec yet): forced cuda fails at add time, auto without CUDA is plain PyAV
        cuda = nvdec.cuda_ops.is_available()
        device, reason = nvdec.resolve_decode(decode, None, cuda_available=cuda,
                                              nvdec_import=nvdec.load_pynvvideocodec, stream_id=stream_id)
        if device == "cuda":
            cls = nvdec.NvdecNetworkSource if network else nvdec.NvdecFileSource
            return cls(stream_id, target, decode=decode, **kwargs)
        nvdec.tell_choice(stream_id, device, reason, cuda_available=cuda)  # once: open_source runs once a stream
    source = (NetworkSource if network else FileSource)(stream_id, target, **kwargs)
    if decode != "cpu":
        source.decode_reason = reason
    return source
