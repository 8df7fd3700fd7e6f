"""vidar's engine. The folders follow the runtime, from what a frame meets first to what talks to users:

  frames/    a frame's life in memory: the per-stream ingest thread, rings and their slot storage,
             fan-out, the ledger (ingested == published + dropped + failed + in flight)
  sched/     pure policies with an injected clock: EDF batches, latency model, QoS ladder, faults, tuning
  models/    model runners, one module per family (classify: any timm model; sam2; noop)
  executor/  each pool: dispatch, worker threads and their watchdog, the output stage
  publish/   what leaves: results and events over ZeroMQ, the subscriber helper, metrics
  core/      the Engine facade, the one thread that owns the state, its typed requests, the stream table
  control/   the control plane: asyncio runtime and the control socket
  view/      the live view in a browser;  cluster/  the same config scaled out on Ray
  cli.py     the `vidar` command, above everything
  config.py  typed config, the single source of truth;  errors.py  the typed errors every package shares
  security/  the rule every listening socket obeys, and CURVE keys;  util/  thread and memory helpers
  testing/   helpers for tests and benchmarks (never imported by the engine)

Which package may import which is a table in the README's Layout section, checked by tests/test_layout.py.
Video sources and decoders are the sibling package `streams/`, which imports nothing of the engine but
`engine.errors`.
"""

__version__ = "0.2.0"
