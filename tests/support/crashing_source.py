"""A source that crashes its ingest process on purpose: imported in ingest processes only, through
engine.ingest.procs.TEST_IMPORTS (a test hook; the product never sets it). Streams whose id starts with
`segv` deliver 10 frames, then the process raises SIGSEGV on itself (as a crash inside FFmpeg would); streams
whose id starts with `boom` raise a RuntimeError (not a SourceError) when opened; streams whose id starts with
`slow` take 25 ms to make each frame (a decoder slower than its stream), so a paced one falls ever further
behind. The product's URL parser knows nothing of any of them."""

from __future__ import annotations

import os
import signal
import time

import streams.sources as sources
from streams.synthetic import SyntheticSource

_open = sources.open_source


class _Segfaulting(SyntheticSource):
    def frames(self):
        for n, frame in enumerate(super().frames()):
            if n == 10:
                os.kill(os.getpid(), signal.SIGSEGV)
            yield frame


class _Slow(SyntheticSource):
    def frames(self):
        for frame in super().frames():
            time.sleep(0.025)
            yield frame


def _open_source(stream_id, url, **kwargs):
    if stream_id.startswith("boom"):
        raise RuntimeError("a bug in a decoder's open, on purpose")
    source = _open(stream_id, url, **kwargs)
    if stream_id.startswith("segv") and isinstance(source, SyntheticSource):
        source.__class__ = _Segfaulting
    if stream_id.startswith("slow") and isinstance(source, SyntheticSource):
        source.__class__ = _Slow
    return source


sources.open_source = _open_source
