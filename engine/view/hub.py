"""The live view's data side: a frame tap on the rings, the results as published, matched by `seq`.

Costs nothing while nobody watches: the tap and the publisher's listener return after reading one
counter. For a watched stream:
  * the tap runs on the worker thread when a worker has built its input from a ring slot (the
    models took what they need) and is about to free it; at most `view.fps` times a second per
    stream it copies the slot into one of two preallocated buffers (a memcpy; no resize, no
    encoding there). When both buffers wait for the encoder, the older frame is replaced and
    counted (`busy`): the data path never waits for the view. An NV12 slot (NVDEC, GPU memory) is
    not waited for there: the tap queues a device-to-device copy of it on the view's own CUDA stream
    behind the slot's write (and its readers' release event) and hands the ring an event after that
    copy, which the slot's next write waits on, on the GPU; the encoder thread waits on that event
    (blocking: it sleeps), converts the copy to RGB with the models' conversion and brings it to the
    host. So a viewed NV12 frame costs the worker thread a few queued calls, never a host sync;
  * the publisher thread hands over each message it sent for the stream (a bounded queue; an
    overflow is counted as `results_overflow`);
  * one encoder thread downscales and JPEG-encodes the frames (OpenCV, which releases the GIL) and
    matches them with their results by `seq`. Each page asks for the size it shows a stream at (a
    small tile needs fewer pixels, and decoding them costs the browser's CPU, which the models share
    on a small machine): a stream is encoded at the largest longer side any of its watchers asked
    for, at most `view.max_side` (which is also what a watcher that asks for nothing gets).
A frame is shown with the results of the same frame only, never on a later one. When the newest
results are for an older frame than the newest encoded one, the tile shows the newest frame that
has results and how far behind live it is. Every frame the tap took ends in one outcome of
`vidar_view_frames_total{outcome}`: shown, busy (replaced before encoding), unmatched (no result
came while it was held), or superseded (a newer frame with results was shown first).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from engine.models.colour import nv12_to_rgb
from engine.models.device import host_event

from engine.config import ViewConfig
from engine.executor.supervise import SupervisedThread
from engine.frames.lifecycle import FrameMeta

log = logging.getLogger("vidar.view")

HELD_FRAMES = 8       # encoded frames kept per stream, waiting for their results
HELD_RESULTS = 64     # seqs whose results are kept per stream
INBOX = 256           # published messages waiting for the encoder thread, per stream
OFFLINE_WAIT_S = 2.0  # offline frames have no deadline: a frame missing a pool's result is shown after this
MIN_SIDE = 64         # the smallest longer side a page may ask for (below it a tile shows nothing useful)
OUTCOMES = ("shown", "busy", "unmatched", "superseded", "results_overflow")


def _nv12_rgb(nv12: torch.Tensor, colour: tuple[str, str]) -> torch.Tensor:
    """One NV12 frame as an (H, W, 3) uint8 RGB view on its device (the view shows RGB JPEGs). The conversion
    is the models' (engine/models/colour.py); rare (at most view.fps frames a second)."""
    rgb = nv12_to_rgb(nv12.unsqueeze(0), *colour)[0].round_().clamp_(0, 255).to(torch.uint8)
    return rgb.permute(1, 2, 0)


@dataclass(slots=True)
class _Staged:
    """An NV12 frame the tap took: a copy of its slot queued on the view's stream, and the event after it."""

    nv12: torch.Tensor
    colour: tuple[str, str]
    done: object  # the blocking event after the copy (None: copied already, a CPU tensor)


@dataclass(slots=True)
class Frame:
    """An encoded view frame: the JPEG and what the page needs to draw the results on it."""

    seq: int
    pts: float
    t_capture: float
    width: int   # the stream's resolution: results (boxes, masks) are in these coordinates
    height: int
    jpeg: bytes
    final_at: float = math.inf  # monotonic: no further result can come after this (its deadline)


