"""The pools' execution: each pool's dispatch (pool.py), its worker threads (worker_thread.py) and their
watchdog (worker_slots.py), and its output stage (output_stage.py); supervise.py restarts the other
long-lived threads and tasks under the same fault policy. fence.py is the one guard against a thread
the watchdog gave up on: its late work never commits.

Why a package: this is the part that runs threads. The pool is stepped by the engine core (its one
owner), hands batches (messages.py) to worker threads and results to the output stage.
May import: engine.errors, engine.util, engine.config, engine.frames, engine.sched, engine.models,
engine.publish.
"""
