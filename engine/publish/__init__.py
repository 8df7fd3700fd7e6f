"""What leaves the engine: results and events over ZeroMQ (publisher.py, in the wire format of schema.py),
the subscriber helper for users (client.py) and the Prometheus metrics (metrics.py).

Why a package: these are the engine's outputs; the data plane hands them typed items and never waits on a
socket. May import: engine.errors, engine.util, engine.security, engine.config, engine.frames.
"""