@dataclass
class _Stream:
    watchers: int = 0
    sizes: Counter = field(default_factory=Counter)  # longer side asked -> how many watchers ask for it
    live: bool = False        # the engine runs this stream (expect .. forget)
    gen: int = 0              # bumped whenever what is held is dropped: late work of an older gen is discarded
    kinds: tuple = ()         # the pools the stream feeds: a frame is complete with a result of each
    next_due: dict = field(default_factory=dict)    # pool -> when its next frame may be taken
    recent: deque = field(default_factory=lambda: deque(maxlen=32))  # seqs taken (a frame feeds 2 pools)
    pending: deque = field(default_factory=deque)   # (meta, buffer, gen, _Staged or None) for the encoder, <= 2
    free: list = field(default_factory=list)        # the two preallocated buffers when not in use
    shape: tuple = (0, 0)
    inbox: deque = field(default_factory=deque)     # published messages (dicts)
    frames: "OrderedDict[int, Frame]" = field(default_factory=OrderedDict)
    results: "OrderedDict[int, dict]" = field(default_factory=OrderedDict)  # seq -> {kind: message}
    shown: Optional[Frame] = None
    version: int = 0          # bumped when the shown frame or its results change
    told: int = 0             # the version the server was last told about
    event: Optional[dict] = None  # the last event (state changes: reconnecting, error, eos)
    newest_seq: int = -1      # newest frame seq the tap took
    counts: Counter = field(default_factory=Counter)


RESTARTS, RESTART_WINDOW_S = 3, 60.0  # encoder crashes tolerated (restarted) within the window


