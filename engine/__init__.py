"""vidar engine: the data plane (rings, scheduler, workers, publisher) and its lifecycle.

The folder follows the runtime:
  config.py      typed config, the single source of truth
  frame.py       a frame's metadata and its lifecycle (terminal states carry a reason)
  accounting.py  per-stream counters: ingested == published + dropped + failed + in_flight
  ring.py        bounded, preallocated per-stream frame rings (pinned when CUDA exists)
  scheduler.py   pure earliest-deadline-first batch scheduler with an injected clock
  latency.py     online latency model per batch size
  pool.py        one model pool: pulls frames, asks the scheduler, runs the worker
  workers/       one module per model family (classify = any timm classifier)
  publisher.py   ZeroMQ publisher thread (never blocks the data plane in live mode)
  engine.py      wires sources, rings, pools and the publisher; start/stop state machine
  runtime.py     asyncio/uvloop control plane: signals, status line, offline completion
  client.py      subscriber helper for users
"""

__version__ = "0.1.0"
