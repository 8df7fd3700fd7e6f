"""Ports for tests: a free TCP port on 127.0.0.1 (for the publisher, the control socket, the view, servers).
Shared with the benchmarks through engine/testing/net.py."""

from __future__ import annotations

from engine.testing.net import free_port

__all__ = ["free_port"]