class ViewHub:
    """Owned by the engine; the web server reads it. Thread-safe: one lock guards the per-stream state,
    held for bookkeeping only (never while copying, resizing or encoding)."""

    def __init__(self, cfg: ViewConfig, on_update: Callable[[str], None] = lambda stream: None, *, cuda=None):
        """`cuda`: a fake of torch.cuda's Stream, Event and stream() (tests run the NV12 path on the CPU)."""
        self.cfg = cfg
        self._cuda = cuda
        # the view's CUDA streams, made on the first NV12 frame: one the worker threads queue slot copies on, one
        # the encoder thread converts and downloads on (never the legacy default stream, which every thread shares)
        self._copy_stream = None
        self._encode_stream = None
        self.on_update = on_update  # called on the encoder thread when a stream's shown frame changes
        self._lock = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._closed = False
        # the encoder thread is supervised (health(), every step of the engine core): restarted after a
        # crash, and after RESTARTS crashes within RESTART_WINDOW_S the engine dies rather than serve a
        # view that silently shows nothing
        self._encoder = SupervisedThread("live view encoder", self._run, max_failures=RESTARTS,
                                         window_s=RESTART_WINDOW_S)

    def health(self) -> Optional[str]:
        """None while the encoder runs (or after it was restarted); why not, when it keeps crashing."""
        return None if self._closed else self._encoder.health()

    # -- watchers (the web server) -------------------------------------------------------------
    def known(self, stream: str) -> bool:
        st = self._streams.get(stream)
        return st is not None and st.live

    def watch(self, stream: str, delta: int, size: Optional[int] = None) -> bool:
        """A page starts (+1) or stops (-1) watching a stream the engine runs (others are ignored: a
        page cannot make the hub hold anything for names of no stream), at `size` (the longer side it
        shows the stream at; None: `view.max_side`). A page stops with the size it started with; to
        change the size it starts with the new one before it stops with the old one (a count that
        touched zero would let go of what is held). Returns whether it was counted: a page records
        only starts that were, so that its stop can never take away another page's count."""
        size = self.side(size)
        with self._lock:
            st = self._streams.get(stream)
            if st is None or (delta > 0 and not st.live):
                return False
            st.sizes[size] = max(0, st.sizes[size] + delta)  # never below 0, whatever a page sends
            if not st.sizes[size]:
                del st.sizes[size]  # the encoder takes max() of the keys: only sizes someone asks for
            st.watchers = sum(st.sizes.values())
            if not st.watchers:  # nobody left: let go of what is held (memory is the tap's only cost)
                self._reset(st)
                if not st.live:
                    del self._streams[stream]
            return True

    def side(self, size: Optional[int]) -> int:
        """The longer side a watcher gets: what it asked, within [MIN_SIDE, view.max_side]."""
        return self.cfg.max_side if size is None else max(MIN_SIDE, min(int(size), self.cfg.max_side))

    @staticmethod
    def _reset(st: _Stream) -> None:
        """Lock held. Drop what is held; a page that comes back never gets a stale frame, and work in
        flight for what was dropped (a frame being encoded) is discarded by its generation."""
        st.counts["unmatched"] += len(st.pending) + len(st.frames)
        st.gen += 1
        st.shown, st.newest_seq = None, -1
        st.pending.clear()
        st.free.clear()
        st.frames.clear()
        st.results.clear()
        st.inbox.clear()
        st.recent.clear()
        st.next_due.clear()
        st.shape = (0, 0)

    def expect(self, stream: str, kinds: list[str]) -> None:
        """A stream starts, feeding these pools (a frame is complete with a result of each). A re-added id
        starts afresh: results of its previous run can never meet frames of this one."""
        with self._lock:
            st = self._streams.setdefault(stream, _Stream())
            self._reset(st)
            st.kinds, st.live = tuple(kinds), True

    def forget(self, stream: str) -> None:
        with self._lock:
            st = self._streams.get(stream)
            if st is None:
                return
            st.live = False
            self._reset(st)
            if not st.watchers:
                del self._streams[stream]

    # -- the tap (worker threads) ----------------------------------------------------------------
    def capture(self, meta: FrameMeta, pixels, pool: str = "", ready=None, after=None):
        """A worker of `pool` built its input from this ring slot and is about to free it. The cap is per
        pool: a slow pool (SAM 2) takes frames of its own, which get its results, while a fast one
        (classify) takes others. NV12 slots (NVDEC, GPU memory) come with `ready`, the event after which the
        slot holds the frame, and `after`, the slot's release event (its readers' work): a frame taken is
        copied on the view's stream after both (module docstring), and the event after that copy is returned
        for the ring to release the slot on. Returns None when nothing was queued (host frames, not taken)."""
        st = self._streams.get(meta.stream)
        if st is None or not st.watchers:
            return None
        now = time.monotonic()
        if now < st.next_due.get(pool, 0.0) or meta.seq in st.recent:
            return None
        nv12 = meta.pixel_format == "nv12"
        arr = None if nv12 else (pixels.numpy() if hasattr(pixels, "numpy") else pixels)
        want = (meta.height, meta.width, 3) if nv12 else arr.shape
        with self._lock:
            if not st.watchers or now < st.next_due.get(pool, 0.0) or meta.seq in st.recent:
                return None
            st.next_due[pool] = now + 1.0 / self.cfg.fps
            st.recent.append(meta.seq)
            if st.shape != want:  # first frame, or the stream changed size: two buffers of the new size
                st.counts["busy"] += len(st.pending)
                st.gen += 1  # a frame of the old size being encoded is let go, its buffer with it
                st.shape, st.pending = want, deque()
                st.free = [np.empty(want, np.uint8) for _ in range(2)]
            if st.free:
                buf = st.free.pop()
            elif st.pending:  # both buffers wait for the encoder: replace the older frame
                buf = st.pending.popleft()[1]
                st.counts["busy"] += 1
            else:  # one is being encoded, the other copied into by another pool's worker: skip this one
                st.counts["busy"] += 1
                return None
            shape, gen = st.shape, st.gen
        if buf.shape != shape:
            return None
        staged = None
        if nv12:  # a queued copy, converted on the encoder thread: nothing here waits on the GPU
            staged = self._stage(pixels, meta.colour, ready, after)
        else:
            np.copyto(buf, arr)  # outside the lock: this buffer belongs to this call now
        with self._lock:
            if st.gen != gen:  # the watchers left (or the stream was re-added) while copying
                st.counts["unmatched"] += 1
            else:
                st.pending.append((meta, buf, gen, staged))
                self._lock.notify()
        return staged.done if staged is not None else None

    def _stage(self, nv12: torch.Tensor, colour: tuple[str, str], ready, after) -> _Staged:
        """Worker thread: a copy of the NV12 slot queued on the view's copy stream, after the slot's write
        (`ready`) and its readers' work (`after`, so the returned event covers both and the ring can release
        the slot on it alone), and a blocking event after the copy, which only the encoder thread waits on."""
        cuda = self._cuda
        if cuda is None and nv12.device.type != "cuda":  # a CPU tensor (tests without a fake): copy now
            return _Staged(nv12.clone(), colour, None)
        cuda = cuda or torch.cuda
        if self._copy_stream is None:
            self._copy_stream = cuda.Stream(device=nv12.device)
            self._encode_stream = cuda.Stream(device=nv12.device)
        stream = self._copy_stream
        with cuda.stream(stream):
            for event in (ready, after):
                if event is not None:
                    stream.wait_event(event)
            copy = torch.empty_like(nv12)
            copy.copy_(nv12, non_blocking=True)
            # Host-waited (the encoder thread) hence blocking; if anything above raised, no copy was queued and
            # the ring releases the slot on `after` as if the view had not taken it (FrameRing._offer).
            done = host_event(cuda)
            done.record(stream)
        return _Staged(copy, colour, done)

    def _unstage(self, staged: _Staged, buf: np.ndarray) -> None:
        """Encoder thread: wait for the copy (blocking event: this thread sleeps), convert it to RGB on its
        device and bring it into `buf` (a synchronous download on the view's encode stream: off the data path)."""
        if staged.done is None:
            np.copyto(buf, _nv12_rgb(staged.nv12, staged.colour).numpy())
            return
        staged.done.synchronize()
        cuda = self._cuda or torch.cuda
        with cuda.stream(self._encode_stream):
            torch.from_numpy(buf).copy_(_nv12_rgb(staged.nv12, staged.colour))

    # -- published messages (the publisher thread) -------------------------------------------------
    def on_message(self, msg: dict) -> None:
        if msg.get("type") == "event":
            self.note_event(msg)
            return
        st = self._streams.get(msg.get("stream"))
        if st is None or not st.watchers:
            return
        with self._lock:
            if len(st.inbox) >= INBOX:
                st.inbox.popleft()
                st.counts["results_overflow"] += 1
            st.inbox.append(msg)
            self._lock.notify()

    def note_event(self, msg: dict) -> None:
        """Events are kept for every stream (a tile opened later shows why a stream stopped)."""
        with self._lock:
            st = self._streams.get(msg["stream"])
            if st is not None:
                st.event = msg

    # -- the web server's reads ----------------------------------------------------------------------
    def shown(self, stream: str) -> tuple[int, Optional[Frame], dict]:
        """(version, the frame to show, its results by kind)."""
        with self._lock:
            st = self._streams.get(stream)
            if st is None or st.shown is None:
                return 0, None, {}
            return st.version, st.shown, dict(st.results.get(st.shown.seq, {}))

    def state(self, stream: str) -> dict:
        with self._lock:
            st = self._streams.get(stream)
            if st is None:
                return {}
            out = {"counts": dict(st.counts), "event": st.event}
            if st.shown is not None:
                # behind the newest frame a worker took (not the decoder: frames the view's rate cap skipped
                # or that wait for a worker say nothing about results lagging)
                newest = max(st.frames.values(), key=lambda f: f.seq, default=st.shown)
                out["shown_seq"] = st.shown.seq
                out["behind_frames"] = max(0, newest.seq - st.shown.seq)
                out["behind_s"] = round(max(0.0, newest.t_capture - st.shown.t_capture), 3)
            return out

    def counters(self) -> dict[str, dict[str, int]]:
        """{outcome: {stream: n}} for the metrics."""
        with self._lock:
            return {o: {s: st.counts[o] for s, st in self._streams.items() if st.counts[o]} for o in OUTCOMES}

    # -- the encoder thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        import cv2

        # The models own the cores: the view's resize and encode run on this one thread (OpenCV's
        # setting is process-wide; nothing else in the engine's data path uses OpenCV).
        cv2.setNumThreads(1)
        try:  # and at a lower priority than the models' threads: on a busy machine the view waits, not them
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):  # not Linux, or not permitted: the cap and the drops still bound it
            pass
        while True:
            with self._lock:
                while not self._closed and not any(st.pending or st.inbox for st in self._streams.values()):
                    # held frames become final at their deadline: look again soon while there are some
                    if any(st.frames and st.watchers for st in self._streams.values()):
                        self._lock.wait(0.05)
                        break
                    self._lock.wait(0.5)
                if self._closed:
                    return
                # the size is read now, with the frame: a page that resizes gets the next frame at its size
                work = [(sid, st, st.pending.popleft() if st.pending else None, list(st.inbox),
                         max(st.sizes, default=self.cfg.max_side))
                        for sid, st in self._streams.items() if st.pending or st.inbox or st.frames]
                for _, st, _, _, _ in work:
                    st.inbox.clear()
            for sid, st, item, msgs, side in work:
                try:
                    if item is not None and item[3] is not None:
                        self._unstage(item[3], item[1])
                    frame = self._encode(cv2, item[0], item[1], side) if item is not None else None
                except Exception:  # a bad frame must not end the view (nor the engine)
                    log.exception("view: stream %s: encoding a frame failed", sid)
                    frame = None
                with self._lock:
                    if item is not None and item[2] != st.gen:  # let go meanwhile (page gone, size changed)
                        st.counts["unmatched"] += 1
                        frame = None
                    elif item is not None:
                        st.free.append(item[1])
                    changed = self._merge(st, frame, msgs)
                if changed:
                    self.on_update(sid)

    def _encode(self, cv2, meta: FrameMeta, buf: np.ndarray, side: int) -> Frame:
        """Downscale so the longer side is at most `side` (never up: the page scales, not the wire)."""
        h, w = buf.shape[:2]
        scale = min(1.0, side / max(h, w))
        # INTER_AREA is the right filter to shrink, but measured 6x slower than INTER_LINEAR at
        # non-integer factors (768x576 -> 640: 4.0 vs 0.6 ms); down to half size bilinear does not alias.
        interp = cv2.INTER_LINEAR if scale >= 0.5 else cv2.INTER_AREA
        img = buf if scale >= 1.0 else cv2.resize(buf, (max(1, round(w * scale)), max(1, round(h * scale))),
                                                  interpolation=interp)
        ok, jpeg = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR),
                                [cv2.IMWRITE_JPEG_QUALITY, self.cfg.jpeg_quality])
        if not ok:
            raise RuntimeError("cv2.imencode failed")
        # live: no result can come after the deadline (late ones are dropped); offline: wait a while
        final = meta.deadline if math.isfinite(meta.deadline) else time.monotonic() + OFFLINE_WAIT_S
        return Frame(meta.seq, meta.pts, meta.t_capture, w, h, jpeg.tobytes(), final + 0.05)

    def _merge(self, st: _Stream, frame: Optional[Frame], msgs: list[dict]) -> bool:
        """Lock held. Add a frame and results; show the newest held frame that has results."""
        if frame is not None:
            st.frames[frame.seq] = frame
            st.newest_seq = max(st.newest_seq, frame.seq)  # the newest frame a worker took
            while len(st.frames) > HELD_FRAMES:
                seq, _ = st.frames.popitem(last=False)
                st.counts["unmatched"] += 1
        for msg in msgs:
            if msg.get("type") == "event":
                st.event = msg
                continue
            seq = msg["seq"]
            st.results.setdefault(seq, {})[msg["type"]] = _slim(msg)
            st.results.move_to_end(seq)
            while len(st.results) > HELD_RESULTS:
                st.results.popitem(last=False)
            if st.shown is not None and seq == st.shown.seq:
                st.version += 1  # another pool's result for the frame on show
        now = time.monotonic()
        # complete (a result from every pool) or final (past its deadline: nothing more can come)
        ready = [s for s, f in st.frames.items() if s in st.results
                 and (set(st.kinds) <= set(st.results[s]) or now >= f.final_at)]
        if ready:
            best = max(ready)
            for seq in [s for s in st.frames if s <= best]:  # older frames can never be shown now
                f = st.frames.pop(seq)
                if seq != best:
                    st.counts["superseded" if seq in st.results else "unmatched"] += 1
                else:
                    st.shown = f
                    st.version += 1
                    st.counts["shown"] += 1
        changed, st.told = st.version != st.told, st.version
        return changed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._encoder.thread.join(2.0)


def _slim(msg: dict) -> dict:
    """A result as the page needs it: bytes (embeddings) left out, NaN made JSON-safe."""
    out = {}
    for k, v in msg.items():
        if isinstance(v, (bytes, bytearray)):
            continue
        out[k] = None if isinstance(v, float) and not math.isfinite(v) else v
    return out
