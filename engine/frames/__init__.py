"""A frame's life in memory, from the moment it is decoded until its slot is free again.

  lifecycle.py   a frame's metadata and its terminal states (every drop and failure has a reason)
  ref.py         FrameRef: how a frame travels from its ring onwards (stream, slot, seq + metadata)
  storage.py     SlotStorage: the one interface to the pixels of a ring's slots (pinned host memory today)
  ring.py        the bounded per-stream ring: slot states, live overwrite, offline back-pressure
  budget.py      one bound on the memory of all rings together
  fanout.py      one stream feeding several pools (a ring per pool)
  accounting.py  the per-pool ledger: ingested == published + dropped + failed + in flight, each counted
  drop_log.py    drops logged in aggregate, never per frame
  ingest.py      the per-stream ingest thread: reads a source (streams/), paces, stamps, writes the ring

Why here: everything that touches a frame's pixels or slot goes through this package; the scheduler, the
pools and the output stage see FrameRefs only. NVDEC's GPU slots (issue 23) are a second SlotStorage.
May import: engine.errors, engine.util, streams.
"""
