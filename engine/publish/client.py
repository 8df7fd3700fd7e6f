"""Subscriber helper: results and events from a running vidar, as dicts.

Example::

    from engine.publish.client import Subscriber

    with Subscriber("tcp://127.0.0.1:5556", topics=["classify.cam1", "event."]) as sub:
        for msg in sub:
            if msg["type"] == "event":
                print(msg["stream"], msg["kind"], msg["reason"])
            else:
                index, label, p = msg["topk"][0]
                print(msg["stream"], msg["seq"], label, f"{p:.2f}", f"{msg['latency_ms']:.0f} ms")
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import zmq

from engine.publish.schema import unpack


class Subscriber:
    def __init__(self, endpoint: str = "tcp://127.0.0.1:5556", topics: Iterable[str] = ("",), *,
                 ctx: Optional[zmq.Context] = None, hwm: int = 100_000, curve: Optional[tuple[str, str]] = None):
        """curve: (client secret certificate, server public certificate) when the engine uses CURVE."""
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        if curve is not None:
            from engine.security.keys import client_socket
            client_socket(self._sock, *curve)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        for t in topics:  # ZeroMQ prefix match: "classify." is every stream's results
            self._sock.setsockopt(zmq.SUBSCRIBE, t.encode())

    def recv(self, timeout: Optional[float] = None) -> Optional[dict]:
        """The next message, or None after `timeout` seconds (None waits for ever)."""
        if timeout is not None and not self._sock.poll(int(timeout * 1000)):
            return None
        _topic, payload = self._sock.recv_multipart()
        return unpack(payload)

    def __iter__(self) -> Iterator[dict]:
        while True:
            yield self.recv()

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
