"""Corrupt and re-muxed media for tests and the soak: real H.264 with damage a user's files have."""

from __future__ import annotations

import struct
from pathlib import Path

import av
import numpy as np


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
