"""Subscribers in tests: the Collector (keeps every message until each stream's eos), and a subscriber
that never reads (to fill the publisher's queues)."""

from __future__ import annotations

import threading
import time

import zmq

from engine.publish.client import Subscriber


class Collector:
    """Subscribes before the engine starts and keeps every message until each of `streams` has sent an eos,
    then (linger_s > 0) until the publisher has been quiet for linger_s: other streams' last messages."""

    def __init__(self, endpoint, streams, linger_s=0.0):
        self.sub = Subscriber(endpoint, ["classify.", "event."])
        self.msgs, self.streams, self.linger_s = [], set(streams), linger_s
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        ended, quiet_until = set(), time.monotonic() + 30
        # short polls: `wait` may give up on an eos that never came (a run shorter than the subscriber's connect)
        # and close the socket, which must not happen under a poll of this thread's
        while not self.streams <= ended and not self._stop.is_set():
            m = self.sub.recv(0.2)
            if m is None:
                if time.monotonic() > quiet_until:
                    return
                continue
            quiet_until = time.monotonic() + 30
            self.msgs.append(m)
            if m["type"] == "event" and m["kind"] == "eos":
                ended.add(m["stream"])
        while self.linger_s > 0 and not self._stop.is_set() and (m := self.sub.recv(self.linger_s)) is not None:
            self.msgs.append(m)

    def wait(self, timeout=60):
        self._t.join(timeout)
        self._stop.set()
        self._t.join(5)
        self.sub.close()
        return self.msgs


def stuck_subscriber(endpoint, topics):
    """A subscriber that never reads, with the smallest queues (set before connecting, so they apply)."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    for t in topics:
        sock.setsockopt(zmq.SUBSCRIBE, t.encode())
    return sock
