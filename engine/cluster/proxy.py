"""One results endpoint for the whole cluster: a ZeroMQ XSUB -> XPUB proxy on the head.

The XSUB side connects to every engine's publisher and follows the engines as they come and go
(`follow`); libzmq's XSUB re-sends the subscriptions it holds to every publisher it connects to, so
a subscriber's topics reach engines started after it subscribed. The XPUB side binds
`cluster.publish.endpoint`, so `engine.publish.client.Subscriber` and `vidar subscribe` work unchanged.

Not `zmq.proxy()`: its sockets cannot be reconnected from another thread while it runs (ZeroMQ
sockets are not thread-safe), so this loop owns both sockets and applies endpoint changes between
polls. As the engines' publishers (engine/publish/delivery.py), a message a full subscriber cannot take
is sent to the other subscribers and missed by that one alone, counted (`missed`) and the subscriber
named in the log; the proxy never holds messages back (the engines' own publishers hold offline streams).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import zmq

from engine.publish.delivery import Delivery
from engine.security.binds import zmq_ipv6
from engine.security.sockets import guard_socket
from engine.errors import ConfigError

log = logging.getLogger("vidar.cluster")


class ResultsProxy:
    def __init__(self, endpoint: str, hwm: int, ctx: Optional[zmq.Context] = None):
        self._ctx = ctx or zmq.Context.instance()
        self._xpub = self._ctx.socket(zmq.XPUB)
        self._xpub.setsockopt(zmq.SNDHWM, hwm)
        self._xpub.setsockopt(zmq.XPUB_NODROP, 1)
        self._xpub.setsockopt(zmq.LINGER, 0)
        # every subscription and unsubscription reaches the engines, with the descriptor it came in on (delivery.py)
        self._xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._xpub.setsockopt(zmq.XPUB_VERBOSER, 1)
        self._xpub.setsockopt(zmq.IPV6, zmq_ipv6(endpoint))
        guard_socket(self._xpub)  # no ZMTP 1.0 peers, the handshake deadline
        self._delivery = Delivery(self._xpub, f"results proxy {endpoint}")  # before bind: sees every subscriber
        try:
            self._xpub.bind(endpoint)
        except zmq.ZMQError as err:
            self._delivery.close()
            self._xpub.close(0)
            raise ConfigError(f"cluster.publish.endpoint: cannot bind {endpoint!r}: {err} "
                              "(another vidar running? pick another port)") from None
        self.endpoint = self._xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._xsub = self._ctx.socket(zmq.XSUB)
        self._xsub.setsockopt(zmq.LINGER, 0)
        self._xsub.setsockopt(zmq.RCVHWM, hwm)
        self._wanted: set[str] = set()
        self._connected: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.forwarded = 0
        self._thread = threading.Thread(target=self._run, name="results-proxy", daemon=True)
        self._thread.start()

    def follow(self, endpoints: set[str]) -> None:
        """The engines' publisher endpoints now (applied by the proxy thread within 0.1 s)."""
        with self._lock:
            self._wanted = set(endpoints)

    @property
    def missed(self) -> int:
        """Messages a full subscriber missed (the others received them)."""
        return self._delivery.missed

    @property
    def upstreams(self) -> set[str]:
        with self._lock:
            return set(self._connected)

    def _apply(self) -> None:
        with self._lock:
            wanted = set(self._wanted)
        for ep in wanted - self._connected:
            self._xsub.connect(ep)
            log.info("results proxy: following %s", ep)
        for ep in self._connected - wanted:
            try:
                self._xsub.disconnect(ep)
            except zmq.ZMQError:
                pass
        with self._lock:
            self._connected = wanted

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._xsub, zmq.POLLIN)
        poller.register(self._xpub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._apply()
                events = dict(poller.poll(100))
                if self._xpub in events:  # subscriptions, upstream
                    for sub in self._delivery.read_subscriptions():
                        self._xsub.send(sub)
                self._delivery.tick()
                if self._xsub in events:  # messages, downstream
                    for _ in range(1000):
                        try:
                            msg = self._xsub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._delivery.send(msg, lossless=False)
                        self.forwarded += 1
        except Exception:
            log.exception("results proxy crashed")
        finally:
            self._xsub.close(0)
            self._delivery.close()
            self._xpub.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
