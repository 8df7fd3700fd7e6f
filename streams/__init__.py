"""Stream sources: where frames come from (file, network, synthetic) and how they are decoded.

  urls.py       the URL rules: which strings vidar opens, and credentials kept out of every text shown
  base.py       the Source interface and the decoded-frame record
  synthetic.py  synthetic://shapes, a deterministic moving test pattern (no camera needed)
  pyav.py       files and network streams (rtsp, http, rtmp, udp, srt, ...) through PyAV, timeouts always set
  nvdec.py      the same demuxing, decoded by NVDEC (PyNvVideoCodec) into GPU memory; `decode: auto|cpu|cuda`
  sources.py    open_source: the table from a URL's scheme to its Source
  backoff.py    the reconnect policy: capped exponential backoff with jitter, pure

What it may import: `engine.errors` (the typed errors every package shares) and nothing else of the engine.
The thread that reads a source into the engine's rings is the engine's (engine/frames/ingest.py), so
nothing here knows about rings, pools or the engine core; the engine imports streams, never the reverse.
"""

from streams.base import DecodedFrame, Source
from streams.sources import open_source
from streams.urls import redact_url

__all__ = ["DecodedFrame", "Source", "open_source", "redact_url"]
