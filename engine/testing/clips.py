"""H.264 clips for tests and benchmarks: written from the synthetic pattern, decoded back to RGB frames,
and damaged or re-muxed as a user's files are (corrupt_mdat, faststart; the soak uses them too)."""

from __future__ import annotations

import struct
from pathlib import Path

import av
import numpy as np

from streams.synthetic import SyntheticSource


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


def decode_all(path: Path) -> list[np.ndarray]:
    """Every frame of the file's first video stream, as RGB arrays converted as vidar's CPU decoder converts them
    (streams/convert.py; its agreement with swscale is tests/streams/test_convert.py's)."""
    from streams.convert import to_rgb

    with av.open(str(path)) as c:
        return [to_rgb(f) for f in c.decode(video=0)]


def _mdat(data: bytes) -> tuple[int, int]:
    """(payload start, end) of an mp4's mdat box."""
    off = 0
    while off + 8 <= len(data):
        size, typ = struct.unpack(">I4s", data[off:off + 8])
        hdr = 8
        if size == 1:
            size, hdr = struct.unpack(">Q", data[off + 8:off + 16])[0], 16
        elif size == 0:
            size = len(data) - off
        if typ == b"mdat":
            return off + hdr, off + size
        off += size
    raise RuntimeError("no mdat box")


def corrupt_mdat(src: Path, dst: Path, fraction: float, seed: int) -> dict:
    """Flip `fraction` of the bytes of the mp4's mdat payload (the container boxes stay intact, so the
    file opens and decodes through corrupt packets)."""
    data = bytearray(Path(src).read_bytes())
    start, end = _mdat(bytes(data))
    rng = np.random.default_rng(seed)
    a = start + 64  # keep the first NAL (SPS/PPS, first slice header) readable
    n = int(fraction * (end - a))
    for i in rng.choice(np.arange(a, end), size=n, replace=False):
        data[int(i)] ^= int(rng.integers(1, 256))
    Path(dst).write_bytes(bytes(data))
    return {"mdat_bytes": end - start, "flipped": n}


def faststart(src: Path, dst: Path) -> Path:
    """Re-mux with the index (moov) first, as streaming-friendly files are: a cut file still opens."""
    with av.open(str(src)) as inp, av.open(str(dst), "w", options={"movflags": "faststart"}) as out:
        ost = out.add_stream_from_template(inp.streams.video[0])
        for pkt in inp.demux(inp.streams.video[0]):
            if pkt.dts is None:
                continue
            pkt.stream = ost
            out.mux(pkt)
    return Path(dst)
