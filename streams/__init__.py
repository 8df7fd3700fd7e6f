"""Stream sources: where frames come from (file, RTSP, synthetic) and how a stream is kept alive.

  base.py       the Source interface and the decoded-frame record
  synthetic.py  synthetic://shapes, a deterministic moving test pattern (no camera needed)
  pyav.py       files and RTSP through PyAV (FFmpeg), with timeouts always set
  runner.py     the per-stream decoder thread: pacing, ring writes, events, reconnect backoff
"""

from .base import DecodedFrame, Source, open_source, redact_url

__all__ = ["DecodedFrame", "Source", "open_source", "redact_url"]
