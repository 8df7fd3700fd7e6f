"""The live view: a web page of the streams with their results drawn on the same frames, latency
charts, draw-to-track, and a JSON API over the control path (see server.py)."""
