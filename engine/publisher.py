"""ZeroMQ publisher on its own thread: the data plane never touches the socket.

The socket is an XPUB with XPUB_NODROP, so a send into a full subscriber queue (HWM) fails
with EAGAIN instead of vanishing: plain PUB with the default HWM silently lost 30 % of an
unpaced burst here (shared/STACK.md). Live results that hit the HWM are dropped and counted
(`publish_hwm`); offline results wait (back-pressure), so nothing is lost while a subscriber
is connected. Trade-off: with NODROP one full subscriber makes that message fail for all;
the alternative, plain PUB, drops per subscriber but uncounted.

A live result is checked against its deadline right before sending: never published late.
Events and results share one FIFO, so a stream's eos always follows its last result.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import zmq

from .accounting import Accounting
from .config import PublishConfig
from .frame import DropReason, FrameMeta
from .schema import event_message, pack, result_message, topic

log = logging.getLogger("vidar.publish")


@dataclass(slots=True)
class _Result:
    acct: Accounting
    meta: FrameMeta
    kind: str
    weights: str
    fields: dict
    t_done: float  # monotonic, when the model finished


@dataclass(slots=True)
class _Event:
    stream: str
    kind: str
    reason: str
    on_sent: Optional[Callable[[], None]] = None


_STOP = object()


@dataclass
class PublisherStats:
    sent: int = 0
    events: int = 0
    hwm_drops: int = 0


class Publisher:
    def __init__(self, cfg: PublishConfig, *, ctx: Optional[zmq.Context] = None,
                 on_publish_latency: Callable[[float], None] = lambda s: None, curve=None):
        self.cfg = cfg
        self._ctx = ctx or zmq.Context.instance()
        self._q: queue.Queue = queue.Queue(maxsize=cfg.queue_size)
        self._abort = threading.Event()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # see every subscription, to count subscribers
        self._sock.setsockopt(zmq.LINGER, 500)
        if curve is not None:
            curve.server_socket(self._sock)
        try:
            self._sock.bind(cfg.endpoint)
        except zmq.ZMQError as err:
            self._sock.close(0)
            from .errors import ConfigError
            raise ConfigError(f"publish.endpoint: cannot bind {cfg.endpoint!r}: {err} "
                              "(another vidar running? pick another port)") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.subscriptions = 0
        self._subscribed = threading.Condition()
        self.stats = PublisherStats()
        self._on_publish_latency = on_publish_latency
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    # -- producer side (data plane threads) ------------------------------------------------
    def submit_result(self, acct: Accounting, meta: FrameMeta, kind: str, weights: str, fields: dict) -> None:
        item = _Result(acct, meta, kind, weights, fields, time.monotonic())
        if meta.live:
            try:
                self._q.put_nowait(item)
            except queue.Full:
                acct.drop(meta.stream, DropReason.PUBLISH_QUEUE)
            return
        if not self._put_blocking(item):
            acct.drop(meta.stream, DropReason.SHUTDOWN)

    def submit_event(self, stream: str, kind: str, reason: str, on_sent: Optional[Callable[[], None]] = None) -> None:
        if not self._put_blocking(_Event(stream, kind, reason, on_sent)):
            log.warning("stream %s: event %s not published (publisher stopped)", stream, kind)

    def _put_blocking(self, item: Any) -> bool:
        while not self._abort.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def wait_subscribers(self, n: int, timeout: float) -> bool:
        """Block until `n` subscriptions have been seen (slow-joiner guard for offline runs)."""
        deadline = time.monotonic() + timeout
        with self._subscribed:
            while self.subscriptions < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._subscribed.wait(min(left, 0.1))
        return True

    # -- publisher thread --------------------------------------------------------------------
    def _read_subscriptions(self) -> None:
        while True:
            try:
                msg = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] in (b"\x00", b"\x01"):
                with self._subscribed:
                    self.subscriptions += 1 if msg[:1] == b"\x01" else -1
                    self._subscribed.notify_all()

    def _send(self, frames: list[bytes], must_deliver: bool) -> bool:
        pause = 0.0002
        while True:
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                if not must_deliver or self._abort.is_set():
                    return False
                self._read_subscriptions()  # a subscriber that left frees its queue
                time.sleep(pause)
                pause = min(pause * 2, 0.01)

    def _handle(self, item: Any) -> None:
        if isinstance(item, _Event):
            msg = event_message(item.stream, item.kind, item.reason)
            self._send([topic("event", item.stream), pack(msg)], must_deliver=True)
            self.stats.events += 1
            if item.on_sent:
                item.on_sent()
            return
        meta, acct = item.meta, item.acct
        if meta.live and time.monotonic() > meta.deadline:
            acct.drop(meta.stream, DropReason.LATE)
            return
        msg = result_message(item.kind, stream=meta.stream, seq=meta.seq, pts=meta.pts, t_capture=meta.t_capture,
                             weights=item.weights, fields=item.fields)
        if self._send([topic(item.kind, meta.stream), pack(msg)], must_deliver=not meta.live):
            acct.publish(meta.stream, msg["latency_ms"])
            self.stats.sent += 1
            self._on_publish_latency(time.monotonic() - item.t_done)
        elif meta.live:
            self.stats.hwm_drops += 1
            acct.drop(meta.stream, DropReason.PUBLISH_HWM)
        else:
            acct.drop(meta.stream, DropReason.SHUTDOWN)

    def _run(self) -> None:
        while True:
            self._read_subscriptions()
            try:
                item = self._q.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _STOP:
                break
            if self._abort.is_set():
                self._discard(item)
                continue
            try:
                self._handle(item)
            except Exception:  # never let one bad message kill the publisher
                log.exception("publisher: could not publish a message")
                if isinstance(item, _Result):
                    item.acct.fail(item.meta.stream, "publish_error")
        self._sock.close()

    @staticmethod
    def _discard(item: Any) -> None:
        if isinstance(item, _Result):
            item.acct.drop(item.meta.stream, DropReason.SHUTDOWN)

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued (up to `timeout`), then close. Whatever is left is counted as shutdown."""
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + timeout
        while self._thread.is_alive():
            try:
                self._q.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    self._abort.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(2.0)
        while True:
            try:
                self._discard(self._q.get_nowait())
            except queue.Empty:
                break
