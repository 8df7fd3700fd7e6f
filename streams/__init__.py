"""Stream sources: where frames come from (file, network, synthetic) and how a stream is kept alive.

  base.py       the Source interface, the decoded-frame record, and the URL scheme table (open_source)
  synthetic.py  synthetic://shapes, a deterministic moving test pattern (no camera needed)
  pyav.py       files and network streams (rtsp, http, rtmp, udp, srt, ...) through PyAV, timeouts always set
  backoff.py    the reconnect policy: capped exponential backoff with jitter, pure
  runner.py     the per-stream decoder thread: pacing, capture times, ring writes, events, reconnects
"""

from .base import DecodedFrame, Source, open_source, redact_url

__all__ = ["DecodedFrame", "Source", "open_source", "redact_url"]
