"""The streams' leases and what their messages do (the I/O thread's only): frames committed into the rings,
events and states passed on, segments made for each geometry, free slots lent back as credits, placement on a
process, and what a process's death means for the streams it held.

A process death: its streams' lent slots are reclaimed (frames it delivered stay READY and are published), each
stream is announced `reconnecting` naming the reason, and placed again at once (RestartPolicy decides restart,
quarantine or fail).
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import time
from typing import Any, Callable, Optional

from engine.config import EngineConfig, StreamConfig
from engine.errors import SourceError
from engine.frames.lifecycle import DropReason, FrameMeta
from engine.frames.ring import FrameRing
from engine.ingest import wire
from engine.ingest.cuda_slots import PendingFrames
from engine.ingest.lease import Lease, RemoteIngest
from engine.ingest.procs import ProcessManager
from engine.ingest.slots import Segment, ShmSpaceError, segment_name
from engine.ingest.supervisor import IngestProcess, RestartPolicy
from streams.nvdec import nvdec_possible

log = logging.getLogger("vidar.ingest")


class Leases:
    def __init__(self, cfg: EngineConfig, run: str, procs: ProcessManager, *, emit: Callable[[str, str, str], None],
                 submit: Callable[..., None]):
        self.cfg, self._run, self._procs, self._emit, self._submit = cfg, run, procs, emit, submit
        ic = cfg.ingest
        self.leases: dict[str, Lease] = {}  # the I/O thread's, but for add (before it is submitted)
        # Lease generations come from one counter for the whole hub, never per lease: a stream removed and added
        # again under the same id starts above every generation its old lease used, so a leftover of the old
        # one still in a socket can never pass for the new one's.
        self._gens = itertools.count(1)
        self.policy = RestartPolicy(ic.max_restarts, ic.restart_window_s)
        self.pending = PendingFrames()  # CUDA IPC frames whose copy is not done yet (none for host slots)
        self.stale_descriptors = 0   # FrameReady of a dead or superseded generation: dropped, never committed
        self.bad_messages = 0        # messages that named a slot or a type we do not know
        self.restarts = 0            # ingest processes that died and whose streams were placed again
        self.to_wake: Optional[FrameRing] = None  # a ring committed to since the core was last woken
        self.to_wake_frames = 0  # frames committed since then

    # -- the core thread ---------------------------------------------------------------------------------------
    def add(self, scfg: StreamConfig, ring: FrameRing, source: Any, fanout: tuple[FrameRing, ...] = ()) -> RemoteIngest:
        """Core thread: a stream to decode in a process (started by RemoteIngest.start). `ring` is the first pool's,
        whose slots the process writes; `fanout`, the other pools' rings (a stream feeding several pools)."""
        remote = RemoteIngest(self._submit, source, ring, scfg.mode == "live", fanout)
        size = getattr(source, "frame_size", None)
        lease = Lease(scfg, ring, remote, size=(size[1], size[0]) if size else None, fanout=tuple(fanout),
                      decode=source.decode if nvdec_possible(source) else "cpu")
        # a generation of its own from the start (next() on the shared counter is atomic under the GIL): until it
        # is placed, a message of an older lease of the same id (a process still ending it) is stale, not its
        lease.gen = lease.assign_gen = next(self._gens)
        # a freed slot is lent back at the I/O thread's next wake-up; it wakes for it only when the process holds
        # no lent slot of the stream (else its next FrameReady wakes it: one wake-up a frame fewer)
        ring.on_free = lambda held, s=scfg.id: self._submit(("credit", s), wake=not held)
        if scfg.mode != "live":  # an offline stream's credit waits for room in every pool's ring (_lend)
            for other in fanout:
                other.on_free = lambda held, s=scfg.id: self._submit(("credit", s))
        self.leases[scfg.id] = lease
        return remote

    # -- messages ------------------------------------------------------------------------------------------------
    def handle(self, msg: Any, touched: set[str]) -> None:
        """A stream's message from a process (FrameReady, Geometry, StreamEvent, StreamState)."""
        lease = self.leases.get(msg.stream)
        if lease is None or msg.gen < lease.assign_gen:  # a stream gone, or a dead process's leftovers
            if isinstance(msg, wire.FrameReady):
                self.stale_descriptors += 1
            return
        if isinstance(msg, (wire.FrameReady, wire.StreamState)):
            d = msg.dropped - lease.dropped_seen
            if d > 0:
                for ring in lease.rings:  # every pool's ledger counts the stream's frames
                    ring.drop_at_source(d)
                lease.dropped_seen = msg.dropped
            e = msg.expired - lease.expired_seen
            if e > 0:
                for ring in lease.rings:
                    ring.drop_at_source(e, DropReason.DEADLINE)
                lease.expired_seen = msg.expired
        if isinstance(msg, wire.FrameReady):
            self._commit(lease, msg)
            touched.add(lease.stream)
        elif isinstance(msg, wire.Geometry):
            self._geometry(lease, msg.h, msg.w, msg.gen)
        elif isinstance(msg, wire.StreamEvent):
            self._event(lease, msg.kind, msg.reason)
        elif isinstance(msg, wire.StreamState):
            self._state(lease, msg)

    def _commit(self, lease: Lease, msg: wire.FrameReady) -> None:
        if msg.gen != lease.gen:  # lent under an older geometry or assignment: the slot is not its any more
            self.stale_descriptors += 1
            return
        meta = FrameMeta(msg.stream, msg.seq, msg.pts, msg.t_capture, decode_s=msg.decode_s, deadline=msg.deadline,
                         height=msg.h, width=msg.w, t_capture_mono=msg.t_capture_mono, colour=tuple(msg.colour),
                         t_written=msg.t_written)
        written = lease.ring.written_event(msg.slot)
        if written is None:  # shared host memory: the pixels are there when the descriptor is
            self._admit(lease, msg, meta)
        else:  # a CUDA IPC slot (cuda_slots.py): committed once a host poll sees the GPU copy done, never waited on
            self.pending.add(msg.stream, msg.gen, msg.slot, written, lambda: self._admit(lease, msg, meta))

    def _admit(self, lease: Lease, msg: wire.FrameReady, meta: FrameMeta) -> bool:
        metas = [dataclasses.replace(meta, extra=dict(meta.extra)) for _ in lease.fanout]  # before commit stamps it
        # the core is woken once per drained batch, not per frame (its Condition.notify was 15 us of GIL a frame)
        if lease.ring.commit(msg.slot, meta, notify=False):
            self._fan_out(lease, msg.slot, metas)
            self.to_wake = lease.ring
            self.to_wake_frames += 1
            if lease.remote.state == "starting":  # its first frame: running now, not at the next heartbeat
                lease.remote.state = "running"
            lease.next_seq = max(lease.next_seq, msg.seq + 1)
            lease.remote.seq = lease.next_seq
            return True
        if not lease.ring.closed:
            self.bad_messages += 1
            log.warning("stream %s: a descriptor named slot %d, which is not lent at %dx%d: dropped", msg.stream,
                        msg.slot, msg.w, msg.h)
        return False

    def _fan_out(self, lease: Lease, slot: int, metas: list[FrameMeta]) -> None:
        """A stream feeding several pools: the frame its process wrote once into the first pool's slot, copied into
        each other pool's ring here (as RingGroup does for a thread; the copy releases the GIL). Never blocks: a
        live ring drops its oldest (counted), and an offline stream was lent slots only while every ring had room
        for the frames lent (`_lend`)."""
        seg = lease.segment
        if seg is None or not lease.fanout:
            return
        frame = seg.array[slot]
        for ring, m in zip(lease.fanout, metas):
            try:
                ring.write(m, frame, wait=False)
            except SourceError as err:  # a size its ring cannot hold: the stream fails, as a thread's would
                self.fail(lease, err.reason)
                return
            except Exception as err:  # noqa: BLE001 -- out of memory for a slot, say: this stream's failure, as
                # in a thread (RingGroup), never the I/O thread's, which is every stream's
                log.exception("stream %s: copying a frame into pool %s's ring failed", lease.stream, ring.pool)
                self.fail(lease, f"internal error: {type(err).__name__}: {err}")
                return

    def _lend(self, lease: Lease) -> list[int]:
        """The stream's free slots lent (FrameRing.lend). Offline and feeding several pools: no more than every
        other pool's ring has free slots for, beyond the frames already lent, so the copy never waits (the
        process waits for credit instead: back-pressure reaches the decoder, and no frame is lost)."""
        most = None
        if lease.fanout and lease.cfg.mode != "live":
            h, w = (lease.segment.h, lease.segment.w) if lease.segment is not None else (0, 0)
            most = min(r.free_slots(h, w) for r in lease.fanout) - lease.ring.lent()
        return lease.ring.lend(self.cfg.ingest.live_credit, most=most)

    def _event(self, lease: Lease, kind: str, reason: str) -> None:
        r = lease.remote
        if r.failed:
            return
        if kind in ("started", "connected"):
            r.state = "running"
        elif kind == "reconnecting":
            r.state = "reconnecting"
        self._emit(lease.stream, kind, reason)

    def _state(self, lease: Lease, msg: wire.StreamState) -> None:
        r = lease.remote
        if msg.final and msg.end_reason == "stopped" and not (lease.removing or lease.ring.closed):
            self._stopped_unasked(lease)
            return
        # a restarted process counts its stream's reconnects from 0: added to those of its earlier processes
        r.total_frames, r.reconnects = msg.total_frames, lease.reconnects_before + msg.reconnects
        r.source.decode_errors = msg.decode_errors
        r.lag_s = msg.lag_s
        if msg.decode_device:
            # the reason first: a reader of the device (streams.nvdec.cpu_fallback) never sees an older reason
            r.source.decode_reason = msg.decode_reason or r.source.decode_reason
            r.source.decode_device = msg.decode_device
        lease.next_seq = max(lease.next_seq, msg.seq)
        r.seq = lease.next_seq
        if not r.failed:
            r.state, r.failed, r.end_reason = msg.state, msg.failed, msg.end_reason
        if msg.final:
            self.end(lease)

    def _stopped_unasked(self, lease: Lease) -> None:
        """A process stopped a stream the engine never asked it to stop (an Exit or a RemoveStream the engine did
        not send): that is no end of stream. The process is killed, and its death restarts its streams under the
        restart policy, with the reason; one path for every way a process can go wrong."""
        proc = lease.proc
        if proc is None or proc.kill_reason:
            return
        proc.kill_reason = f"stopped stream {lease.stream} without being told to"
        log.error("ingest: %s %s: killing it", proc.label, proc.kill_reason)
        proc.kill()

    def _geometry(self, lease: Lease, h: int, w: int, gen: int) -> None:
        seg = lease.segment
        if seg is not None and (seg.h, seg.w) == (h, w) and gen < lease.gen:
            return  # it asked before the Slots it is being sent arrived (a first frame racing them): they will
        if lease.proc is not None:
            self._procs.send(lease.proc, self._new_segment(lease, h, w))

    # -- segments and credits ------------------------------------------------------------------------------------
    def _new_segment(self, lease: Lease, h: int, w: int) -> list:
        """A segment for the stream's frames of h x w, its slots and credits (or the stream fails)."""
        n = lease.ring.slots_needed(h, w)
        lease.segments_made += 1
        name = segment_name(self._run, lease.stream, lease.segments_made)
        try:
            seg = Segment(name, n, h, w, create=True, pixel_format=lease.ring.pixel_format)
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE) and not isinstance(err, ShmSpaceError):
                self._short_of_descriptors(lease, h, w, err)  # a flood of connections, say: retried
            else:
                self.fail(lease, f"no shared memory for its frames: {err}")
            return []
        lease.segment_retry = None
        try:
            lease.ring.set_geometry(h, w, seg)
        except SourceError as err:
            seg.unlink()
            self.fail(lease, err.reason)
            return []
        old, lease.segment = lease.segment, seg
        if old is not None:
            old.unlink()  # its frames still held stay mapped until released
        lease.gen = next(self._gens)
        slots = self._lend(lease)
        return [wire.Slots(lease.stream, lease.gen, name, n, h, w), wire.Credit(lease.stream, lease.gen, slots)]

    def _short_of_descriptors(self, lease: Lease, h: int, w: int, err: OSError) -> None:
        """A segment needs a descriptor for a moment, and the engine has none left: retried every second (the
        stream's frames meanwhile are shed at the source, counted); past ingest.start_timeout_s it fails."""
        now, limit = time.monotonic(), self.cfg.ingest.start_timeout_s
        since = lease.segment_retry[2] if lease.segment_retry else now
        if now - since > limit:
            lease.segment_retry = None
            self.fail(lease, f"no shared memory for its frames: {err} (for {limit:g} s, ingest.start_timeout_s)")
            return
        if lease.segment_retry is None:
            log.warning("stream %s: no descriptor left to make its frame slots (%s): retrying every second for up "
                        "to ingest.start_timeout_s=%g s", lease.stream, err, limit)
        lease.segment_retry = (h, w, since, now + 1.0)

    def top_up(self, streams: set[str]) -> None:
        """Lend the streams' free slots: one Credits message per process (one send, not one per stream)."""
        out: dict[int, tuple[IngestProcess, list[wire.Credit]]] = {}
        for stream in streams:
            lease = self.leases.get(stream)
            if lease is None or lease.proc is None or lease.segment is None:
                continue
            slots = self._lend(lease)
            if slots:
                out.setdefault(lease.proc.idx, (lease.proc, []))[1].append(wire.Credit(stream, lease.gen, slots))
        for proc, credits in out.values():
            self._procs.send(proc, [credits[0] if len(credits) == 1 else wire.Credits(credits)])

    # -- a stream's end ------------------------------------------------------------------------------------------
    def fail(self, lease: Lease, reason: str) -> None:
        r = lease.remote
        r.failed, r.state, r.end_reason = True, "failed", f"error: {reason}"
        log.error("stream %s: %s", lease.stream, reason)
        self._emit(lease.stream, "error", reason)
        for ring in lease.rings:
            ring.close()
        if lease.proc is not None and lease.proc.alive():
            lease.removing = True
            self._procs.send(lease.proc, [wire.RemoveStream(lease.stream)])
        else:
            self.end(lease)

    def copies_failed(self, failed: dict[str, str]) -> None:
        """Streams whose GPU copy events raised on query (cuda_slots.PendingFrames; their held frames were dropped,
        counted): each stopped with the reason, the engine and the other streams going on."""
        for stream, why in failed.items():
            lease = self.leases.get(stream)
            if lease is not None and not lease.remote.failed:
                self.fail(lease, f"the event of its GPU copies raised on query ({why}); stopped (a CUDA IPC stream, "
                                 "not run on a GPU yet)")

    def end(self, lease: Lease) -> None:
        """The stream is over in its process (its last frame committed before): slots back, segment unlinked."""
        for ring in lease.rings:
            ring.on_free = None
        self.pending.forget(lease.stream)
        lease.ring.reclaim()
        for ring in lease.rings:
            ring.close()
        if lease.segment is not None:
            lease.segment.unlink()
        proc, lease.proc = lease.proc, None
        if proc is not None:
            proc.streams.discard(lease.stream)
            if proc.dedicated and not proc.streams:
                self._procs.send(proc, [wire.Exit()])
        if self.leases.get(lease.stream) is lease:  # never a newer lease of the same id (re-added after a reap)
            del self.leases[lease.stream]
            self.policy.forget(lease.stream)
        if lease.remote.state not in ("failed", "ended"):
            lease.remote.state = "ended"
        lease.remote.ended()

    def apply(self, what: str, stream: str, credit: set[str]) -> None:
        """A request of another thread: "credit" (added to `credit`), "add" or "remove"."""
        lease = self.leases.get(stream)
        if lease is None:
            return
        if what == "credit":
            credit.add(stream)
        elif what == "add":
            self.place(lease)
        elif what == "remove" and not lease.removing:
            lease.removing = True
            if lease.proc is not None and lease.proc.alive():
                self._procs.send(lease.proc, [wire.RemoveStream(stream)])
            else:
                self.end(lease)

    # -- placement -----------------------------------------------------------------------------------------------
    def place(self, lease: Lease) -> None:
        try:
            proc = self._procs.pick(lease.stream, lease.stream in self.policy.isolated)
        except Exception as err:  # noqa: BLE001 -- any failure to start a process (ProcessManager.start) is this
            self._unplaced(lease, err)  # stream's, retried; never the I/O thread's, which is every stream's
            return
        if lease.unplaced_since is not None:
            log.warning("stream %s: placed on %s after %d failed tries", lease.stream, proc.label, lease.unplaced_tries)
        lease.unplaced_since, lease.unplaced_tries = None, 0
        lease.proc = proc
        proc.streams.add(lease.stream)
        lease.remote.process = proc.label
        lease.gen = next(self._gens)
        lease.assign_gen = lease.gen
        lease.dropped_seen = lease.expired_seen = 0
        lease.reconnects_before = lease.remote.reconnects  # what this stream's earlier processes counted
        lease.ring.reclaim()
        ic, src = self.cfg, self.cfg.source
        cmds: list = [wire.AddStream(lease.stream, lease.gen, lease.cfg.model_dump(mode="json"),
                                     src.model_dump(mode="json"), ic.ring.max_frame_pixels,
                                     ic.budget.latency_ms / 1e3, lease.next_seq, lease.ring.pixel_format,
                                     lease.decode)]
        seg = lease.segment
        if seg is not None:  # a restart: the same slots, lent again under the new generation
            cmds += [wire.Slots(lease.stream, lease.gen, seg.name, seg.count, seg.h, seg.w),
                     wire.Credit(lease.stream, lease.gen, self._lend(lease))]
        elif lease.size is not None:
            cmds += self._new_segment(lease, *lease.size)
        if lease.remote.failed:  # its segment could not be made (_new_segment failed it): nothing was sent, so no
            self.end(lease)      # final state will come from the process; it ends here
        else:
            self._procs.send(proc, cmds)

    def _unplaced(self, lease: Lease, err: BaseException) -> None:
        """No process could be started for the stream: retried with backoff (0.5 s doubling to 4 s; the I/O thread
        goes on, and so do the other streams), announced once with the reason (a `reconnecting` event); past
        ingest.start_timeout_s it fails with the reason."""
        now, limit = time.monotonic(), self.cfg.ingest.start_timeout_s
        why = f"no ingest process could be started for it: {type(err).__name__}: {err}"
        lease.unplaced_tries += 1
        if lease.unplaced_since is None:
            lease.unplaced_since = now
            log.warning("stream %s: %s; retrying with backoff for up to ingest.start_timeout_s=%g s",
                        lease.stream, why, limit)
            if not lease.remote.failed:
                lease.remote.state = "reconnecting"
                self._emit(lease.stream, "reconnecting", f"{why}; retrying for up to ingest.start_timeout_s={limit:g} s")
        if now - lease.unplaced_since > limit:
            self.fail(lease, f"{why} (tried {lease.unplaced_tries} times in {limit:g} s, ingest.start_timeout_s)")
        else:
            lease.retry_at = now + min(4.0, 0.5 * 2 ** (lease.unplaced_tries - 1))

    def retry(self, now: float) -> None:
        """Placements and segments that could not be made (out of processes or descriptors), tried again."""
        # list() first: the core thread inserts into leases (add), and a comprehension over the live view could
        # see it change size mid-iteration
        leases = list(self.leases.values())
        for lease in [x for x in leases if x.unplaced_since is not None and x.proc is None]:
            if lease.removing or lease.ring.closed:
                self.end(lease)
            elif now >= lease.retry_at:
                self.place(lease)
        for lease in [x for x in leases if x.segment_retry is not None]:
            h, w, _, at = lease.segment_retry
            if lease.proc is None or lease.removing or lease.ring.closed:
                lease.segment_retry = None
            elif now >= at:
                self._procs.send(lease.proc, self._new_segment(lease, h, w))

    def died(self, proc: IngestProcess, reason: str, closing: bool) -> None:
        """`proc` has exited (its uplink read to the end): its streams restarted, quarantined or failed."""
        if not proc.streams:
            if not (closing or proc.dedicated):
                log.warning("ingest: %s ended (%s) holding no stream", proc.label, reason)
            return
        self.restarts += 1
        log.error("ingest: %s died (%s) holding %d stream(s): %s; restarting them", proc.label, reason,
                  len(proc.streams), sorted(proc.streams))
        again = []
        for stream in sorted(proc.streams):
            lease = self.leases.get(stream)
            if lease is None:
                continue
            lease.proc = None
            self.pending.forget(stream)  # CUDA copies it queued and never finished: never admitted, counted
            lease.ring.reclaim()  # its lent slots; the frames it delivered stay READY and are published
            # removed, failed (a state it sent before dying), or stopped (its ring closed before the removal reached
            # the inbox): nothing to restart; it ends here rather than waiting for a final state that cannot come
            if lease.removing or lease.remote.failed or lease.ring.closed:
                self.end(lease)
                continue
            why = f"ingest process {proc.label} died ({reason})"
            decision = self.policy.died(stream)
            if decision == "fail":
                ic = self.cfg.ingest
                self.fail(lease, f"{why}; it died more than ingest.max_restarts={ic.max_restarts} times within "
                                 f"ingest.restart_window_s={ic.restart_window_s:g} s, also in a process of its own")
                continue
            lease.remote.state = "reconnecting"
            lease.remote.reconnects += 1
            tail = "; moved to a process of its own (it died too often)" if decision == "isolate" else "; restarting"
            self._emit(stream, "reconnecting", why + tail)
            again.append(lease)
        for lease in again:
            self.place(lease)

    def credit_after_death(self, proc: IngestProcess, touched: set[str]) -> None:
        """Credits for the streams a dead process's last frames touched: never for the dead process (its slots
        are reclaimed by `died`)."""
        self.top_up({s for s in touched if (lease := self.leases.get(s)) is not None and lease.proc is not proc})

    def close(self) -> None:
        """The hub is closing (every process has exited or was killed): segments unlinked, streams ended."""
        for lease in list(self.leases.values()):
            if lease.segment is not None:
                lease.segment.unlink()
            for ring in lease.rings:
                ring.on_free = None
            lease.remote.ended()
