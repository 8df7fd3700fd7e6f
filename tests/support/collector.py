"""Subscribers in tests: the Collector (keeps every message until each stream's eos), and a subscriber
that never reads (to fill the publisher's queues)."""

from __future__ import annotations

import threading

import zmq

from engine.publish.client import Subscriber


class Collector:
    """Subscribes before the engine starts and keeps every message until each of `streams` has sent an eos,
    then (linger_s > 0) until the publisher has been quiet for linger_s: other streams' last messages."""

    def __init__(self, endpoint, streams, linger_s=0.0):
        self.sub = Subscriber(endpoint, ["classify.", "event."])
        self.msgs, self.streams, self.linger_s = [], set(streams), linger_s
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        ended = set()
        while not self.streams <= ended:
            m = self.sub.recv(30)
            if m is None:
                return
            self.msgs.append(m)
            if m["type"] == "event" and m["kind"] == "eos":
                ended.add(m["stream"])
        while self.linger_s > 0 and (m := self.sub.recv(self.linger_s)) is not None:
            self.msgs.append(m)

    def wait(self, timeout=60):
        self._t.join(timeout)
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
