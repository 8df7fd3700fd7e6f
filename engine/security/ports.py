"""A port left at its default that is taken moves to a free one; a port the config sets never moves.

Every engine listens on four ports by default (publish 5556, control 5557, metrics 9108, view 8080), so a
second engine on a machine used to fail to start until all four were moved by hand. Now a port whose key the
config does not set (not in the file, not by --set, not by on_cpu) and that is taken (EADDRINUSE) is bound on
a port the OS picks instead, said loudly at start with the key and the endpoint actually bound (a warning in
the log, and `vidar run` prints it with the command a client passes). A port the config sets is the user's
promise to their clients: taken, it stays a configuration error naming the key and the fix (exit 2).

Why a port the OS picks (ZeroMQ's `tcp://HOST:*`, port 0 for HTTP) and not the next one up, as Jupyter does:
the publisher's default (5556) is next to the control socket's (5557), so "the next free one" of one is the
default of the other and a third engine's ports interleave with the second's; ports above another service's
default may be its own defaults (8081, 9109); the ephemeral range is the OS's for exactly this, and the bind
is atomic (no probe-then-bind race between two engines starting at once). The OS's choice is not guessable,
so it is printed, as a moved port has to be passed to clients anyway (`vidar subscribe ENDPOINT`,
`vidar control --endpoint ENDPOINT`).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass


def left_default(section, key: str) -> bool:
    """`key` of this config section was not set (pydantic's `model_fields_set`): its default may move when
    taken. A section built by a program with `model_copy(update=...)` counts the updated keys as set."""
    return key not in section.model_fields_set


def in_use(err: BaseException) -> bool:
    """The bind failed because another socket holds the address (ZMQError and OSError both carry errno)."""
    return getattr(err, "errno", None) == errno.EADDRINUSE


def zmq_any_port(endpoint: str) -> str:
    """`tcp://127.0.0.1:5556` -> `tcp://127.0.0.1:*`: ZeroMQ's wildcard port (the OS picks a free one)."""
    head, sep, _ = endpoint.rpartition(":")
    if not sep or not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp:// endpoint with a port: {endpoint!r}")
    return f"{head}:*"


@dataclass(frozen=True)
class MovedPort:
    """A default port that was taken, and where the socket listens instead."""

    key: str     # the config key: publish.endpoint, control.endpoint, metrics.port, view.port
    wanted: str  # the default endpoint that was taken, e.g. tcp://127.0.0.1:5556
    bound: str   # the endpoint actually bound, e.g. tcp://127.0.0.1:40311

    def note(self) -> str:
        return (f"{self.key}: its default {self.wanted} is taken (another vidar on this machine?): listening on "
                f"{self.bound} instead (set {self.key} to choose)")
