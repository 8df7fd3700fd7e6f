"""Ingest in processes (issue 33): streams decoded in child processes, frames handed to the core by reference.

  wire.py        the typed messages between the core and an ingest process (msgspec, one type byte + payload)
  slots.py       core-owned shared-memory slot segments (created, prefaulted and unlinked by the core only)
  process.py     the ingest process: today's IngestThread per stream, writing into lent slots (RemoteRing)
  supervisor.py  ingest process handles, death and hang detection, the restart/quarantine policy
  client.py      the core side: IngestHub, what the engine holds, and its one I/O thread (sockets, reading)
  leases.py      the streams' leases: frames committed into the rings, segments, credits, placement, deaths
  lease.py       one stream's lease, and RemoteIngest (what the stream table reads)
  procs.py       the processes: started, commanded, checked for exits and hangs, ended

Why: one Python thread per stream shared the core's GIL and convoyed (issue 33's measurements). Pixels
never cross a socket: the core owns every slot; a ~100-byte descriptor does.
May import: engine.errors, engine.util, engine.config, engine.frames, streams.
"""
