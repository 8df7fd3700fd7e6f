"""The control socket in tests: the asyncio control plane's socket task on a thread, and a config with the
control socket on a free port."""

from __future__ import annotations

import asyncio
import threading
import time

from engine.control.control_socket import serve
from tests.support.net import free_port


class ControlServer:
    """The asyncio control plane's socket task (the engine bound the socket at start), on a thread."""

    def __init__(self, engine):
        self.loop = asyncio.new_event_loop()
        self.stop = None
        self.t = threading.Thread(target=self._run, args=(engine,), daemon=True)
        self.t.start()
        time.sleep(0.2)

    def _run(self, engine):
        asyncio.set_event_loop(self.loop)
        self.stop = asyncio.Event()
        self.loop.run_until_complete(serve(engine, engine.control_socket, self.stop))

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.t.join(5)


def with_control(cfg):
    """The config with the control socket on a free port."""
    ctl = f"tcp://127.0.0.1:{free_port()}"
    cfg.control.enabled, cfg.control.endpoint = True, ctl
    return cfg, ctl
