"""The engine's streams: each one's rings (one per pool it feeds), decoder thread, and lifecycle.

Owned by the engine core thread: `add`, `remove`, `poll` and `stop_all` run only there (other
threads send the core an AddStream or a RemoveStream request through `EngineCore.submit`), so a
removal can never race a batch in flight. Other threads read `snapshot()` (a list copy) for status
lines and metrics.

A stream's eos is queued at the publisher once no pool it feeds holds any of its frames (its
rings are closed and empty, nothing in a scheduler, on a worker or in an output stage), so it
follows the stream's last result. A removed stream is forgotten (counters, metric series,
outbox) once its eos has been sent; an add of the same id waits for that.

A stream added at run time that ends by itself (a finite file, a failure) is forgotten the same way,
`ended_keep_s` after its eos went out or as soon as more than `max_ended` such streams are kept
(oldest first), so that accepted adds cannot pile up entries, rings, metric series and view slots for
ever (issue 31); `max_streams` counts running streams only. Its final state goes into `ended`, a
history of the last `max_ended`, which `list` returns. The config's own streams are kept (they are
at most `max_streams`, and `vidar run` prints their final progress), and so is everything once the
engine stops or dies (the final status and eos reasons), and in a cluster's engines (`keep_ended`:
the controller reconciles against `list` and would take a forgotten stream for a lost one).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

from engine.core import auto_rate
from streams import open_source, redact_url
from streams.nvdec import nvdec_possible
from engine.frames.ingest import IngestThread

from engine.security.binds import stream_exposure_error
from engine.config import EngineConfig, StreamConfig
from engine.errors import ControlError, SourceError
from engine.frames.fanout import RingGroup
from engine.frames.lifecycle import DropReason
from engine.frames.budget import FrameMemoryBudget, total_memory_bytes
from engine.executor.pool import Pool
from engine.publish.publisher import Publisher
from engine.frames.ring import FrameRing
from engine.frames.storage import SharedHostSlots
from engine.util.threads import settle

log = logging.getLogger("vidar.engine")


def lag_of(e: "StreamEntry") -> Optional[float]:
    """A live network stream's lag behind its camera (seconds, rounded to the ms), from its ingest thread or, in a
    process, its last StreamState; None for other streams and before its first packet."""
    lag = getattr(e.ingest, "lag_s", None) if e.ingest is not None else None
    return None if lag is None else round(lag, 3)


@dataclass(eq=False)
class StreamEntry:
    cfg: StreamConfig
    pools: list[str]
    rings: dict[str, FrameRing] = field(default_factory=dict)
    ingest: Optional[IngestThread] = None
    state: str = "running"            # running | ended | removing
    failed: bool = False
    reason: str = ""                  # why it ended, when the engine decided (removed, shutdown, error)
    eos_queued: bool = False
    eos_sent: bool = False
    removal: Optional[Future] = None  # resolved when the eos of a removed stream is queued
    reap_by: float = 0.0              # monotonic: a removed stream's decoder thread should have ended by then
    eos_reason: str = ""              # the reason its eos carried
    ended_at: float = 0.0             # monotonic, when its eos was sent (an ended stream is kept from then)
    ended_wall: float = 0.0           # the same moment, wall clock (shown in the history)
    kept: bool = False                # a stream of the config: never forgotten by itself

    @property
    def id(self) -> str:
        return self.cfg.id

    @property
    def display_state(self) -> str:
        if self.state == "removing":
            return "removing"
        if self.failed:
            return "failed"
        return self.ingest.state if self.ingest else self.state


class StreamTable:
    def __init__(self, cfg: EngineConfig, pools: dict[str, Pool], publisher: Publisher,
                 emit: Callable[[str, str, str], None], wake: Callable[[], None], view=None,
                 keep_ended: bool = False, ingest_hub=None, frames_ready: Optional[Callable[..., None]] = None):
        self.cfg, self._pools, self._publisher, self._emit, self._wake = cfg, pools, publisher, emit, wake
        # the rings' notify: (n frames committed) -> the core, which may let them wait for the batch's step
        self._frames_ready = frames_ready or (lambda n=1: wake())
        self._hub = ingest_hub  # engine/ingest/client.IngestHub when ingest.processes != 0, else None (threads)
        self._told_threads: set[str] = set()  # why some streams stay threads, logged once per reason
        self._view = view  # the live view's hub, or None
        self._entries: dict[str, StreamEntry] = {}
        # The streams poll() looks at: those with a ring closed (FrameRing.on_close, any thread), removed, stopped
        # or ended, until forgotten. A running stream has nothing to poll for; looking at all of them on every core
        # step was ~1/8 of the core's work per frame at 48 streams. Set from other threads, read on the core's
        # (list() of a dict is one C call under the GIL); only the core thread takes entries out.
        self._watch: dict[StreamEntry, None] = {}
        self._deferred: list[tuple[StreamConfig, Future]] = []  # adds waiting for a removed id to go
        self.frame_budget = FrameMemoryBudget(total_memory_bytes(cfg.ring.total_memory_mb))
        self.dead_reason: Optional[str] = None
        # A removed stream is forgotten only once its decoder thread has ended (polled here, never
        # joined: the core thread must not block), so removals cannot pile up threads. Bound: the
        # longest a source may legitimately stay blocked after a stop, an open or a read of a hung
        # network peer (PyAV gives up after ~2x its timeout, shared/STACK.md), plus slack. A thread
        # still alive then (a read on a hung network filesystem) is logged, counted, and let go.
        src = cfg.source
        self.reap_bound_s = 2 * (src.open_timeout_s + src.stall_timeout_s) + 5.0
        self.stuck_decoders = 0  # decoder threads that outlived reap_bound_s after their stream was removed
        # Ended streams (see the module docstring): what is left of the forgotten ones. The deque is
        # appended on the core thread and copied by the control socket's and the view's threads: a lock.
        self.keep_ended = keep_ended
        self._ended: deque[dict] = deque(maxlen=cfg.max_ended)
        self._ended_lock = threading.Lock()
        self.forgotten = {"ended": 0, "failed": 0}  # ended streams forgotten so far (the history keeps the last)
        self._stopping = False  # stop_all ran: nothing more is forgotten (the final status shows every stream)

    # -- reads (any thread) --------------------------------------------------------------------
    def snapshot(self) -> list[StreamEntry]:
        return list(self._entries.values())

    def get(self, stream: str) -> Optional[StreamEntry]:
        return self._entries.get(stream)

    def ended(self) -> list[dict]:
        """The final state of the last `max_ended` streams forgotten after they ended, oldest first."""
        with self._ended_lock:
            return [dict(r) for r in self._ended]

    # -- core thread ------------------------------------------------------------------------------
    def add(self, scfg: StreamConfig, fut: Optional[Future] = None) -> Future:
        """Start a stream. The future resolves when it runs, or with a ControlError."""
        fut = fut or Future()
        old = self._entries.get(scfg.id)
        if old is not None and old.state == "running":
            settle(fut, exc=ControlError(f"add_stream: stream id {scfg.id!r} is already running; remove it first"))
            return fut
        if old is not None and old.state == "ended":
            kept = "(a stream of the config)" if old.kept else "until removed" if self.keep_ended else \
                f"for ended_keep_s={self.cfg.ended_keep_s:g} s"
            settle(fut, exc=ControlError(f"add_stream: stream id {scfg.id!r} has ended and stays listed {kept}; "
                                         "remove it first to use its id again"))
            return fut
        self._forget_ended()  # first: what may go now leaves room, and the bound holds at every add
        running = sum(self._holds_a_slot(e) for e in self._entries.values())
        if running >= self.cfg.max_streams:
            settle(fut, exc=ControlError(f"add_stream: max_streams={self.cfg.max_streams} streams are running (or "
                                         "still sending their eos); remove one first or raise max_streams"))
            return fut
        pools = scfg.pools or list(self._pools)
        unknown = [p for p in pools if p not in self._pools]
        if unknown:
            settle(fut, exc=ControlError(f"add_stream: stream.pools: {unknown} not configured; "
                                           f"configured: {sorted(self._pools)}"))
            return fut
        # identity, not equality: an add_stream request builds a new StreamConfig even for the same values
        kept = any(s is scfg for s in self.cfg.streams)
        url, why = auto_rate.resolve(scfg.url, self._pools, pools, self._streams_per_pool())
        if why is not None:  # synthetic fps=auto: the rate its pools keep up with, said at start
            log.info("stream %s: synthetic fps=auto -> %s", scfg.id, why)
            scfg = scfg.model_copy(update={"url": url})
        if old is not None:  # the same id is still being removed: start once its eos is out
            self._deferred.append((scfg, fut))
            return fut
        # All or nothing: the source is built (its URL and parameters checked) before anything is
        # registered, so a refused add leaves no stream behind (no entry, ring, view slot or thread) and
        # its id free. (Registering first left a "running" stream that published nothing and held its id.)
        listening = stream_exposure_error(scfg.url, self.cfg.security.allow_insecure_bind)
        if listening:
            settle(fut, exc=ControlError(f"add_stream: stream.url: {listening}"))
            return fut
        src = self.cfg.source
        decode, rgb_only = scfg.decode or src.decode, self._rgb_only_pools(pools)
        if rgb_only and decode == "cuda":
            settle(fut, exc=ControlError(f"add_stream: stream.decode: cuda, but pool(s) {rgb_only} read RGB frames "
                                         "only (NVDEC frames are NV12 in GPU memory): set decode: cpu or auto, "
                                         "or feed this stream to NV12-capable pools only (stream.pools)"))
            return fut
        try:
            source = open_source(scfg.id, scfg.url, open_timeout_s=src.open_timeout_s,
                                 read_timeout_s=src.stall_timeout_s / 2, max_frame_pixels=self.cfg.ring.max_frame_pixels,
                                 decode="cpu" if rgb_only else decode)
            if rgb_only and decode == "auto" and source.decode_reason == "decode: cpu":  # not "synthetic"
                source.decode_reason = f"auto: pool(s) {rgb_only} read RGB frames only"
        except SourceError as err:
            settle(fut, exc=ControlError(f"add_stream: stream.url: {err.reason}"))
            return fut
        except Exception as err:  # a bug in a source's checks: refused all the same, and said
            log.exception("stream %s: building its source failed", scfg.id)
            settle(fut, exc=ControlError(f"add_stream: stream.url: internal error: "
                                         f"{redact_url(f'{type(err).__name__}: {err}')}"))
            return fut
        try:
            self._start(scfg, pools, source, kept=kept)
        except SourceError as err:  # its frames would not fit the frame memory, or its start failed (undone)
            settle(fut, exc=ControlError(f"add_stream: {err.reason}"))
            return fut
        settle(fut, scfg.id)
        return fut

    def _streams_per_pool(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._entries.values():
            if e.state == "running":
                for name in e.pools:
                    out[name] = out.get(name, 0) + 1
        return out

    def _start(self, scfg: StreamConfig, pools: list[str], source, kept: bool = False) -> None:
        entry = StreamEntry(scfg, pools, kept=kept)
        live = scfg.mode == "live"
        r = self.cfg.ring
        remote = self._in_process(scfg, pools, source)
        for name in pools:
            pool = self._pools[name]
            entry.rings[name] = FrameRing(scfg.id, live=live, accounting=pool.acct, memory_bytes=r.memory_mb * 2 ** 20,
                                          min_slots=r.min_slots, max_slots=r.max_slots,
                                          max_frame_pixels=r.max_frame_pixels, notify=self._frames_ready,
                                          max_interval=scfg.max_interval, budget=self.frame_budget,
                                          # in a process, the first pool's slots are the segment it writes;
                                          # the others' are the engine's own, filled by the hub (leases.py)
                                          storage=SharedHostSlots(self._pixel_format(pools, source))
                                          if remote and not entry.rings else None)
            if self._view is not None:
                entry.rings[name].tap = functools.partial(self._view.capture, pool=name)
            entry.rings[name].on_close = functools.partial(self._watch.__setitem__, entry, None)
        if not pools:  # nothing to close: done as soon as polled
            self._watch[entry] = None
        size = getattr(source, "frame_size", None)  # (w, h) known before opening (synthetic sources)
        if size is not None:
            try:
                for ring in entry.rings.values():
                    ring.reserve_for(size[1], size[0])
            except SourceError:
                for ring in entry.rings.values():
                    ring.close()  # gives back what the others reserved
                raise
        # registered, attached, its decoder started; anything that fails here (a thread that cannot be
        # started when the process is out of threads) is undone, so the add stays all or nothing
        try:
            if self._view is not None:
                self._view.expect(scfg.id, pools)
            self._entries[scfg.id] = entry
            self._publisher.note_mode(scfg.id, live)  # its events wait for a full subscriber only if offline
            for name in pools:
                self._pools[name].attach(entry.rings[name])
            rings = list(entry.rings.values())
            sink = rings[0] if len(rings) == 1 else RingGroup(rings)
            src = self.cfg.source
            if remote:
                entry.ingest = self._hub.add(scfg, rings[0], source, fanout=tuple(rings[1:]))
            else:
                entry.ingest = IngestThread(source, sink, live=live, loop=scfg.loop,
                                            budget_s=self.cfg.budget.latency_ms / 1e3, emit=self._emit,
                                            reconnect_initial_s=src.reconnect_initial_s,
                                            reconnect_max_s=src.reconnect_max_s,
                                            backoff_reset_after_s=src.backoff_reset_after_s)
            entry.ingest.start()
        except Exception as err:
            log.exception("stream %s: starting it failed; undone", scfg.id)
            self._undo(entry)
            raise SourceError(scfg.id, f"could not be started: {redact_url(f'{type(err).__name__}: {err}')}") from None

    def _in_process(self, scfg: StreamConfig, pools: list[str], source) -> bool:
        """Whether the stream is decoded in an ingest process (else a thread here, as before issue 33)."""
        if self._hub is None:
            return False
        why = None
        if nvdec_possible(source):
            # NV12 copied from the GPU into host slots (ingest.gpu_transport shm). Zero copy between processes (the
            # CUDA IPC slot pool, engine/ingest/cuda_slots.py) has run on the CPU with fakes only and the hub does not
            # lend such pools yet: `threads` keeps NV12 in GPU memory, in the engine process.
            if self.cfg.ingest.gpu_transport == "threads":
                why = ("streams that may decode with NVDEC (decode auto/cuda on a CUDA machine) are threads in the "
                       "engine process (ingest.gpu_transport: threads)")
            elif len(pools) != 1:
                why = ("a stream that may decode with NVDEC and feeds several pools is a thread in the engine process "
                       "(ingest.gpu_transport shm takes one pool a stream)")
        if why is None:
            return True
        if why not in self._told_threads:
            self._told_threads.add(why)
            log.info("stream %s: %s", scfg.id, why)
        return False

    def _pixel_format(self, pools: list[str], source) -> str:
        """What the stream's ingest process writes into its slots (ingest.pixel_format): NV12 as decoded, with no colour
        conversion, when its one pool's runners take NV12 (they convert it in their batched preprocessing, or read
        no pixels) and its decoder can hand NV12 out; RGB otherwise. One pool only: the hub copies a stream feeding
        several into the others' RGB rings (leases.py)."""
        if nvdec_possible(source):  # NVDEC gives NV12 (its pools take NV12, else it decodes on the CPU: add)
            return "nv12"
        if self.cfg.ingest.pixel_format == "rgb24" or len(pools) != 1 or "nv12" not in source.host_formats:
            return "rgb24"
        return "nv12" if all(getattr(m, "accepts_nv12", False) for m in self._pools[pools[0]].spec.models) else "rgb24"

    def _undo(self, entry: StreamEntry) -> None:
        """A start that failed half-way: the stream is as if never added (its id free, nothing held)."""
        for name in entry.pools:
            pool = self._pools[name]
            if pool.rings.get(entry.id) is entry.rings.get(name):
                pool.detach(entry.id, DropReason.STREAM_REMOVED)
            pool.acct.forget(entry.id)
        for ring in entry.rings.values():
            ring.close()
        self._entries.pop(entry.id, None)
        self._watch.pop(entry, None)
        self._publisher.forget(entry.id)
        if self._view is not None:
            self._view.forget(entry.id)

    def remove(self, stream: str, reason: str = "removed") -> Future:
        """Stop a stream: its decoder stops, frames queued in rings and schedulers are dropped
        (stream_removed), frames on workers are dropped by the output stages or were published before,
        then one eos with `reason` ("removed"; a cluster moving the stream says "relocated: ..."). The
        future resolves when that eos is queued."""
        entry = self._entries.get(stream)
        if entry is None or entry.state == "removing":
            fut: Future = Future()
            live = sorted(s for s, e in self._entries.items() if e.state != "removing")
            settle(fut, exc=ControlError(f"remove_stream: unknown stream {stream!r}; streams: {live}"))
            return fut
        entry.removal = Future()
        entry.reap_by = time.monotonic() + self.reap_bound_s
        self._watch[entry] = None
        if entry.eos_queued:  # it had ended already: its eos is out (or on its way); just forget it
            entry.state = "removing"
            if entry.ingest:
                entry.ingest.stop()  # idempotent: a thread still on its way out is not left blocked
            entry.removal.set_result(None)
            return entry.removal
        entry.state, entry.reason = "removing", reason
        if entry.ingest:
            entry.ingest.stop()
        for name in entry.pools:
            self._pools[name].detach(stream, DropReason.STREAM_REMOVED)
        log.info("stream %s removed", stream)
        return entry.removal

    def stop_all(self, reason: str) -> None:
        """Shutdown or engine death: decoders stop, rings close; what was decoded is still processed
        (drain) unless the pools are aborted."""
        self._stopping = True
        for entry in self._entries.values():
            self._watch[entry] = None
            if not entry.reason and not entry.eos_queued:
                entry.reason = reason
            if entry.ingest:
                entry.ingest.stop()
            else:
                for ring in entry.rings.values():
                    ring.close()

    def poll(self) -> None:
        """Queue the eos of every stream that is done, forget removed streams whose eos went out and
        ended ones past their keep (time or count)."""
        for entry in list(self._watch):
            if self._entries.get(entry.id) is not entry:  # forgotten (or undone)
                self._watch.pop(entry, None)
                continue
            if not entry.eos_queued and self._done(entry):
                self._queue_eos(entry)
            if entry.state == "removing" and entry.eos_sent and self._reaped(entry):
                self._forget(entry)
        self._forget_ended()

    @staticmethod
    def _holds_a_slot(e: StreamEntry) -> bool:
        """Counted against max_streams: a running stream, and one that ended but is not done yet (its eos
        still queued, its decoder thread still leaving), so that the streams listed stay within
        max_streams + max_ended + the config's own, at every add."""
        if e.state == "running":
            return True
        return e.state == "ended" and not (e.eos_sent and (e.ingest is None or not e.ingest.alive))

    def _forget_ended(self) -> None:
        """Streams added at run time that ended by themselves go after ended_keep_s, or oldest first while
        more than max_ended are kept; their final state goes into the history."""
        if self.keep_ended or self._stopping or self.dead_reason:
            return
        # every ended stream is watched (it ended in poll): the running ones need not be looked at
        done = sorted((e for e in list(self._watch) if e.state == "ended" and e.eos_sent and not e.kept
                       and self._entries.get(e.id) is e), key=lambda e: e.ended_at)
        if not done:
            return
        excess, now = len(done) - self.cfg.max_ended, time.monotonic()
        for i, entry in enumerate(done):
            if i >= excess and now - entry.ended_at < self.cfg.ended_keep_s:
                break  # sorted: every later one ended later still
            if self._reaped(entry):  # its decoder thread is gone (it normally is: the stream ended)
                self._record(entry)
                self._forget(entry)

    def _record(self, entry: StreamEntry) -> None:
        failed = entry.failed or (entry.ingest is not None and entry.ingest.failed)
        counts = {}
        for name in entry.pools:
            s = self._pools[name].acct.snapshot(entry.id)
            counts[name] = {"ingested": s.ingested, "published": s.published, "dropped": dict(s.dropped),
                            "failed": dict(s.failed)}
        # the reason is bounded (an error text may quote a long URL) and, like every shown text, redacted
        rec = {"id": entry.id, "url": redact_url(entry.cfg.url), "mode": entry.cfg.mode,
               "state": "failed" if failed else "ended", "reason": redact_url(entry.eos_reason)[:500],
               "counts": counts, "ended_at": round(entry.ended_wall, 3)}
        with self._ended_lock:
            self._ended.append(rec)
        self.forgotten[rec["state"]] += 1
        log.info("stream %s %s (%s) and is forgotten; its final state stays in list's ended", entry.id,
                 rec["state"], rec["reason"])

    def _done(self, entry: StreamEntry) -> bool:
        # A closed ring takes no more frames (its decoder thread may still be leaving a blocking read).
        return all(self._pools[name].stream_idle(entry.id) for name in entry.pools)

    def _queue_eos(self, entry: StreamEntry) -> None:
        entry.eos_queued = True
        self._watch[entry] = None
        ingest = entry.ingest
        if ingest is not None and ingest.failed:
            entry.failed = True
        if entry.state == "running":
            entry.state = "ended"
        if entry.state == "removing":
            reason = entry.reason
        elif self.dead_reason:
            reason = self.dead_reason
        elif ingest is not None and ingest.end_reason not in ("", "stopped"):  # it ended by itself
            reason = ingest.end_reason
        else:
            reason = entry.reason or "end of stream"
        entry.eos_reason = reason

        def sent() -> None:  # publisher thread; the core reads ended_at only once eos_sent is true
            entry.ended_at, entry.ended_wall = time.monotonic(), time.time()
            if entry.state != "removing":  # a removal set its own bound
                entry.reap_by = entry.ended_at + self.reap_bound_s
            entry.eos_sent = True
            self._wake()

        def counts() -> dict:  # read when the eos is sent: every result before it has ended by then
            snaps = {name: self._pools[name].acct.snapshot(entry.id) for name in entry.pools}
            return {"counts": {name: {"ingested": s.ingested, "published": s.published, "dropped": s.dropped,
                                      "failed": s.failed} for name, s in snaps.items()}}
        self._publisher.submit_event(entry.id, "eos", reason, on_sent=sent, fields=counts)
        if entry.removal is not None:
            settle(entry.removal)

    def _reaped(self, entry: StreamEntry) -> bool:
        """The removed stream's decoder thread has ended, or will be let go (loudly) after reap_bound_s."""
        ingest = entry.ingest
        if ingest is None or not ingest.alive:
            return True
        if time.monotonic() < entry.reap_by:
            return False
        self.stuck_decoders += 1
        log.error("stream %s: decoder thread still running %.0f s after the stream was removed or ended (blocked in a "
                  "read that cannot be interrupted?): forgetting the stream, leaving the thread behind "
                  "(%d such threads so far)", entry.id, self.reap_bound_s, self.stuck_decoders)
        return True

    def _forget(self, entry: StreamEntry) -> None:
        del self._entries[entry.id]
        self._watch.pop(entry, None)
        for name in entry.pools:
            pool = self._pools[name]
            # A stream that ended by itself (or was removed after it ended) is still attached: its closed,
            # empty ring, the pool's holder for it, the scheduler's, ladder's and output stage's state go now
            # (nothing of it is left to drop: its eos went out after every frame ended).
            if pool.rings.get(entry.id) is entry.rings.get(name):
                pool.detach(entry.id, DropReason.STREAM_REMOVED)
            pool.acct.forget(entry.id)
        self._publisher.forget(entry.id)
        if self._view is not None:
            self._view.forget(entry.id)
        for scfg, fut in [d for d in self._deferred if d[0].id == entry.id]:
            self._deferred.remove((scfg, fut))
            if not fut.cancelled():  # the caller gave up waiting and was told it failed
                self.add(scfg, fut)

    def all_done(self) -> bool:
        return all(e.eos_queued for e in self._entries.values())

    def _rgb_only_pools(self, pools: list[str]) -> list[str]:
        """The pools among `pools` whose runners cannot read NV12 GPU slots (any pool on the CPU): a
        stream feeding one is decoded on the CPU, since its frames go into every pool's ring alike."""
        return [p for p in pools if not all(getattr(m, "accepts_nv12", False) for m in self._pools[p].spec.models)]

    def describe(self, e: StreamEntry) -> dict:
        """`e` from snapshot(): by entry, not id, since the core may forget the stream meanwhile."""
        source = e.ingest.source if e.ingest is not None else None
        return {"url": redact_url(e.cfg.url), "mode": e.cfg.mode, "state": e.display_state, "pools": list(e.pools),
                # where it is decoded: "ingest-2 (pid 1234)", or "engine" for a thread in the engine process
                "process": getattr(e.ingest, "process", "engine"),
                # where its video is decoded and why (auto falls back to the CPU with a reason)
                "decode": {"device": getattr(source, "decode_device", None),
                           "reason": getattr(source, "decode_reason", "")},
                # a live network stream: how far behind its camera it is read, seconds (streams/clock.py); else None
                "lag_s": lag_of(e)}
