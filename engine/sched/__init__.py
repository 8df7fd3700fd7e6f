"""Pure policies, each with an injected clock and no I/O: what to run next and how much to degrade.

  scheduler.py  earliest-deadline-first batches across streams (drops what cannot meet its deadline)
  latency.py    the online latency model per batch size that the scheduler plans with
  batch_size.py `max_batch: auto`: the largest batch the budget allows, from the measured batch times
  budget_auto.py `budget.latency_ms: auto`: the budget for where the pools run (17 ms on a GPU, on the CPU from
                batch 1's warm-up time), chosen before max_batch auto, which depends on it
  qos.py        a pool's quality of service: the degradation ladder driven by load, with its events
  ladder.py     the ladder's steps (sampling interval, quality level) and hysteresis
  faults.py     the engine-dead policy: too many failures within a window
  tuning.py     worker and thread counts from the machine's cores

Why a package: these are the decisions, kept apart from the threads that act on them, so their tests need
no model, no thread and no sleep. May import: engine.errors, engine.util, engine.config, engine.frames.
"""
