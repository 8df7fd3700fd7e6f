"""A decoder too slow for its camera: imported in ingest processes only, through engine.ingest.procs.TEST_IMPORTS (a
test hook; the product never sets it). Network streams whose id starts with `slowdec` take two frame intervals to
decode each frame (half the camera's rate), so their packets wait in the socket's buffer, as at 48 cameras on 2
cores. The time goes on decoded frames only: a packet skipped undecoded costs nothing, as in the product."""

from __future__ import annotations

import time

import streams.sources as sources
from streams.pyav import NetworkSource

_open = sources.open_source


class _SlowDecode(NetworkSource):
    def _decode(self, packets):
        for frame in super()._decode(packets):
            time.sleep(2.0 / (self.fps or 30.0))
            yield frame


def _open_source(stream_id, url, **kwargs):
    source = _open(stream_id, url, **kwargs)
    if stream_id.startswith("slowdec") and type(source) is NetworkSource:
        source.__class__ = _SlowDecode
    return source


sources.open_source = _open_source
