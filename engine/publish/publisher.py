"""ZeroMQ publisher on its own thread: the data plane never touches the socket, and no stream's
messages ever wait behind another stream's.

The socket is an XPUB with XPUB_NODROP, so a send into a full subscriber queue (HWM) fails with
EAGAIN instead of vanishing: plain PUB with the default HWM silently lost 30 % of an unpaced
burst here (shared/STACK.md). Each stream has its own FIFO outbox (its results and its events, in
order: a stream's eos always follows its last result). The thread serves the outboxes round-robin
and never blocks on a send (engine/publish/delivery.py):
  * a live result past its deadline is dropped (`late`): never published late;
  * a live result or a live stream's event that a full subscriber cannot take is sent to every other
    subscriber; the full one misses it (counted per stream: `missed`, vidar_publish_missed_total) and
    is named in the log with how long it has been full: one subscriber that stops reading costs only
    itself;
  * an offline result or event refused by a full subscriber stays at the head of its stream's outbox and
    is retried after a short pause, while the other streams go on. The offline stream itself
    stops: the engine core takes no more of its frames while its outbox is full (credit), so its
    ring fills and its decoder waits (back-pressure), and nothing else is delayed. Any connected
    subscriber of the stream's topic holds it back this way (lossless delivery to every subscriber).
    An event of a stream whose mode is not known yet (no result yet) waits up to EVENT_WAIT_S as an
    offline one, then goes as a live one.
Bounds, per stream: live results `publish.queue_size` (over it: dropped, `publish_queue`), offline
results the same (enforced upstream by the core's credit), events `EVENTS_PER_STREAM` (over it the
oldest non-eos event is dropped and counted in `events_dropped`).

Peers that do not complete ZeroMQ's handshake within its limit are closed and ZMTP 1.0 peers (two bytes,
`01 00`, made a raw TCP peer a subscriber of everything) are refused (engine/security/sockets.py
`guard_socket`).

Lock order: a pool's ledger lock (Accounting.lock) before this publisher's lock, never the reverse.
Results move into an outbox and out of it (published or dropped) under both, so the pool's
in-flight count (this publisher holds the results in its outboxes) is exact at every moment.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import zmq

from engine.frames.accounting import Accounting
from engine.publish.delivery import Delivery, Sent
from engine.security.binds import zmq_ipv6
from engine.security.ports import MovedPort, in_use, zmq_any_port
from engine.security.sockets import guard_socket
from engine.config import PublishConfig
from engine.frames.lifecycle import DropReason, FailReason, FrameMeta
from engine.publish.schema import EVENT_KINDS, event_message, pack, result_message, topic

log = logging.getLogger("vidar.publish")

EVENTS_PER_STREAM = 64   # pending events per stream (a subscriber at its HWM holds them back)
EVENT_WAIT_S = 2.0       # an event of a stream of unknown mode waits this long for a full subscriber
SEND_ROUND = 32          # messages of one stream per round-robin turn
RETRY_MIN_S, RETRY_MAX_S = 0.0002, 0.02  # pause before retrying a refused offline result or event
LOG_EVERY_S = 5.0        # dropped events are logged in aggregate


@dataclass(slots=True)
class _Result:
    acct: Accounting
    meta: FrameMeta
    kind: str
    weights: str
    fields: dict
    t_done: float  # monotonic, when it entered the outbox


@dataclass(slots=True)
class _Event:
    stream: str
    kind: str
    reason: str
    on_sent: Optional[Callable[[], None]] = None
    fields: Optional[Callable[[], dict]] = None  # extra fields, read when the event is sent


@dataclass
class _Outbox:
    items: deque = field(default_factory=deque)
    live: int = 0          # live results queued
    offline: int = 0       # offline results queued
    events: int = 0
    retry_at: float = 0.0  # parked until then (the head was refused)
    pause: float = RETRY_MIN_S
    is_live: Optional[bool] = None  # the stream's mode (from its results, or note_mode); None: not known yet
    refused_since: Optional[float] = None  # when its head was first refused (events of unknown mode)


@dataclass
class PublisherStats:
    sent: int = 0
    events: int = 0
    missed: Counter = field(default_factory=Counter)          # per stream: messages a full subscriber missed
    events_dropped: Counter = field(default_factory=Counter)  # per stream; the metric reads it
    encode_errors: Counter = field(default_factory=Counter)   # per stream: messages msgpack could not encode


class Publisher:
    def __init__(self, cfg: PublishConfig, *, ctx: Optional[zmq.Context] = None,
                 on_publish_latency: Callable[[float], None] = lambda s: None, curve=None, movable: bool = False):
        """`movable`: publish.endpoint is its default, left unset: taken, it moves to a port the OS picks
        (engine/security/ports.py), and `moved` says so."""
        self.cfg = cfg
        self.moved: Optional[MovedPort] = None
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        # every subscription and unsubscription message, with the descriptor it came in on: the delivery knows
        # which subscriber subscribed to what (delivery.py), and min_subscribers counts them
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._sock.setsockopt(zmq.XPUB_VERBOSER, 1)
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.setsockopt(zmq.IPV6, zmq_ipv6(cfg.endpoint))
        guard_socket(self._sock, curve=curve)  # CURVE, no ZMTP 1.0 peers, the handshake deadline
        # Subscribers are peers, not subscriptions (one subscriber may subscribe to many topics): the
        # socket monitor reports each accepted connection and its end, by file descriptor (before bind: all)
        self._delivery = Delivery(self._sock, f"publisher {cfg.endpoint}")
        try:
            try:
                self._sock.bind(cfg.endpoint)
            except zmq.ZMQError as err:
                if not (movable and in_use(err)):
                    raise
                self._sock.bind(zmq_any_port(cfg.endpoint))
                self.moved = MovedPort("publish.endpoint", cfg.endpoint, self._sock.getsockopt_string(zmq.LAST_ENDPOINT))
                log.warning("%s", self.moved.note())
        except zmq.ZMQError as err:
            self._delivery.close()
            self._sock.close(0)
            from engine.errors import BindError
            raise BindError("publish.endpoint", cfg.endpoint,
                            f"publish.endpoint: cannot bind {cfg.endpoint!r}: {err} (another vidar running? set "
                            "publish.endpoint to a free port, or leave it unset: its default moves to a free port "
                            "when taken)") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._delivery.name = f"publisher {self.endpoint}"
        self._peer_count = 0
        self.subscriptions = 0
        self._subscribed = threading.Condition()
        self._cond = threading.Condition()  # guards the outboxes; producers notify the thread
        self._boxes: dict[str, _Outbox] = {}
        self._held: dict[str, Counter] = {}  # pool -> results held per stream (the pools' ledgers read it)
        self._order: deque = deque()          # round-robin order of streams with something to send
        self._closing = False
        self._abort = threading.Event()
        self.stats = PublisherStats()
        self._evict_logged: dict[str, float] = {}
        self._slow: list[dict] = []  # subscribers whose queue is full (read by slow_subscribers)
        self._encode_logged: dict[str, float] = {}
        self.dead: Optional[str] = None  # why the thread died (a bug); None while it serves
        self._on_publish_latency = on_publish_latency
        self.listener: Optional[Callable[[dict], None]] = None  # the live view: each message sent, as a dict
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    # -- producer side (any thread) ------------------------------------------------------------
    def submit_results(self, acct: Accounting, items: list[tuple[FrameMeta, str, str, dict]]) -> None:
        """Queue results, never blocking. The caller holds `acct.lock` (the frames move from its
        holder into this one in one step). Live results over the stream's bound are dropped."""
        now = time.monotonic()
        with self._cond:
            held = self._held.setdefault(acct.pool, Counter())
            for meta, kind, weights, fields in items:
                box = self._box(meta.stream)
                if self._closing:  # closed, or its thread died (then the engine is dead: say so)
                    (acct.fail(meta.stream, FailReason.ENGINE_DEAD) if self.dead else
                     acct.drop(meta.stream, DropReason.SHUTDOWN))
                    continue
                if meta.live and box.live >= self.cfg.queue_size:
                    acct.drop(meta.stream, DropReason.PUBLISH_QUEUE)
                    continue
                box.items.append(_Result(acct, meta, kind, weights, fields, now))
                box.is_live = meta.live
                if meta.live:
                    box.live += 1
                else:
                    box.offline += 1
                held[meta.stream] += 1
            self._cond.notify()

    def submit_event(self, stream: str, kind: str, reason: str, on_sent: Optional[Callable[[], None]] = None,
                     fields: Optional[Callable[[], dict]] = None) -> None:
        """Queue an event after the stream's queued results. Never blocks; bounded per stream. `fields`
        is called when the event is sent (an eos's final counts: by then every result before it ended)."""
        if kind not in EVENT_KINDS:  # the caller's bug, raised here: never in the publisher's thread
            raise ValueError(f"event kind {kind!r} not in {EVENT_KINDS}")
        with self._cond:
            if self._closing and not self._thread.is_alive():
                self.stats.events_dropped[stream] += 1
                log.warning("stream %s: event %s not published (publisher closed)", stream, kind)
                return
            box = self._box(stream)
            if box.events >= EVENTS_PER_STREAM and self._evict_event(stream, box):
                self.stats.events_dropped[stream] += 1
            box.items.append(_Event(stream, kind, reason, on_sent, fields))
            box.events += 1
            self._cond.notify()

    def _box(self, stream: str) -> _Outbox:
        box = self._boxes.get(stream)
        if box is None:
            box = self._boxes[stream] = _Outbox()
            self._order.append(stream)
        return box

    def _evict_event(self, stream: str, box: _Outbox) -> bool:
        """Drop the oldest pending event but an eos, never the head (it may be on the wire). Logged at
        most once per stream every LOG_EVERY_S, with the count."""
        for i, item in enumerate(box.items):
            if i and isinstance(item, _Event) and item.kind != "eos":
                del box.items[i]
                box.events -= 1
                now = time.monotonic()
                if now - self._evict_logged.get(stream, -LOG_EVERY_S) >= LOG_EVERY_S:
                    self._evict_logged[stream] = now
                    log.warning("stream %s: more than %d events held back by a subscriber at its HWM: dropping the "
                                "oldest (%d so far, vidar_events_dropped_total)", stream, EVENTS_PER_STREAM,
                                self.stats.events_dropped[stream] + 1)
                return True
        return False

    def note_mode(self, stream: str, live: bool) -> None:
        """The stream's mode, known before its first result (its events then know how to wait)."""
        with self._cond:
            self._box(stream).is_live = live

    def backlog(self, stream: str) -> int:
        """Offline results of a stream waiting to be sent (the core's credit counts them through `held`)."""
        with self._cond:
            box = self._boxes.get(stream)
            return box.offline if box else 0

    def held(self, pool: str) -> Counter:
        """Results of `pool` in the outboxes, by stream. Exact when read under that pool's ledger lock."""
        with self._cond:
            return Counter(self._held.get(pool, ()))

    def forget(self, stream: str) -> None:
        """A removed stream's outbox and counters go (only once it is empty)."""
        with self._cond:
            box = self._boxes.get(stream)
            if box is not None and not box.items:
                del self._boxes[stream]
            for held in self._held.values():
                if not held.get(stream):
                    held.pop(stream, None)
            self.stats.events_dropped.pop(stream, None)
            self.stats.encode_errors.pop(stream, None)
            self.stats.missed.pop(stream, None)
            self._evict_logged.pop(stream, None)
            self._encode_logged.pop(stream, None)

    def wait_subscribers(self, n: int, timeout: float) -> bool:
        """Block until `n` subscribers are connected and have subscribed (slow-joiner guard for
        offline runs). Subscribers are counted as connected peers; ZeroMQ does not say which peer sent
        which subscription, so `n` peers with `n` subscriptions between them pass (a peer refused by
        CURVE never subscribes)."""
        deadline = time.monotonic() + timeout
        with self._subscribed:
            while self._peer_count < n or self.subscriptions < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._subscribed.wait(min(left, 0.1))
        return True

    @property
    def subscribers(self) -> int:
        return self._peer_count

    def slow_subscribers(self) -> list[dict]:
        """Subscribers whose queue is full now: address and for how long (seconds)."""
        with self._cond:
            return list(self._slow)

    # -- publisher thread -----------------------------------------------------------------------
    def _read_subscriptions(self) -> None:
        msgs = self._delivery.read_subscriptions()
        self._delivery.tick()
        peers = len(self._delivery.watch.peers)
        now = time.monotonic()
        slow = [{"peer": p.address, "full_s": round(now - p.slow_since, 1)} for p in self._delivery.slow()]
        with self._cond:
            self._slow = slow
        if not msgs and peers == self._peer_count:
            return
        with self._subscribed:
            for msg in msgs:
                self.subscriptions += 1 if msg[:1] == b"\x01" else -1
            self._peer_count = peers
            self._subscribed.notify_all()

    def _send(self, stream: str, frames: list[bytes], lossless: bool) -> bool:
        """True when sent (to every subscriber, or to all but a full one: counted in `missed`)."""
        sent = self._delivery.send(frames, lossless=lossless)
        if sent is Sent.MISSED:
            self.stats.missed[stream] += 1
        return sent is not Sent.REFUSED

    def _serve(self, stream: str, now: float) -> None:
        """Send up to SEND_ROUND messages of one stream; park it when the head is refused."""
        for _ in range(SEND_ROUND):
            with self._cond:
                box = self._boxes.get(stream)
                if box is None or not box.items or box.retry_at > now:
                    return
                item = box.items[0]
            if isinstance(item, _Event):
                try:
                    msg = event_message(item.stream, item.kind, item.reason)
                    if item.fields is not None:
                        msg.update(item.fields())
                    payload = pack(msg)
                except Exception as err:  # cannot happen with our events' fields; never let it end the thread
                    self._unencodable_event(box, item, err)
                    continue
                if not self._send(item.stream, [topic("event", item.stream), payload], self._lossless_event(box, now)):
                    return self._park(box, now)
                with self._cond:
                    box.items.popleft()
                    box.events -= 1
                    box.pause = RETRY_MIN_S
                    box.refused_since = None
                self.stats.events += 1
                self._listen(msg)
                if item.on_sent:
                    item.on_sent()
            elif not self._serve_result(box, item, now):
                return

    @staticmethod
    def _lossless_event(box: _Outbox, now: float) -> bool:
        """An offline stream's event waits for a full subscriber; a live stream's does not; one of a stream
        of unknown mode waits up to EVENT_WAIT_S."""
        if box.is_live is not None:
            return not box.is_live
        if box.refused_since is None:
            box.refused_since = now
        return now - box.refused_since < EVENT_WAIT_S

    def _serve_result(self, box: _Outbox, item: _Result, now: float) -> bool:
        meta = item.meta
        t_mono = time.monotonic()
        if meta.live and t_mono > meta.deadline:
            self._finish(box, item, lambda: item.acct.drop(meta.stream, DropReason.LATE))
            return True
        # latency from the same reading as the deadline check, on the monotonic clock (the wall clock steps)
        latency_ms = (t_mono - meta.t_capture_mono) * 1e3 if math.isfinite(meta.t_capture_mono) else None
        msg = result_message(item.kind, stream=meta.stream, seq=meta.seq, pts=meta.pts, t_capture=meta.t_capture,
                             weights=item.weights, fields=item.fields, latency_ms=latency_ms)
        try:
            payload = pack(msg)
        except Exception as err:  # msgpack: OverflowError (an int past 64 bits), TypeError, ValueError (depth)
            self._count_unencodable(meta.stream, f"{item.kind} result seq {meta.seq}", err)
            self._finish(box, item, lambda: item.acct.fail(meta.stream, FailReason.ENCODE_ERROR))
            return True  # this frame failed; the stream and every other go on
        # live: a full subscriber misses it, the others get it; offline: refused until every subscriber has room
        if self._send(meta.stream, [topic(item.kind, meta.stream), payload], lossless=not meta.live):
            self._finish(box, item, lambda: item.acct.publish(meta.stream, msg["latency_ms"]))
            self.stats.sent += 1
            self._on_publish_latency(time.monotonic() - item.t_done)
            self._listen(msg)
            return True
        self._park(box, now)  # offline: keep it, retry later; other streams go on
        return False

    def _count_unencodable(self, stream: str, what: str, err: Exception) -> None:
        """A message msgpack cannot encode: counted per stream, logged at most every LOG_EVERY_S per stream."""
        self.stats.encode_errors[stream] += 1
        now = time.monotonic()
        if now - self._encode_logged.get(stream, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._encode_logged[stream] = now
            log.error("stream %s: %s cannot be encoded (%s: %s): not published (%d so far)", stream, what,
                      type(err).__name__, err, self.stats.encode_errors[stream])

    def _unencodable_event(self, box: _Outbox, item: _Event, err: Exception) -> None:
        """The event is dropped and counted; its on_sent still runs, so a stream's lifecycle (an eos that
        lets a removed stream go) never waits for a message that can never be sent."""
        self._count_unencodable(item.stream, f"event {item.kind}", err)
        with self._cond:
            box.items.popleft()
            box.events -= 1
            self.stats.events_dropped[item.stream] += 1
        if item.on_sent:
            item.on_sent()

    def _listen(self, msg: dict) -> None:
        if self.listener is not None:
            try:
                self.listener(msg)
            except Exception:  # the view's bug must not stop publishing
                log.exception("publisher listener failed")

    def _finish(self, box: _Outbox, item: _Result, terminal: Callable[[], None]) -> None:
        with item.acct.lock, self._cond:
            box.items.popleft()
            if item.meta.live:
                box.live -= 1
            else:
                box.offline -= 1
            box.pause = RETRY_MIN_S
            self._held[item.acct.pool][item.meta.stream] -= 1
            terminal()

    @staticmethod
    def _park(box: _Outbox, now: float) -> None:
        box.retry_at = now + box.pause
        box.pause = min(box.pause * 2, RETRY_MAX_S)

    def _next_wake(self, now: float) -> float:
        with self._cond:
            waits = [b.retry_at - now for b in self._boxes.values() if b.items]
        return min([0.05] + waits)

    def _run(self) -> None:
        try:
            while not self._abort.is_set():
                self._read_subscriptions()
                now = time.monotonic()
                with self._cond:
                    streams = [s for s in self._order if s in self._boxes]
                    self._order = deque(streams)
                    pending = any(b.items for b in self._boxes.values())
                    if not pending:
                        if self._closing:
                            break
                        self._cond.wait(0.05)
                        continue
                for stream in streams:
                    self._serve(stream, now)
                wait = self._next_wake(time.monotonic())
                if wait > 0:
                    with self._cond:
                        self._cond.wait(wait)
        except BaseException as err:  # never die silently: the engine core sees `dead` and the engine dies (exit 3)
            self.dead = f"publisher thread crashed: {type(err).__name__}: {err}"
            log.exception("publisher thread crashed")
        finally:
            self._discard_all()
            self._delivery.close()
            self._sock.close()

    def health(self) -> Optional[str]:
        """None while the thread serves (or was closed); why it died otherwise. The engine core checks it
        every step: a publisher that died is engine death, never a silent engine that publishes nothing."""
        return self.dead  # set by the thread for anything that ends it but close() (BaseException caught)

    def _discard_all(self) -> None:
        """Close or abort: what is still queued is counted (results as dropped(shutdown); after a crash as
        failed(engine_dead))."""
        with self._cond:
            self._closing = True
            boxes = list(self._boxes.items())
        for stream, box in boxes:
            while True:
                with self._cond:
                    if not box.items:
                        break
                    item = box.items[0]
                if isinstance(item, _Event):
                    with self._cond:
                        box.items.popleft()
                        box.events -= 1
                    self.stats.events_dropped[stream] += 1
                    log.info("stream %s: event %s not published (publisher stopped)", stream, item.kind)
                elif self.dead:
                    self._finish(box, item, lambda: item.acct.fail(item.meta.stream, FailReason.ENGINE_DEAD))
                else:
                    self._finish(box, item, lambda: item.acct.drop(item.meta.stream, DropReason.SHUTDOWN))

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued (up to `timeout`), then close. Whatever is left is counted as shutdown."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(2.0)

    def pending(self) -> dict[str, int]:
        """Messages waiting, by stream (status, tests)."""
        with self._cond:
            return {s: len(b.items) for s, b in self._boxes.items() if b.items}
